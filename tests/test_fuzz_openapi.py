"""Fuzz the running server from its own `/openapi.json` with schemathesis (property-based,
hypothesis): valid and invalid bodies for every operation must never get a 5xx, and every error
body must have OpenAI's shape."""

from __future__ import annotations

import pytest
import requests
from server_fixtures import ServerProcess

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

pytestmark = pytest.mark.slow

# A short context keeps every generated request cheap on CPU (a long max_tokens is a 400).
_server = ServerProcess("--max-model-len", "96", "--max-num-seqs", "8")


@pytest.fixture(scope="module", autouse=True)
def server():
    _server.start()
    yield _server
    assert _server.stop() == 0, _server.log()[-3000:]


def _schema():
    # loaded lazily: the server is started by the fixture, after collection
    return schemathesis.openapi.from_url(_server.base_url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(scope="module")
def api_schema(server):
    return _schema()


@schema.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_5xx_and_openai_error_shape(case):
    response = case.call(base_url=_server.base_url, timeout=60)
    case.validate_response(response, checks=[not_a_server_error])
    if response.status_code >= 400 and response.headers.get("Content-Type", "").startswith(
            "application/json"):
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["code"] == response.status_code


def test_openapi_document_lists_every_route(server):
    doc = requests.get(server.base_url + "/openapi.json", timeout=10).json()
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize",
                                 "/detokenize", "/tokenizer_info", "/v1/models", "/health",
                                 "/ping", "/version", "/metrics", "/v1/responses",
                                 "/v1/responses/{response_id}", "/v1/load_lora_adapter",
                                 "/v1/unload_lora_adapter"}
    assert doc["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    load = doc["paths"]["/v1/load_lora_adapter"]["post"]
    assert load["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/LoadLoRAAdapterRequest")
    assert doc["components"]["schemas"]["LoadLoRAAdapterRequest"]["required"] == ["lora_name", "lora_path"]
    assert doc["components"]["schemas"]["UnloadLoRAAdapterRequest"]["required"] == ["lora_name"]
    assert "text/plain" in load["responses"]["200"]["content"] and "404" in load["responses"]


@pytest.mark.parametrize("path,marker", [("/docs", "SwaggerUIBundle"), ("/redoc", "<redoc spec-url")])
def test_interactive_docs_pages_read_the_openapi_document(server, path, marker):
    """/docs (Swagger UI) and /redoc, as FastAPI/vLLM serve them: HTML over /openapi.json, and
    not in the document themselves (so the fuzzer above never calls them)."""
    r = requests.get(server.base_url + path, timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/html")
    assert marker in r.text and "/openapi.json" in r.text
    doc = requests.get(server.base_url + "/openapi.json", timeout=10).json()
    assert path not in doc["paths"]
