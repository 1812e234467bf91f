"""LoRA adapters over HTTP: `--enable-lora --lora-modules`, the adapter's name as `model`,
`/v1/models` with `parent`, runtime load/unload behind --api-key while requests run, 404 in
OpenAI's error shape for an unknown adapter, 400 naming the field for a bad one; and the
command-line forms of --lora-modules."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("peft")

KEY = "sk-lora"


def _post(base, path, body, key=KEY):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(base + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    from lora_helpers import hf_model, write_adapter, write_tiny
    from server_fixtures import ServerProcess
    tmp = tmp_path_factory.mktemp("lora-server")
    base = write_tiny(tmp / "base")
    model = hf_model(base)
    a0 = write_adapter(model, tmp / "a0", r=8, targets=("q_proj", "v_proj"), seed=1)
    a1 = write_adapter(model, tmp / "a1", r=4, targets=("o_proj", "down_proj"), seed=2)
    big = write_adapter(model, tmp / "big", r=16, targets=("q_proj",), seed=3)
    server = ServerProcess(str(base), "--dtype", "float32", "--max-model-len", "256", "--enable-lora",
                           "--max-loras", "2", "--max-lora-rank", "8", "--api-key", KEY,
                           "--allow-runtime-lora-updating",
                           "--chat-template", "{% for m in messages %}{{ m['content'] }} {% endfor %}",
                           "--lora-modules", f"a0={a0}", json.dumps({"name": "a0b", "path": str(a0),
                                                                      "base_model_name": "tiny"}),
                           log_path=tmp / "server.log")
    server.start()
    try:
        yield server, dict(a0=a0, a1=a1, big=big), str(base)
    finally:
        server.stop()


def _complete(base, model, prompt="t5 t6 t7 t8 t9", **kw):
    return _post(base, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 4,
                                           "temperature": 0, "logprobs": 1} | kw)


def test_adapters_are_models_with_parent_and_answer_under_their_name(lora_server):
    server, paths, base_name = lora_server
    req = urllib.request.Request(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req) as r:
        cards = {c["id"]: c for c in json.loads(r.read())["data"]}
    assert cards["a0"]["parent"] == base_name and cards["a0"]["root"] == str(paths["a0"])
    assert cards["a0b"]["parent"] == "tiny"
    assert cards[base_name]["parent"] is None
    status, body = _complete(server.base_url, "a0")
    assert status == 200, body
    out = json.loads(body)
    assert out["model"] == "a0"
    status, base_body = _complete(server.base_url, base_name)
    assert status == 200
    # the same prompt under the adapter scores differently from the base model
    assert json.loads(base_body)["choices"][0]["logprobs"]["token_logprobs"] != \
        out["choices"][0]["logprobs"]["token_logprobs"]
    # the same adapter under two names gives the same answer
    assert json.loads(_complete(server.base_url, "a0b")[1])["choices"][0]["logprobs"] == out["choices"][0]["logprobs"]
    status, body = _post(server.base_url, "/v1/chat/completions",
                         {"model": "a0", "messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 2})
    assert status == 200 and json.loads(body)["model"] == "a0", body


def test_responses_api_takes_the_adapter_name_as_model(lora_server):
    """/v1/responses serves `model` = an adapter under that adapter, as /v1/chat/completions does."""
    server, _, base_name = lora_server
    messages = [{"role": "user", "content": "t5 t6 t7 t8"}]

    def chat(model):
        status, body = _post(server.base_url, "/v1/chat/completions", {"model": model, "messages": messages,
                                                                        "max_tokens": 8, "temperature": 0})
        assert status == 200, body
        return json.loads(body)["choices"][0]["message"]["content"]

    def respond(model):
        status, body = _post(server.base_url, "/v1/responses", {"model": model, "input": messages,
                                                                 "max_output_tokens": 8, "temperature": 0})
        return status, json.loads(body)

    assert chat("a0") != chat(base_name)       # else the comparison below shows nothing
    for model in ("a0", base_name):
        status, out = respond(model)
        assert status == 200 and out["model"] == model, out
        assert out["output"][0]["content"][0]["text"] == chat(model)
    status, out = respond("nope")
    assert status == 404 and out["error"]["param"] == "model", out


def test_unknown_adapter_is_404_in_openai_shape(lora_server):
    server, _, _ = lora_server
    status, body = _complete(server.base_url, "nope")
    assert status == 404
    err = json.loads(body)["error"]
    assert err["type"] == "NotFoundError" and err["param"] == "model" and "nope" in err["message"]


def test_load_and_unload_at_run_time_while_requests_run(lora_server):
    server, paths, base_name = lora_server
    url = server.base_url
    assert _post(url, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(paths["a1"])},
                 key=None)[0] == 401
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = [pool.submit(_complete, url, m, max_tokens=24) for m in ("a0", base_name, "a0b")]
        status, text = _post(url, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(paths["a1"])})
        assert status == 200 and "a1" in text, text
        assert _complete(url, "a1")[0] == 200
        assert all(f.result()[0] == 200 for f in running)
    status, body = _post(url, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(paths["a1"])})
    assert status == 400 and "already been loaded" in body
    # a bad adapter: 400 naming the field, the server keeps serving
    status, body = _post(url, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(paths["big"])})
    assert status == 400 and "max_lora_rank" in json.loads(body)["error"]["message"], body
    status, body = _post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/dir"})
    assert status == 400 and json.loads(body)["error"]["param"] == "lora_path", body
    status, body = _post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "p" * 5000})
    assert status == 400 and json.loads(body)["error"]["param"] == "lora_path", body
    assert _post(url, "/v1/load_lora_adapter", {"lora_name": "x"})[0] == 400
    status, text = _post(url, "/v1/unload_lora_adapter", {"lora_name": "a1"})
    assert status == 200, text
    assert _complete(url, "a1")[0] == 404
    status, body = _post(url, "/v1/unload_lora_adapter", {"lora_name": "a1"})
    assert status == 404 and json.loads(body)["error"]["type"] == "NotFoundError"
    assert _complete(url, "a0")[0] == 200


def test_metrics_name_the_adapters_of_running_requests(lora_server):
    """`lora_requests_info` (vLLM's, what llm-d routes LoRA requests by): max_lora and, while a
    request under adapter a0 runs, a0 among the running adapters; none once it is done."""
    import re
    server, _, _ = lora_server
    url = server.base_url

    def info():
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        m = re.search(r'^jaxserve:lora_requests_info\{(.*)\} (\S+)$', text, re.M)
        assert m, text[-2000:]
        return dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))), float(m.group(2))

    seen = set()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        job = pool.submit(_complete, url, "a0", max_tokens=200, ignore_eos=True)
        while not job.done():
            labels, value = info()
            seen.add(labels["running_lora_adapters"])
        assert job.result()[0] == 200
    assert labels["max_lora"] == "2" and value > 0
    assert "a0" in seen, seen
    deadline = time.monotonic() + 30
    while info()[0]["running_lora_adapters"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert info()[0]["running_lora_adapters"] == ""


def test_lora_modules_flag_forms():
    from jaxserve.server.openai.lora import parse_lora_module
    assert parse_lora_module("cs=./lora-cs") == ("cs", "./lora-cs", None)
    assert parse_lora_module('{"name": "f", "path": "/p", "base_model_name": "m"}') == ("f", "/p", "m")
    for bad in ("nameonly", "=path", '{"name": "f"}', '{"name": "f", "path": "p", "rank": 2}', "{bad"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)


def test_run_batch_takes_the_adapter_name_as_model(lora_server, tmp_path):
    import subprocess
    import sys
    server, paths, base = lora_server
    lines = [{"custom_id": c, "method": "POST", "url": "/v1/completions",
              "body": {"model": m, "prompt": "t5 t6 t7", "max_tokens": 2, "temperature": 0}}
             for c, m in (("lora", "a0"), ("base", base), ("missing", "nope"))]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cmd = [sys.executable, "-m", "jaxserve.server.cli", "run-batch", "-i", str(src), "-o", str(dst), base,
           "--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "64",
           "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"a0={paths['a0']}",
           "--disable-progress-bar"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = {x["custom_id"]: x for x in map(json.loads, dst.read_text().splitlines())}
    assert out["lora"]["response"]["status_code"] == 200, done.stderr[-3000:]
    assert out["lora"]["response"]["body"]["model"] == "a0"
    assert out["base"]["response"]["status_code"] == 200
    assert out["missing"]["response"]["status_code"] == 404
