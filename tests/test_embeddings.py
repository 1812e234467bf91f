"""Pooling models (`runner="pooling"`): embeddings through `LLM.embed` / `LLM.encode` and
`POST /v1/embeddings`, against Hugging Face transformers on a tiny random Qwen3 checkpoint saved
as a sentence-transformers embedding model (Qwen3-Embedding's layout: `Qwen3ForCausalLM`
weights, `modules.json`, `1_Pooling/config.json` with last-token pooling, a Normalize module).

The oracle is the final hidden state after the model's last norm (`model.model(...)
.last_hidden_state`), pooled (last token, or mean over the prompt) and L2-normalized. Prompts
of several lengths share one batch, and one is longer than the step's token budget
(`max_num_batched_tokens`) so its prefill spans several chunks.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve import LLM  # noqa: E402
from jaxserve.pooling_params import PoolingParams  # noqa: E402

VOCAB, HIDDEN = 96, 64
CHUNK = 16                  # max_num_batched_tokens: the step's token budget
ENGINE = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=CHUNK, max_num_seqs=4,
              block_size=4, num_gpu_blocks_override=96)
# Lengths in one batch: short, block-straddling, and 40 > CHUNK (three prefill chunks).
LENGTHS = (3, 9, 40, 17)
COS_TOL, ABS_TOL = 1e-4, 1e-3


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(1, VOCAB, size=n).tolist() for n in LENGTHS]


def _write_embedding_model(path, *, matryoshka: bool = False) -> torch.nn.Module:
    """A random 2-layer Qwen3 saved as a sentence-transformers embedding model; returns the
    transformers model (f32, eval). Every parameter is randomised (norms too)."""
    from jaxserve.tokenizer.tokenizer import Tokenizer
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, rms_norm_eps=1e-5,
                                      tie_word_embeddings=True, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    if matryoshka:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(dict(cfg, is_matryoshka=True)))
    (path / "tokenizer.json").write_text(Tokenizer.synthetic(VOCAB, 2).backend.to_str())
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "unk_token": "t0"}))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {}}))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": HIDDEN, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
        "pooling_mode_lasttoken": True}))
    return model


def _reference(model, ids: list[int], pooling: str) -> np.ndarray:
    """transformers: hidden states after the final norm, pooled, L2-normalized."""
    with torch.no_grad():
        h = model.model(torch.tensor([ids])).last_hidden_state[0].numpy()
    v = h[-1] if pooling == "LAST" else h.mean(axis=0)
    return v / np.linalg.norm(v)


def _assert_close(got, ref, what: str) -> None:
    got = np.asarray(got, np.float64)
    cos = 1.0 - float(got @ ref / (np.linalg.norm(got) * np.linalg.norm(ref)))
    diff = float(np.abs(got - ref).max())
    print(f"{what}: cosine distance {cos:.2e}, max |diff| {diff:.2e}")
    assert cos < COS_TOL and diff < ABS_TOL, (what, cos, diff)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-embedding")
    return path, _write_embedding_model(path)


@pytest.fixture(scope="module")
def embed_llm(model_dir):
    """runner "auto": the sentence-transformers files make it a pooling model (LAST)."""
    with LLM(str(model_dir[0]), **ENGINE) as llm:
        yield llm


def test_sentence_transformers_checkpoint_runs_as_a_last_token_pooling_model(embed_llm):
    engine = embed_llm.llm_engine
    assert engine.pooler.pooling_type == "LAST" and engine.pooler.normalize
    assert engine.cache_config.enable_prefix_caching       # LAST keeps prefix caching


def test_embed_matches_transformers_last_token_normalized(embed_llm, model_dir):
    model = model_dir[1]
    prompts = _prompts()
    outs = embed_llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    for n, p, out in zip(LENGTHS, prompts, outs):
        emb = out.outputs.embedding
        assert isinstance(emb, list) and len(emb) == HIDDEN == out.outputs.hidden_size
        assert abs(np.linalg.norm(emb) - 1.0) < 1e-5
        _assert_close(emb, _reference(model, p, "LAST"), f"LAST, {n} tokens")
    # Again, now through the prefix cache (the shared prefixes are cached blocks): same vectors.
    again = embed_llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    assert max(o.num_cached_tokens for o in again) > 0
    for a, b in zip(outs, again):
        np.testing.assert_allclose(a.outputs.embedding, b.outputs.embedding, atol=1e-5)


def test_encode_text_prompts_and_unnormalized_vectors(embed_llm, model_dir):
    model = model_dir[1]
    ids = [5, 17, 42, 8]
    out, = embed_llm.encode("t5 t17 t42 t8", PoolingParams(normalize=False), use_tqdm=False)
    assert out.prompt_token_ids == ids
    with torch.no_grad():
        raw = model.model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
    np.testing.assert_allclose(out.outputs.data, raw, atol=ABS_TOL)
    assert isinstance(out.outputs.data, np.ndarray) and out.outputs.data.dtype == np.float32


def test_embed_truncate_prompt_tokens_keeps_the_last_tokens(embed_llm, model_dir):
    long = list(range(1, 81))                     # 80 tokens > max_model_len 64
    with pytest.raises(ValueError, match="maximum model length"):
        embed_llm.embed({"prompt_token_ids": long}, use_tqdm=False)
    out, = embed_llm.embed({"prompt_token_ids": long}, truncate_prompt_tokens=10, use_tqdm=False)
    assert out.prompt_token_ids == long[-10:]
    _assert_close(out.outputs.embedding, _reference(model_dir[1], long[-10:], "LAST"), "truncated")


def test_embed_refuses_dimensions_on_a_model_without_matryoshka(embed_llm):
    with pytest.raises(ValueError, match="dimensions"):
        embed_llm.embed("t1 t2", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)


def test_a_pooling_model_does_not_generate(embed_llm):
    with pytest.raises(ValueError, match="pooling model"):
        embed_llm.generate("t1 t2", use_tqdm=False)


def test_mean_pooling_from_pooler_config_matches_transformers(model_dir):
    model = model_dir[1]
    prompts = _prompts()
    with LLM(str(model_dir[0]), runner="pooling",
             pooler_config={"pooling_type": "MEAN", "normalize": True}, **ENGINE) as llm:
        # MEAN reads every prompt token: prefix caching is off (a hit would skip tokens)
        assert not llm.llm_engine.cache_config.enable_prefix_caching
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for n, p, out in zip(LENGTHS, prompts, outs):
        _assert_close(out.outputs.embedding, _reference(model, p, "MEAN"), f"MEAN, {n} tokens")


def test_mean_pooling_starts_over_after_a_preemption(model_dir):
    """A request preempted between prefill chunks (recompute: its KV is dropped) starts its
    prompt over; the running sum restarts with it, so the mean is still the prompt's."""
    model = model_dir[1]
    prompt = np.random.default_rng(3).integers(1, VOCAB, size=40).tolist()
    with LLM(str(model_dir[0]), runner="pooling", pooler_config={"pooling_type": "MEAN"},
             **ENGINE) as llm:
        engine = llm.llm_engine
        engine.add_request("r", {"prompt_token_ids": prompt}, PoolingParams())
        assert engine.step() == []                      # the first chunk of three
        request = engine.scheduler.get_request("r")
        assert request.num_computed_tokens == CHUNK
        engine.scheduler._preempt(request)              # what a full KV pool would do
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert request.num_preemptions == 1 and [o.request_id for o in outs] == ["r"]
    _assert_close(outs[0].outputs.data, _reference(model, prompt, "MEAN"), "MEAN after preemption")


def test_matryoshka_dimensions_truncate_then_normalize(tmp_path):
    model = _write_embedding_model(tmp_path, matryoshka=True)
    ids = _prompts()[2]
    with LLM(str(tmp_path), **ENGINE) as llm:
        out, = llm.embed({"prompt_token_ids": ids}, pooling_params=PoolingParams(dimensions=16),
                         use_tqdm=False)
        with pytest.raises(ValueError, match="dimensions"):
            llm.embed("t1", pooling_params=PoolingParams(dimensions=HIDDEN + 1), use_tqdm=False)
    with torch.no_grad():
        v = model.model(torch.tensor([ids])).last_hidden_state[0, -1, :16].numpy()
    _assert_close(out.outputs.embedding, v / np.linalg.norm(v), "matryoshka 16")


def test_runner_flags_are_checked():
    from jaxserve.config import EngineArgs
    with pytest.raises(ValueError, match="runner"):
        EngineArgs(runner="embedding")
    with pytest.raises(ValueError, match="convert"):
        EngineArgs(convert="classify")
    with pytest.raises(ValueError, match="pooling_type"):
        EngineArgs(pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="unknown key"):
        EngineArgs(pooler_config={"pooling": "MEAN"})


def test_a_generate_model_refuses_embed():
    tiny = Path(__file__).parent / "data" / "tiny-llama"
    with LLM(str(tiny), load_format="dummy", warmup=False, max_model_len=64,
             num_gpu_blocks_override=16) as llm:
        assert llm.llm_engine.pooler is None
        with pytest.raises(ValueError, match="runner='pooling'"):
            llm.embed("t1 t2", use_tqdm=False)


# --- HTTP: /v1/embeddings ------------------------------------------------------------------------

SERVER_ENGINE = ("--dtype", "float32", "--max-model-len", "64", "--max-num-batched-tokens",
                 str(CHUNK), "--max-num-seqs", "4", "--block-size", "4",
                 "--num-gpu-blocks-override", "96")


def _post(base_url: str, path: str, body: dict) -> tuple[int, dict]:
    from server_fixtures import post_json
    return post_json(base_url + path, body)


@pytest.fixture(scope="module")
def embed_server(model_dir):
    from server_fixtures import ServerProcess
    server = ServerProcess(str(model_dir[0]), "--runner", "pooling", "--served-model-name",
                           "qwen3-embedding", *SERVER_ENGINE).start()
    yield server
    server.stop()


def test_openai_client_embeddings_match_transformers(embed_server, model_dir):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=embed_server.base_url + "/v1", api_key="unused")
    prompts = _prompts()
    # The client asks for base64 and decodes it: the bytes must be little-endian float32.
    res = client.embeddings.create(model="qwen3-embedding", input=prompts)
    assert [d.index for d in res.data] == [0, 1, 2, 3]
    assert res.usage.prompt_tokens == res.usage.total_tokens == sum(LENGTHS)
    for n, p, d in zip(LENGTHS, prompts, res.data):
        _assert_close(d.embedding, _reference(model_dir[1], p, "LAST"), f"HTTP LAST, {n} tokens")
    one = client.embeddings.create(model="qwen3-embedding", input="t5 t17 t42",
                                   encoding_format="float")
    assert one.usage.prompt_tokens == 3
    _assert_close(one.data[0].embedding, _reference(model_dir[1], [5, 17, 42], "LAST"), "text")


def test_float_and_base64_encodings_carry_the_same_vector(embed_server):
    body = {"input": ["t1 t2 t3", "t4"], "model": "qwen3-embedding"}
    status, plain = _post(embed_server.base_url, "/v1/embeddings", body)
    assert status == 200 and plain["object"] == "list" and plain["model"] == "qwen3-embedding"
    status, b64 = _post(embed_server.base_url, "/v1/embeddings", dict(body, encoding_format="base64"))
    assert status == 200
    for a, b in zip(plain["data"], b64["data"]):
        assert a["object"] == "embedding"
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), "<f4")
        np.testing.assert_array_equal(decoded, np.asarray(a["embedding"], np.float32))
    assert plain["usage"] == {"prompt_tokens": 4, "total_tokens": 4}


def test_truncate_prompt_tokens_lets_a_long_input_through(embed_server, model_dir):
    long = list(range(1, 81))
    status, err = _post(embed_server.base_url, "/v1/embeddings", {"input": long})
    assert status == 400 and err["error"]["param"] == "input"
    assert "maximum context length is 64" in err["error"]["message"]
    status, ok = _post(embed_server.base_url, "/v1/embeddings",
                       {"input": long, "truncate_prompt_tokens": 12})
    assert status == 200 and ok["usage"]["prompt_tokens"] == 12
    _assert_close(ok["data"][0]["embedding"], _reference(model_dir[1], long[-12:], "LAST"), "trunc")


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ["t1", ""]}, "input"),
    ({"input": [1, 2, 999]}, "input"),
    ({"input": "t1", "encoding_format": "binary"}, "encoding_format"),
    ({"input": "t1", "dimensions": 8}, "dimensions"),
    ({"input": "t1", "dimensions": 0}, "dimensions"),
    ({"input": "t1", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": 5}, "input"),
    ({}, "input"),
], ids=["empty-string", "empty-list", "empty-token-list", "one-empty-string", "out-of-vocab",
        "encoding-format", "dimensions-not-matryoshka", "dimensions-zero", "truncate-zero",
        "not-a-list", "missing"])
def test_bad_embedding_requests_are_400s_naming_the_field(embed_server, body, param):
    status, err = _post(embed_server.base_url, "/v1/embeddings", body)
    assert status == 400, err
    assert err["error"]["param"] is not None and err["error"]["param"].startswith(param), err


def test_a_pooling_server_refuses_completions(embed_server):
    for path, body in [("/v1/completions", {"prompt": "t1"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t1"}]})]:
        status, err = _post(embed_server.base_url, path, body)
        assert status == 400 and "does not support" in err["error"]["message"], err
    status, _ = _post(embed_server.base_url, "/v1/embeddings", {"input": "t3"})
    assert status == 200          # still serving


def test_a_generate_server_refuses_embeddings():
    from server_fixtures import ServerProcess
    tiny = Path(__file__).parent / "data" / "tiny-llama"
    server = ServerProcess(str(tiny), "--load-format", "dummy", "--max-model-len", "64",
                           "--num-gpu-blocks-override", "16", "--max-num-batched-tokens", "16").start()
    try:
        status, err = _post(server.base_url, "/v1/embeddings", {"input": "t1 t2"})
        assert status == 400 and err["error"]["param"] == "model"
        assert "does not support Embeddings API" in err["error"]["message"]
    finally:
        server.stop()


def test_run_batch_answers_embedding_lines(tmp_path, model_dir):
    import subprocess
    import sys
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": ["t5 t17 t42", "t1 t2"], "encoding_format": "float"}},
             {"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "body": {"input": ""}},
             {"custom_id": "c", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "t1", "max_tokens": 2}}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc = subprocess.run([sys.executable, "-m", "jaxserve.server.cli", "run-batch", "-i", str(src),
                           "-o", str(dst), str(model_dir[0]), "--ordered", "--disable-progress-bar",
                           *SERVER_ENGINE], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]          # two lines fail (400s)
    out = {r["custom_id"]: r["response"] for r in map(json.loads, dst.read_text().splitlines())}
    assert out["a"]["status_code"] == 200
    body = out["a"]["body"]
    assert body["usage"]["prompt_tokens"] == 5 and len(body["data"]) == 2
    _assert_close(body["data"][0]["embedding"], _reference(model_dir[1], [5, 17, 42], "LAST"), "batch")
    assert out["b"]["status_code"] == 400 and out["b"]["body"]["error"]["param"] == "input"
    assert out["c"]["status_code"] == 400 and "pooling model" in out["c"]["body"]["error"]["message"]


def test_fuzzed_embedding_requests_never_get_a_5xx(embed_server):
    """schemathesis, from the server's own /openapi.json: valid and invalid /v1/embeddings
    bodies on a pooling server get 200 or a 4xx in OpenAI's error shape, never a 5xx."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    schema = schemathesis.openapi.from_url(embed_server.base_url + "/openapi.json")
    operation = schema.find_operation_by_path("POST", "/v1/embeddings")
    seen = set()

    @given(case=operation.as_strategy())
    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def call(case):
        response = case.call(base_url=embed_server.base_url, timeout=60)
        case.validate_response(response, checks=[not_a_server_error])
        seen.add(response.status_code)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error

    call()
    print("statuses seen:", sorted(seen))
    assert 400 in seen


_TP_CHILD = """
import json, sys
from jaxserve import LLM
path, prompts, pooling, engine = json.loads(sys.argv[1])
with LLM(path, runner="pooling", pooler_config={"pooling_type": pooling}, tensor_parallel_size=2,
         **engine) as llm:
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
print(json.dumps([o.outputs.embedding for o in outs]))
"""


def test_tensor_parallel_pooling_matches_transformers(model_dir):
    """Two simulated devices (heads split): the pooled rows come back replicated and equal."""
    import os
    import subprocess
    import sys
    prompts = _prompts()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _TP_CHILD,
                           json.dumps([str(model_dir[0]), prompts, "MEAN", ENGINE])],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for p, emb in zip(prompts, got):
        _assert_close(emb, _reference(model_dir[1], p, "MEAN"), f"tp=2 MEAN, {len(p)} tokens")
