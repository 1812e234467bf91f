"""Rope scaling: dynamic NTK as vLLM applies it (one fixed base, jaxserve/layers/rotary.py's
docstring says why), against a float64 numpy copy of vLLM's formula and against transformers on
the one sequence length where the two coincide; YaRN (Qwen3's recipe, DeepSeek's mscale) against
transformers past original_max_position_embeddings, also when given as --rope-scaling /
--hf-overrides; vLLM's context limits of scaled ropes; rope types jaxserve cannot apply are refused
naming the field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.layers.rotary import rope_inv_freq

DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}
MAX_POS = 32


def _vllm_dynamic_inv_freq(head_dim: int, base: float, factor: float, max_pos: int) -> np.ndarray:
    """vLLM's DynamicNTKScalingRotaryEmbedding._compute_cos_sin_cache, in float64."""
    max_len = max_pos * factor
    base = base * ((factor * max_len / max_pos) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))


@pytest.mark.parametrize("head_dim,theta,factor", [(64, 10000.0, 2.0), (128, 500000.0, 4.0), (32, 1e6, 1.5)])
def test_dynamic_ntk_uses_vllms_fixed_base(head_dim, theta, factor):
    got = rope_inv_freq(head_dim, theta, {"rope_type": "dynamic", "factor": factor})
    want = _vllm_dynamic_inv_freq(head_dim, theta, factor, MAX_POS)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # not the unscaled frequencies: every one but the first (always 1) is lower
    plain = rope_inv_freq(head_dim, theta, None)
    assert np.all(got[1:] < plain[1:] * (1 - 1e-3))


def test_dynamic_ntk_base_is_transformers_at_max_position_times_factor():
    """transformers' dynamic base depends on the sequence length; at max_position_embeddings x
    factor it is vLLM's fixed one."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_dynamic_ntk_parameters
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=MAX_POS,
                                      rope_parameters=dict(DYNAMIC, rope_theta=10000.0))
    hf, _ = _compute_dynamic_ntk_parameters(config, torch.device("cpu"), seq_len=int(MAX_POS * 2.0))
    np.testing.assert_allclose(rope_inv_freq(64, 10000.0, DYNAMIC), hf.numpy(), rtol=1e-6)


def test_dynamic_rope_logits_match_transformers_on_a_full_length_prompt(tmp_path):
    """A tiny random Llama with dynamic NTK scaling (max_position_embeddings 32, factor 2): on a
    64-token prompt transformers computes its base from 64 positions, vLLM's fixed base, so the
    logits of every position agree through the paged cache (prefilled whole and in chunks)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from helpers_paged import PagedRunner
    from test_model_parity import TINY_LOGIT_ATOL, _hf_logits, build_tiny_checkpoint

    from jaxserve.loader.loader import load_model
    model = build_tiny_checkpoint(tmp_path, "LlamaConfig", dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS,
        rope_scaling=DYNAMIC))
    cfg, weights = load_model(tmp_path, "float32")
    assert cfg.rope_scaling_dict == DYNAMIC and cfg.derived_max_model_len == 64
    ids = np.random.default_rng(2).integers(0, 96, size=64).tolist()
    ref = _hf_logits(model, ids)
    runner = PagedRunner(cfg, weights, block_size=8, num_blocks=16, max_blocks_per_seq=8)
    for chunks in (None, (40, 24)):
        got = runner.prefill_logits(ids, **({} if chunks is None else {"chunk_sizes": chunks}))
        assert float(np.abs(got - ref).max()) <= TINY_LOGIT_ATOL, chunks
    # without the scaling (the rope type ignored) the late positions would not match
    plain = PagedRunner(dataclasses.replace(cfg, rope_scaling=None), weights, block_size=8,
                        num_blocks=16, max_blocks_per_seq=8).prefill_logits(ids)
    assert float(np.abs(plain - ref).max()) > 100 * TINY_LOGIT_ATOL


def test_dynamic_rope_allows_max_position_times_factor_as_vllm_does(tmp_path):
    from jaxserve import LLM
    d = tmp_path / "m"
    d.mkdir()
    cfg = json.loads((Path(__file__).parent / "data" / "tiny-llama" / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | dict(max_position_embeddings=MAX_POS, rope_scaling=DYNAMIC)))
    common = dict(model=str(d), load_format="dummy", dtype="float32", warmup=False, num_gpu_blocks_override=16)
    with LLM(**common) as llm:
        assert llm.llm_engine.max_model_len == 64
    with pytest.raises(ValueError, match=r"max_model_len \(65\).*x rope_scaling.factor"):
        LLM(max_model_len=65, **common)


@pytest.mark.parametrize("scaling,match", [
    ({"type": "su"}, "rope_scaling.short_factor must be a list"),      # LongRoPE (Phi-3) needs its factors
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": "32k"},
     "rope_scaling.original_max_position_embeddings must be a positive integer"),
    ({"rope_type": "yarn", "factor": 4.0, "mscale": "1"}, "rope_scaling.mscale must be a number"),
    ({"rope_type": "dynamic"}, "rope_scaling.factor must be a positive number"),
    ({"rope_type": "dynamic", "factor": "2"}, "rope_scaling.factor must be a positive number"),
])
def test_rope_scaling_jaxserve_cannot_apply_is_refused_naming_the_field(scaling, match):
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 128, "intermediate_size": 192,
          "num_hidden_layers": 2, "num_attention_heads": 4, "rope_scaling": scaling}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(hf)


# --- YaRN ------------------------------------------------------------------------------------------
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
DEEPSEEK_YARN = dict(YARN, mscale=0.707, mscale_all_dim=1.0, beta_fast=16, beta_slow=2)


@pytest.mark.parametrize("head_dim,theta,scaling,max_pos", [
    (128, 1e6, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 40960),  # Qwen3
    (64, 10000.0, YARN, 256),
    (64, 10000.0, DEEPSEEK_YARN, 256),
    (32, 500000.0, dict(YARN, attention_factor=1.3, truncate=False), 256),
])
def test_yarn_frequencies_and_attention_factor_match_transformers(head_dim, theta, scaling, max_pos):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    from jaxserve.layers.rotary import rope_attention_factor
    hf = dict(architectures=["LlamaForCausalLM"], vocab_size=96, hidden_size=head_dim * 4, intermediate_size=64,
              num_hidden_layers=1, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=max_pos,
              rope_theta=theta, rope_scaling=scaling)
    cfg = ModelConfig.from_hf(hf)
    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=max_pos, rope_parameters=dict(scaling, rope_theta=theta))
    want, want_factor = _compute_yarn_parameters(config, torch.device("cpu"))
    got = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert rope_attention_factor(cfg.rope_scaling_dict) == pytest.approx(want_factor, rel=1e-12)
    assert not np.allclose(got, rope_inv_freq(head_dim, theta, None))


def _logprobs(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def _yarn_parity(tmp_path, config_class, kwargs, scaling, *, override: bool):
    """Max |logprob| difference to transformers over the positions past the original context of
    a 200-token prompt, and the same with the YaRN ignored (so the check has teeth)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from helpers_paged import PagedRunner
    from test_model_parity import _hf_logits, build_tiny_checkpoint

    from jaxserve.loader.loader import load_model
    common = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **kwargs)
    model = build_tiny_checkpoint(tmp_path / "hf", config_class, dict(common, rope_scaling=scaling))
    if override:        # the same weights saved without rope scaling; the scaling comes as --rope-scaling
        build_tiny_checkpoint(tmp_path / "plain", config_class, common)
        cfg, weights = load_model(tmp_path / "plain", "float32", hf_overrides={"rope_scaling": scaling})
    else:
        cfg, weights = load_model(tmp_path / "hf", "float32")
    assert cfg.rope_scaling_dict["rope_type"] == "yarn"
    ids = np.random.default_rng(3).integers(0, 96, size=200).tolist()
    want = _logprobs(_hf_logits(model, ids))[64:]

    def run(c):
        runner = PagedRunner(c, weights, block_size=16, num_blocks=16, max_blocks_per_seq=16)
        return _logprobs(runner.prefill_logits(ids, chunk_sizes=(120, 80)))[64:]
    plain = dataclasses.replace(cfg, rope_scaling=None)
    return float(np.abs(run(cfg) - want).max()), float(np.abs(run(plain) - want).max())


@pytest.mark.parametrize("config_class,kwargs,scaling", [
    ("Qwen3Config", {}, YARN),
    ("LlamaConfig", {}, DEEPSEEK_YARN),
])
def test_yarn_logprobs_match_transformers_past_the_original_context(tmp_path, config_class, kwargs, scaling):
    """A tiny random Qwen3 (Qwen3's recipe, original context 64, factor 4) and a Llama with
    DeepSeek's mscale / mscale_all_dim: logprobs of positions 64..199 within 1e-3 of
    transformers, prefilled in two chunks through the paged cache."""
    err, err_unscaled = _yarn_parity(tmp_path, config_class, kwargs, scaling, override=False)
    assert err < 1e-3, err
    assert err_unscaled > 100 * err, (err, err_unscaled)


def test_rope_scaling_override_on_a_plain_checkpoint_is_yarn_as_if_saved_with_it(tmp_path):
    """--rope-scaling (hf_overrides' rope_scaling) on a checkpoint saved without rope scaling
    (transformers 5 writes rope_parameters, which the override must not lose to)."""
    err, _ = _yarn_parity(tmp_path, "Qwen3Config", {}, YARN, override=True)
    assert err < 1e-3, err


def _tiny_dir(tmp_path, **changes) -> str:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    cfg = json.loads((Path(__file__).parent / "data" / "tiny-llama" / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | changes))
    return str(d)


@pytest.mark.parametrize("scaling,limit", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24}, 96),   # original x factor
    ({"rope_type": "linear", "factor": 2.0}, 64),                                          # max_pos x factor
])
def test_scaled_rope_context_limit_is_vllms(tmp_path, scaling, limit):
    from jaxserve import LLM
    common = dict(model=_tiny_dir(tmp_path, max_position_embeddings=MAX_POS), load_format="dummy", dtype="float32",
                  warmup=False, num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="max_model_len \\(33\\) is larger than the model's max_position_embeddings"):
        LLM(max_model_len=33, **common)
    with LLM(rope_scaling=scaling, **common) as llm:
        assert llm.llm_engine.max_model_len == limit
    too_long = f"max_model_len \\({limit + 1}\\) is larger.*rope_scaling.factor \\({limit}\\)"
    with pytest.raises(ValueError, match=too_long):
        LLM(max_model_len=limit + 1, rope_scaling=scaling, **common)


@pytest.mark.parametrize("overrides,match", [
    ({"hf_overrides": ["rope_scaling"]}, "hf_overrides must be a JSON object"),
    ({"rope_scaling": "yarn"}, "rope_scaling must be a JSON object"),
])
def test_overrides_that_are_not_objects_are_refused_naming_the_field(overrides, match):
    from jaxserve.config import EngineArgs
    with pytest.raises(ValueError, match=match):
        EngineArgs(**overrides)


def test_hf_overrides_merge_as_vllm_merges_them():
    from jaxserve.loader.hf_overrides import apply_hf_overrides
    hf = {"max_position_embeddings": 32, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
          "text_config": {"hidden_size": 8, "num_heads": 2}}
    out = apply_hf_overrides(hf, {"max_position_embeddings": 64, "rope_scaling": YARN,
                                  "text_config": {"hidden_size": 16}})
    assert out["max_position_embeddings"] == 64
    assert out["rope_parameters"] == dict(YARN, rope_theta=1e6)          # the theta kept, the type replaced
    assert out["text_config"] == {"hidden_size": 16, "num_heads": 2}      # a sub-config merges
    assert hf["text_config"] == {"hidden_size": 8, "num_heads": 2}        # the input untouched
    cfg = ModelConfig.from_hf(dict(apply_hf_overrides(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 128, "intermediate_size": 192,
         "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 32768},
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})))
    assert cfg.derived_max_model_len == 131072        # original defaults to max_position_embeddings


def test_overrides_on_a_gguf_file_are_refused_naming_them():
    from jaxserve.default_model import default_model_path
    from jaxserve.loader.loader import ModelLoadError, load_model
    with pytest.raises(ModelLoadError, match=r"hf_overrides \(or rope_scaling\) \['rope_scaling'\].*GGUF file"):
        load_model(default_model_path(), "float32", hf_overrides={"rope_scaling": YARN})
