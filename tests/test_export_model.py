"""`jaxserve export-model`: the embedded GGUF model as a Hugging Face directory that transformers
loads with the same greedy tokens as jaxserve, and that jaxserve loads back."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve import SamplingParams  # noqa: E402
from jaxserve.server.cli import main as cli  # noqa: E402

PROMPTS = ["The capital of France is", "def add(a, b):\n"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-hf")
    assert cli.main(["export-model", str(out)]) == 0
    return out


def test_export_writes_the_hugging_face_files(exported):
    names = {p.name for p in exported.iterdir()}
    assert names == {"config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "model.safetensors"}
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 30
    assert "im_start" in json.loads((exported / "tokenizer_config.json").read_text())[
        "chat_template"]


def test_transformers_loads_the_export_with_jaxserve_greedy_tokens(exported, llm):
    tok = transformers.AutoTokenizer.from_pretrained(str(exported))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(exported),
                                                              dtype=torch.float32).eval()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert ids[0].tolist() == out.prompt_token_ids
        with torch.no_grad():
            hf = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert hf[0, ids.shape[1]:].tolist() == out.outputs[0].token_ids, prompt
    chat = [{"role": "user", "content": "Hi!"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False) == \
        llm.llm_engine.tokenizer.apply_chat_template(chat, tokenize=True)


def test_jaxserve_loads_the_export_back(exported, llm):
    from jaxserve import LLM
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    with LLM(model=str(exported), max_model_len=256, kv_cache_memory_bytes=64 << 20,
             warmup=False) as again:
        assert [o.outputs[0].token_ids for o in again.generate(PROMPTS, sp,
                                                               use_tqdm=False)] == want


def test_every_exported_file_gets_the_same_umask_mode(tmp_path):
    """model.safetensors too (safetensors alone creates it 0600), under a umask that is not the
    usual 022."""
    from jaxserve.loader.export import export_model
    from jaxserve.loader.loader import load_model
    from jaxserve.tokenizer.tokenizer import Tokenizer
    cfg, weights = load_model(Path(__file__).parent / "data" / "tiny-llama", "float32",
                              load_format="dummy")
    old = os.umask(0o027)
    try:
        files = export_model(tmp_path, cfg, Tokenizer.synthetic(cfg.vocab_size), weights)
    finally:
        os.umask(old)
    assert "model.safetensors" in files
    modes = {name: stat.S_IMODE((tmp_path / name).stat().st_mode) for name in files}
    assert modes == dict.fromkeys(files, 0o640)
