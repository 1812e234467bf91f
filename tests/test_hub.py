"""Hub names (org/name) are downloaded through huggingface_hub, here from a local fake hub
(tests/fake_hub.py, 127.0.0.1 only): only loadable files, at a revision, with HF_TOKEN sent,
from the cache when HF_HUB_OFFLINE is set, resuming a download cut mid-file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fake_hub import FakeHub

from jaxserve.loader.hub import looks_like_hub_name, resolve_model
from jaxserve.loader.loader import ModelLoadError

TINY = Path(__file__).parent / "data" / "tiny-llama"
TOKEN = "hf_test_token_123"
LOADABLE = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def _tiny_files() -> dict[str, bytes]:
    """A random tiny Llama (tests/data/tiny-llama shapes) as safetensors, with the synthetic
    word-level tokenizer ("t5 t17" <-> [5, 17]) saved as tokenizer.json."""
    from safetensors.numpy import save

    from jaxserve.tokenizer.tokenizer import Tokenizer
    cfg = json.loads((TINY / "config.json").read_text())
    E, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, K, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)
    t = {"model.embed_tokens.weight": w(V, E), "lm_head.weight": w(V, E), "model.norm.weight": np.ones(E, np.float32)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": np.ones(E, np.float32),
              p + "post_attention_layernorm.weight": np.ones(E, np.float32),
              p + "self_attn.q_proj.weight": w(H * D, E), p + "self_attn.k_proj.weight": w(K * D, E),
              p + "self_attn.v_proj.weight": w(K * D, E), p + "self_attn.o_proj.weight": w(E, H * D),
              p + "mlp.gate_proj.weight": w(F, E), p + "mlp.up_proj.weight": w(F, E),
              p + "mlp.down_proj.weight": w(E, F)}
    tokenizer = Tokenizer.synthetic(V, cfg["eos_token_id"]).backend.to_str().encode()
    return {"config.json": json.dumps(cfg).encode(), "model.safetensors": save(t),
            "tokenizer.json": tokenizer,
            "tokenizer_config.json": json.dumps({"eos_token": "t2", "unk_token": "t0"}).encode(),
            # never downloaded: other formats, sub-folders
            "pytorch_model.bin": b"pickle" * 100, "consolidated.pt": b"pt" * 100,
            "model.Q4_0.gguf": b"GGUF" * 100, "onnx/model.safetensors": b"x" * 100}


@pytest.fixture(scope="module")
def hub():
    hub = FakeHub().start()
    files = _tiny_files()
    hub.add("acme/tiny", files)
    hub.v2 = hub.add("acme/tiny", files | {"extra.json": b"{}"}, revision="v2")
    hub.add("acme/gguf-only", {"config.json": b"{}", "model.Q4_0.gguf": b"GGUF" * 1000,
                               "model.Q8_0.gguf": b"GGUF" * 2000})
    hub.files = files
    yield hub
    hub.stop()


@pytest.fixture
def online(hub, monkeypatch, tmp_path):
    """huggingface_hub pointed at the fake hub (its constants are read at import time, so they
    are patched here; the subprocess test sets the environment instead), HF_TOKEN set."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.requests.clear()
    return tmp_path / "hf-cache"


def _gets(hub) -> list[str]:
    return [path.split("/resolve/", 1)[1].split("/", 1)[1] for method, path, _ in hub.requests
            if method == "GET" and "/resolve/" in path]


def test_hub_names_are_told_from_paths():
    assert looks_like_hub_name("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert looks_like_hub_name("org/name/file.Q4_0.gguf")
    for text in ("./a/b", "~/a/b", "/a/b", "a", "a/b/c", "a/b/c.bin", "../a/b", "a/../b"):
        assert not looks_like_hub_name(text), text
    with pytest.raises(ModelLoadError, match="'./nowhere/model' does not exist"):
        resolve_model("./nowhere/model")


def test_llm_downloads_only_loadable_files_loads_and_generates(hub, online):
    from jaxserve import LLM, SamplingParams
    with LLM(model="acme/tiny", download_dir=str(online), max_model_len=64,
             kv_cache_memory_bytes=8 << 20, warmup=False) as llm:
        out = llm.generate("t5 t17 t300", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        folder = Path(llm.llm_engine.model_path)
    assert len(out[0].outputs[0].token_ids) == 4
    assert folder.is_relative_to(online / "models--acme--tiny" / "snapshots")
    assert {p.name for p in folder.iterdir()} == LOADABLE
    assert sorted(_gets(hub)) == sorted(LOADABLE)
    assert (folder / "model.safetensors").read_bytes() == hub.files["model.safetensors"]
    # HF_TOKEN goes to every request, as a bearer token
    assert hub.requests and all(h.get("Authorization") == f"Bearer {TOKEN}" for _, _, h in hub.requests)


def test_a_draft_model_may_be_a_hub_name(hub, online):
    from jaxserve import LLM, SamplingParams
    with LLM(model="acme/tiny", speculative_config={"model": "acme/tiny", "num_speculative_tokens": 2},
             load_format="dummy", download_dir=str(online), max_model_len=64,
             kv_cache_memory_bytes=8 << 20, warmup=False) as llm:
        out = llm.generate("t5 t17", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert "model.safetensors" not in _gets(hub)          # dummy weights: configs only


def test_revision_is_honoured(hub, online):
    folder = Path(resolve_model("acme/tiny", revision="v2", download_dir=str(online), weights=False))
    assert folder.name == hub.v2 and (folder / "extra.json").exists()
    assert not (folder / "model.safetensors").exists()        # weights=False: configs and tokenizer
    main = Path(resolve_model("acme/tiny", download_dir=str(online), weights=False))
    assert main.name != hub.v2 and not (main / "extra.json").exists()
    with pytest.raises(ModelLoadError, match=r"'acme/tiny' at revision 'nope'.*RevisionNotFound"):
        resolve_model("acme/tiny", revision="nope", download_dir=str(online))


def test_offline_resolves_from_the_cache_or_says_why_not(hub, online, monkeypatch):
    from huggingface_hub import constants
    folder = resolve_model("acme/tiny", download_dir=str(online))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.requests.clear()
    assert resolve_model("acme/tiny", download_dir=str(online)) == folder
    assert hub.requests == []
    with pytest.raises(ModelLoadError, match=r"'acme/elsewhere'.*HF_HUB_OFFLINE is set"):
        resolve_model("acme/elsewhere", download_dir=str(online))
    assert hub.requests == []


def test_an_interrupted_download_resumes_with_a_range_request(hub, online, monkeypatch):
    from huggingface_hub import constants
    # huggingface_hub keeps what it read in whole chunks (10 MB by default; the file is 7 MB)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    hub.cut_once = {"model.safetensors"}
    folder = resolve_model("acme/tiny", download_dir=str(online))
    ranges = [h.get("Range") for m, p, h in hub.requests if m == "GET" and p.endswith("/model.safetensors")]
    size = len(hub.files["model.safetensors"])
    assert ranges[0] is None and ranges[1].startswith("bytes=") and 0 < int(ranges[1][6:].rstrip("-")) < size
    assert (Path(folder) / "model.safetensors").read_bytes() == hub.files["model.safetensors"]


def test_a_local_path_that_looks_like_a_hub_name_stays_local(hub, online, tmp_path, monkeypatch):
    (tmp_path / "acme" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("acme/tiny", download_dir=str(online)) == "acme/tiny"
    assert hub.requests == []


def test_gguf_repos_need_the_file_named(hub, online):
    with pytest.raises(ModelLoadError, match=r"GGUF files: name one, e\.g\. acme/gguf-only/model\.Q4_0\.gguf"):
        resolve_model("acme/gguf-only", download_dir=str(online))
    path = resolve_model("acme/gguf-only/model.Q8_0.gguf", download_dir=str(online))
    assert path.endswith("model.Q8_0.gguf") and Path(path).read_bytes() == b"GGUF" * 2000
    assert "model.Q4_0.gguf" not in _gets(hub)
    with pytest.raises(ModelLoadError, match=r"'acme/gguf-only/nope\.gguf'.*EntryNotFound"):
        resolve_model("acme/gguf-only/nope.gguf", download_dir=str(online))


def test_an_unknown_repo_is_named(hub, online):
    with pytest.raises(ModelLoadError, match=r"'acme/missing'.*RepositoryNotFound"):
        resolve_model("acme/missing", download_dir=str(online))


def test_cli_generate_downloads_a_hub_name_from_the_environment(hub, tmp_path):
    """The whole CLI with huggingface_hub configured by environment (HF_ENDPOINT, HF_TOKEN), then
    HF_HUB_OFFLINE=1 answering from the cache."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "0",
           "PYTHONPATH": str(Path(__file__).parents[1])}
    cmd = [sys.executable, "-m", "jaxserve.server.cli", "generate", "--model", "acme/tiny",
           "--download-dir", str(tmp_path), "--load-format", "dummy", "--max-model-len", "64",
           "--kv-cache-memory-bytes", "8M", "--compilation-cache-dir", "", "--max-tokens", "2",
           "t5 t6"]
    hub.requests.clear()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "model.safetensors" not in _gets(hub)              # dummy weights: no checkpoint
    assert {"config.json", "tokenizer.json"} <= set(_gets(hub))
    hub.requests.clear()
    done = subprocess.run(cmd, env=env | {"HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert hub.requests == []
    done = subprocess.run([*cmd[:5], "acme/other", *cmd[6:]], env=env | {"HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "'acme/other'" in done.stderr and "HF_HUB_OFFLINE" in done.stderr
