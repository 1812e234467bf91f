"""A second real server: --api-key, --served-model-name (two names), --max-waiting-requests 0
(every generation request is over the limit -> 503), and exit 0 on SIGTERM."""

from __future__ import annotations

import openai
import pytest

try:
    import httpx2 as httpx
except ImportError:
    import httpx

from server_fixtures import ServerProcess

KEY = "sk-test"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--api-key", KEY, "--served-model-name", "m1", "m2",
                        "--max-waiting-requests", "0").start()
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    assert "shutdown complete" in srv.log()


def test_missing_or_wrong_key_is_401_with_error_shape(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.base_url + "/v1/completions", json={"model": "m1", "prompt": "x"},
                       headers=headers)
        assert r.status_code == 401
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.base_url + "/health").status_code == 200   # not behind the key


def test_tokenizer_routes_sit_behind_the_key(server):
    calls = [("POST", "/tokenize", {"model": "m1", "prompt": "Hi"}),
             ("POST", "/detokenize", {"model": "m1", "tokens": [1, 2]}),
             ("GET", "/tokenizer_info", None)]
    for method, path, body in calls:
        r = httpx.request(method, server.base_url + path, json=body)
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "AuthenticationError"
        ok = httpx.request(method, server.base_url + path, json=body,
                           headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200, (path, ok.text)
    assert httpx.get(server.base_url + "/ping").status_code == 200   # probes need no key


def test_served_model_names_are_listed_and_accepted(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["m1", "m2"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="x", max_tokens=2)


def test_over_max_waiting_requests_is_503(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="m2", prompt="x", max_tokens=2)
    assert info.value.status_code == 503
    assert "overloaded" in info.value.body["message"]


def test_cors_is_off_unless_origins_are_allowed(server):
    hdr = {"Origin": "http://evil.example"}
    r = httpx.get(server.base_url + "/health", headers=hdr)
    assert "access-control-allow-origin" not in r.headers


def test_allowed_origin_gets_cors_headers_and_preflight():
    srv = ServerProcess("--allowed-origins", "http://app.example").start()
    try:
        ok = {"Origin": "http://app.example"}
        r = httpx.get(srv.base_url + "/v1/models", headers=ok)
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        pre = httpx.options(srv.base_url + "/v1/chat/completions",
                            headers={**ok, "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 204 and "POST" in pre.headers["access-control-allow-methods"]
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body,
                          headers=ok) as s:
            assert s.headers["access-control-allow-origin"] == "http://app.example"
        other = httpx.get(srv.base_url + "/v1/models", headers={"Origin": "http://x.example"})
        assert "access-control-allow-origin" not in other.headers
    finally:
        assert srv.stop() == 0
