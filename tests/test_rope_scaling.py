"""Rope scaling: dynamic NTK as vLLM applies it (one fixed base, jaxserve/layers/rotary.py's
docstring says why), against a float64 numpy copy of vLLM's formula and against transformers on
the one sequence length where the two coincide; rope types jaxserve cannot apply are refused
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
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, "rope_scaling.rope_type 'yarn'"),
    ({"type": "su"}, "rope_scaling.short_factor must be a list"),      # LongRoPE (Phi-3) needs its factors
    ({"rope_type": "dynamic"}, "rope_scaling.factor must be a positive number"),
    ({"rope_type": "dynamic", "factor": "2"}, "rope_scaling.factor must be a positive number"),
])
def test_rope_scaling_jaxserve_cannot_apply_is_refused_naming_the_field(scaling, match):
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 128, "intermediate_size": 192,
          "num_hidden_layers": 2, "num_attention_heads": 4, "rope_scaling": scaling}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(hf)
