"""The whole offline path — `LLM.generate` with text prompts (tokenizer, scheduler, runner, sampler,
detokenizer) — against transformers' greedy `generate` on the same GGUF weights."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve import SamplingParams  # noqa: E402
from jaxserve.default_model import default_model_path  # noqa: E402

PROMPTS = ["The capital of France is", "def add(a, b):\n", "Water boils at",
           "My favourite three colours are"]
NEW_TOKENS = 24


def test_llm_generate_greedy_text_equals_transformers(llm):
    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist(), prompt
        with torch.no_grad():
            hf = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                min_new_tokens=NEW_TOKENS)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == hf, prompt
        assert out.outputs[0].text == tok.decode(hf, skip_special_tokens=True), prompt
