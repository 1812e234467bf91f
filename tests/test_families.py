"""Model families beyond Llama: Gemma 2, Gemma 3 (text), Phi-3 / Phi-4-mini and gpt-oss against transformers.

Each family is a tiny random checkpoint written here with transformers' own config class (every
parameter randomised, so a missing norm or offset cannot hide), read by the engine (`LLM`):
  - prompt logprobs of a 300-token prompt equal transformers' (< 1e-3, f32), prefilled whole and
    in 48-token chunks; with a 16-token sliding window the prompt covers windowed and global
    layers, and the logprobs of the greedy tokens (decode steps) equal transformers' too;
  - greedy tokens of four prompts run together with a 32-token budget (chunked prefill) and in a
    KV pool too small for all of them (preemption) equal each prompt run alone;
  - TP=2 greedy tokens equal TP=1 on simulated CPU devices (a subprocess, XLA_FLAGS before jax);
  - `--load-format dummy` runs, and the export writes names and a config transformers reads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import engine_variant

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers_paged import PagedRunner  # noqa: E402
from helpers_paged import hf_logprobs as _hf_logprobs  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.loader.loader import load_model  # noqa: E402
from jaxserve.tokenizer.tokenizer import Tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB = 96
WINDOW = 16
LOGPROB_ATOL = 1e-3
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
             attn_implementation="eager")

# name -> (config class, model class, config kwargs)
FAMILIES = {
    # soft caps low enough to bite on these logits; layers slide, global, slide, global
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        _BASE, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0)),
    # q/k norms; sliding layers on a 10k rope base, the global layer on 1M with linear scaling x4
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        _BASE, sliding_window=WINDOW, query_pre_attn_scalar=24, final_logit_softcapping=4.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}})),
    # Phi-4-mini's shape of things: fused qkv / gate_up tensors, rope on 3/4 of each head, tied
    # embeddings, LongRoPE (original context 64 of 512: the 300-token prompt takes the long factors)
    "phi4-mini-longrope": ("Phi3Config", "Phi3ForCausalLM", dict(
        _BASE, num_hidden_layers=2, partial_rotary_factor=0.75, tie_word_embeddings=True,
        original_max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.2, 1.5, 1.1, 1.9, 1.3],
                      "long_factor": [2.0, 4.5, 3.0, 6.0, 1.5, 5.0]})),
    # experts with biases (4, top 2) and a SwiGLU clamp low enough to bite; attention sinks; layers
    # slide, global, slide, global; YaRN x4 over an original context of 128 (untruncated ramp)
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        _BASE, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        swiglu_limit=1.5, rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "truncate": False, "original_max_position_embeddings": 128,
                                           "rope_theta": 150000.0})),
}

PROMPT_LENGTHS = (7, 40, 130, 300)
NEW_TOKENS = 12


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


PROMPTS = [_prompt(n, seed) for seed, n in enumerate(PROMPT_LENGTHS)]


def write_checkpoint(path, name: str, seed: int = 0):
    """A random checkpoint of family `name` saved with save_pretrained; returns the torch model."""
    config_class, model_class, kwargs = FAMILIES[name]
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).float().eval()
    gemma = name.startswith("gemma")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:       # Gemma scales by 1 + w: w around 0 there, around 1 elsewhere
                p.copy_((0.0 if gemma else 1.0) + 0.3 * torch.randn_like(p))
            elif pname.endswith("sinks"):     # gpt-oss: sink logits on the scale of the scores
                p.copy_(1.5 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    # the engine needs a tokenizer: word-level "t0" .. "t95"
    Tokenizer.synthetic(VOCAB, config.eos_token_id).backend.save(str(path / "tokenizer.json"))
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, checkpoint dir, transformers model, LLM) of one family."""
    path = tmp_path_factory.mktemp(request.param)
    model = write_checkpoint(path, request.param)
    llm = LLM(model=str(path), dtype="float32", max_model_len=512, max_num_batched_tokens=512,
              max_num_seqs=8, num_gpu_blocks_override=128, block_size=16, enable_prefix_caching=False,
              warmup=False, compilation_cache_dir="", seed=0)
    yield request.param, path, model, llm
    llm.shutdown()


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _greedy(llm, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("budget", [None, 48], ids=["whole", "chunks_of_48"])
def test_prompt_and_decode_logprobs_equal_transformers(family, budget):
    name, _, model, llm = family
    ids = PROMPTS[-1]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=1,
                        logprobs=0)
    variant = engine_variant(llm, max_num_batched_tokens=budget) if budget else contextlib.nullcontext()
    with variant:
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    gen = list(out.outputs[0].token_ids)
    ref = _hf_logprobs(model, ids + gen)
    lps = out.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    got = np.array([lps[p][ids[p]].logprob for p in range(1, len(ids))])
    want = ref[np.arange(len(ids) - 1), ids[1:]]
    assert want.std() > 0.3             # logprobs far from uniform, so the bound is not vacuous
    diff = float(np.abs(got - want).max())
    print(f"{name} {budget}: max |prompt logprob diff| {diff:.2e}")
    assert diff < LOGPROB_ATOL
    # decode steps: each greedy token's logprob, and it is transformers' argmax (or a tie)
    for i, (tok, step) in enumerate(zip(gen, out.outputs[0].logprobs)):
        row = ref[len(ids) - 1 + i]
        assert abs(step[tok].logprob - row[tok]) < LOGPROB_ATOL, i
        assert row.max() - row[tok] < LOGPROB_ATOL, i


@pytest.mark.parametrize("name", [n for n in FAMILIES if n.startswith(("gemma", "gpt-oss"))])   # the windowed ones
def test_window_matters(name, tmp_path):
    """The checkpoint's sliding window changes the logits (so the test above covers it)."""
    path = tmp_path
    write_checkpoint(path, name)
    cfg, weights = load_model(path, "float32")
    assert set(cfg.layer_windows) == {WINDOW, None}
    import dataclasses
    ids = PROMPTS[-1][:64]
    runner = PagedRunner(cfg, weights, block_size=16, num_blocks=16, max_blocks_per_seq=8)
    windowed = runner.prefill_logits(ids)
    # the same layers (Gemma 3's sliding layers keep their rope base) with a window wider than the prompt
    runner = PagedRunner(dataclasses.replace(cfg, sliding_window=10 ** 6), weights,
                         block_size=16, num_blocks=16, max_blocks_per_seq=8)
    full = runner.prefill_logits(ids)
    assert np.abs(windowed[:WINDOW] - full[:WINDOW]).max() < 1e-5       # inside the window: same
    assert np.abs(windowed[WINDOW + 1:] - full[WINDOW + 1:]).max() > 1e-2


def test_greedy_tokens_equal_under_chunked_prefill_and_preemption(family):
    _, _, _, llm = family
    alone = [_greedy(llm, [p])[0] for p in PROMPTS]
    with engine_variant(llm, max_num_batched_tokens=32) as sched:
        assert _greedy(llm, PROMPTS) == alone
        assert sched.num_preemptions_total == 0
    # four 94-token prompts fill 24 blocks of 16 tokens; their decodes need more: preemption
    prompts = [_prompt(94, 10 + i) for i in range(4)]
    alone = [_greedy(llm, [p])[0] for p in prompts]
    with engine_variant(llm, num_blocks=24) as sched:
        assert _greedy(llm, prompts) == alone
        assert sched.num_preemptions_total > 0


_TP_CHILD = textwrap.dedent("""
    import json, sys
    import jax
    from jaxserve import LLM, SamplingParams
    path, prompts, load_format = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    assert len(jax.devices()) >= 2
    result = {}
    for tp in (1, 2):
        with LLM(model=path, tensor_parallel_size=tp, dtype="float32", max_model_len=512,
                 max_num_batched_tokens=64, max_num_seqs=8, num_gpu_blocks_override=64, warmup=False,
                 compilation_cache_dir="", load_format=load_format, seed=0) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
            result[tp] = [o.outputs[0].token_ids for o in outs]
    print("RESULT" + json.dumps(result))
""")


def _run_tp(path, load_format: str = "auto") -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _TP_CHILD, str(path), json.dumps(PROMPTS[1:3]), load_format],
                         capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return json.loads(lines[0][len("RESULT"):])


def test_tensor_parallel_2_tokens_equal_one_device(family):
    _, path, _, _ = family
    res = _run_tp(path)
    assert res["1"] == res["2"] and all(len(t) == 8 for t in res["1"])


def test_dummy_weights_run_and_export_reads_back_in_transformers(family, tmp_path):
    name, path, model, llm = family
    cfg, weights = load_model(path, "float32", load_format="dummy")
    runner = PagedRunner(cfg, weights, block_size=16, num_blocks=8, max_blocks_per_seq=4)
    assert np.isfinite(runner.prefill_logits(PROMPTS[1])).all()

    from safetensors.numpy import save_file

    from jaxserve.loader.export import _host_arrays, hf_config
    cfg, weights = load_model(path, "float32")
    (tmp_path / "config.json").write_text(json.dumps(hf_config(cfg, "float32")))
    save_file(_host_arrays(cfg, weights, np.float32), str(tmp_path / "model.safetensors"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    ids = PROMPTS[2]
    np.testing.assert_allclose(_hf_logprobs(back, ids), _hf_logprobs(model, ids), atol=1e-5)


def test_gemma3_with_a_vision_tower_loads_its_text_model_and_says_so(tmp_path, caplog):
    text = dict(FAMILIES["gemma3"][2])
    text.pop("attn_implementation")
    config = transformers.Gemma3Config(
        text_config=text, mm_tokens_per_image=4,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(0.3 * torch.randn_like(p) if "norm" in pname else 0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path, safe_serialization=True)
    with caplog.at_level(logging.WARNING, logger="jaxserve.loader.loader"):
        cfg, weights = load_model(tmp_path, "float32")
    assert cfg.architecture == "Gemma3ForConditionalGeneration"
    assert any("vision tower" in r.getMessage() for r in caplog.records)
    ids = PROMPTS[2]
    runner = PagedRunner(cfg, weights, block_size=16, num_blocks=16, max_blocks_per_seq=16)
    got = runner.prefill_logits(ids)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    assert np.abs(got - ref).max() < 1e-4


def test_phi3_longrope_takes_the_short_factors_when_max_model_len_fits_the_original_context(tmp_path):
    """vLLM's rule: max_model_len <= original_max_position_embeddings (64) -> short factors for
    every position; transformers agrees on sequences that short."""
    model = write_checkpoint(tmp_path, "phi4-mini-longrope")
    ids = _prompt(50, 7)
    ref = _hf_logprobs(model, ids)
    with LLM(model=str(tmp_path), dtype="float32", max_model_len=64, max_num_batched_tokens=64,
             num_gpu_blocks_override=16, warmup=False, compilation_cache_dir="") as llm:
        assert llm.llm_engine.model_config.max_model_len == 64
        out = llm.generate([{"prompt_token_ids": ids}],
                           SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    got = np.array([out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))])
    assert np.abs(got - ref[np.arange(len(ids) - 1), ids[1:]]).max() < LOGPROB_ATOL


def test_phi3_su_rope_and_bad_longrope_factors(tmp_path):
    from jaxserve.config import ModelConfig
    hf = dict(architectures=["Phi3ForCausalLM"], vocab_size=96, hidden_size=64, intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=4, head_dim=16, max_position_embeddings=512,
              original_max_position_embeddings=64, partial_rotary_factor=0.75,
              rope_scaling={"type": "su", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6})
    cfg = ModelConfig.from_hf(hf)
    assert cfg.rope_scaling_dict["rope_type"] == "longrope" and cfg.partial_rotary_factor == 0.75
    assert cfg.rope_scaling_dict["original_max_position_embeddings"] == 64
    with pytest.raises(ValueError, match="long_factor"):
        ModelConfig.from_hf(dict(hf, rope_scaling={"type": "longrope", "short_factor": [1.0] * 6,
                                                   "long_factor": [2.0] * 8}))
    with pytest.raises(ValueError, match="short_factor"):
        ModelConfig.from_hf(dict(hf, rope_scaling={"type": "longrope", "long_factor": [2.0] * 6}))


def test_gemma_configs_jaxserve_cannot_serve_are_refused_naming_the_field():
    from jaxserve.config import ModelConfig
    hf = dict(architectures=["Gemma3ForCausalLM"], vocab_size=96, hidden_size=64, intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16)
    cfg = ModelConfig.from_hf(hf)       # transformers' default pattern: every 6th layer global
    assert cfg.layer_types == ("sliding_attention", "sliding_attention") and cfg.rope_local_theta == 10000.0
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf(dict(hf, use_bidirectional_attention=True))
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf(dict(hf, layer_types=["full_attention"]))
    with pytest.raises(ValueError, match="rope_parameters.sliding_attention.rope_type"):
        ModelConfig.from_hf(dict(hf, rope_parameters={
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6}}))
