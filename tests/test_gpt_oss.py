"""gpt-oss beyond what tests/test_families.py checks for every family (prompt logprobs against
transformers whole and chunked, greedy tokens under chunked prefill and preemption, TP=2,
dummy weights, export):

  - MXFP4: the numpy dequantization equals transformers' own (`convert_moe_packed_tensors`) and
    the format's spec on hand-made bytes; an MXFP4 copy of the tiny checkpoint (experts quantized
    here) loads and its prompt logprobs equal transformers' reading the same MXFP4 files
    (`Mxfp4Config(dequantize=True)`);
  - attention sinks: the reference path equals a float64 dense softmax with a sink column, the
    sinks and the SwiGLU clamp change the logits (so parity covers them), and backend selection
    keeps sink models off the kernels, naming why;
  - prompt logprobs with the experts (and their biases) split over 2 simulated devices, by TP and
    by EP, equal one device's and transformers';
  - config.json fields: defaults as transformers fills them, bad values refused naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers_paged import PagedRunner  # noqa: E402
from test_families import LOGPROB_ATOL, PROMPTS, _hf_logprobs, write_checkpoint  # noqa: E402
from test_paged_attention_kernel import CASES, make_batch, max_err, naive_attention  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.attention import AttentionCase, ragged_paged_attention_ref, select_backend  # noqa: E402
from jaxserve.attention.backend import Platform  # noqa: E402
from jaxserve.loader import mxfp4  # noqa: E402
from jaxserve.loader.loader import load_model  # noqa: E402

pytestmark = pytest.mark.slow

EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def test_mxfp4_dequantize_equals_transformers_and_the_spec():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    w = np.random.default_rng(0).standard_normal((3, 40, 96)).astype(np.float32)
    blocks, scales = mxfp4.quantize(w)
    assert blocks.shape == (3, 40, 3, 16) and scales.shape == (3, 40, 3)
    got = mxfp4.dequantize(blocks, scales)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(np.swapaxes(got, -1, -2), want.numpy())    # transformers gives [X, in, out]
    assert np.abs(got - w).max() <= np.abs(w).max() / 6       # half the widest e2m1 step, at most
    # the spec by hand: low nibble first; 0x1 = 0.5, 0x2 = 1.0, 0xF = -6, 0x8 = -0; scale 2^(byte - 127)
    blocks = np.zeros((1, 16), np.uint8)
    blocks[0, 0], blocks[0, 1] = 0x21, 0x8F
    out = mxfp4.dequantize(blocks, np.array([129], np.uint8))
    assert out.shape == (32,) and out[:4].tolist() == [2.0, 4.0, -24.0, 0.0] and not out[4:].any()
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.dequantize(blocks.astype(np.int32), np.array([129], np.uint8))
    with pytest.raises(ValueError, match="32 fp4 values per scale"):
        mxfp4.dequantize(blocks[:, :8], np.array([129], np.uint8))


def _write_mxfp4_copy(src, dst):
    """dst: src's checkpoint with every expert matrix as MXFP4 blocks and scales (what gpt-oss
    ships); returns {tensor name: the dequantized [X, in, out] tensor, by transformers}."""
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    tensors, dequantized = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not name.endswith(EXPERT_TENSORS):
            tensors[name] = t
            continue
        blocks, scales = mxfp4.quantize(np.swapaxes(t, -1, -2))      # blocks run along `in`
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                       dtype=torch.float32)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "tokenizer.json").write_text((src / "tokenizer.json").read_text())
    return dequantized


def test_mxfp4_checkpoint_matches_transformers_on_the_dequantized_weights(tmp_path):
    model = write_checkpoint(tmp_path / "bf", "gpt-oss")
    dequantized = _write_mxfp4_copy(tmp_path / "bf", tmp_path / "mx")
    # transformers reads the MXFP4 files itself (dequantizing on CPU)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "mx", quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager").eval()
    params = dict(hf.named_parameters())
    assert all(torch.equal(params[name], w) for name, w in dequantized.items())
    ids = PROMPTS[-1]
    want = _hf_logprobs(hf, ids)
    assert np.abs(want - _hf_logprobs(model, ids)).max() > 1e-2       # the MXFP4 rounding shows in the logits
    with LLM(model=str(tmp_path / "mx"), dtype="float32", max_model_len=512, max_num_batched_tokens=512,
             num_gpu_blocks_override=64, warmup=False, compilation_cache_dir="") as llm:
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)[0]
    got = np.array([out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))])
    diff = np.abs(got - want[np.arange(len(ids) - 1), ids[1:]]).max()
    print(f"mxfp4: max |prompt logprob diff| {diff:.2e}")
    assert diff < LOGPROB_ATOL


def test_a_broken_mxfp4_tensor_is_refused_naming_it(tmp_path):
    from safetensors.numpy import load_file, save_file
    write_checkpoint(tmp_path / "bf", "gpt-oss")
    _write_mxfp4_copy(tmp_path / "bf", tmp_path / "mx")
    tensors = load_file(str(tmp_path / "mx" / "model.safetensors"))
    name = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][..., :1]
    save_file(tensors, str(tmp_path / "mx" / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.experts.down_proj"):
        load_model(tmp_path / "mx", "float32")


@pytest.mark.parametrize("static", [False, True])       # True: the GPU form (no dynamic loops)
@pytest.mark.parametrize("name", ["sliding_window", "mixed_empty_rows_padding_gqa8", "prefill_chunk_on_prefix"])
def test_reference_attention_with_sinks_equals_dense_softmax_with_a_sink_column(name, static):
    case = CASES[name]
    q, k, v, meta, _, _ = make_batch(case, seed=3)
    sinks = np.random.default_rng(1).normal(0, 2, q.shape[1]).astype(np.float32)
    sm = 1.0 / np.sqrt(case.D)
    got = ragged_paged_attention_ref(q, k, v, meta, sm_scale=sm, sliding_window=case.window,
                                     sinks=jnp.asarray(sinks), static=static)
    want = naive_attention(q, k, v, meta, sm_scale=sm, window=case.window, sinks=sinks)
    assert max_err(got, want) <= 1e-5
    assert max_err(got, naive_attention(q, k, v, meta, sm_scale=sm, window=case.window)) > 1e-2


def test_sinks_and_the_swiglu_clamp_change_the_logits(tmp_path):
    """So the parity tests in test_families.py cover them."""
    write_checkpoint(tmp_path, "gpt-oss")
    cfg, weights = load_model(tmp_path, "float32")
    ids = PROMPTS[2]

    def logits(cfg, weights):
        return PagedRunner(cfg, weights, block_size=16, num_blocks=16, max_blocks_per_seq=16).prefill_logits(ids)

    base = logits(cfg, weights)
    layers = dataclasses.replace(weights.layers, sinks=jnp.full_like(weights.layers.sinks, -1e4))
    assert np.abs(logits(cfg, dataclasses.replace(weights, layers=layers)) - base).max() > 1e-2
    loose = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, swiglu_limit=100.0))
    assert np.abs(logits(loose, weights) - base).max() > 1e-2


def test_backend_selection_keeps_models_with_sinks_on_the_reference_path():
    case = AttentionCase(jnp.bfloat16, jnp.bfloat16, 64, 8, 64, 16, sinks=True)
    hopper = Platform("gpu", "9.0", (0, 11))
    assert select_backend("auto", case, hopper) == "reference"
    assert select_backend("reference", case, hopper) == "reference"
    for name in ("pallas", "triton", "mosaic"):
        with pytest.raises(ValueError, match="attention sinks"):
            select_backend(name, case, hopper)
    assert select_backend("pallas", dataclasses.replace(case, sinks=False), hopper) == "pallas"


_EP_CHILD = textwrap.dedent("""
    import json, sys
    from jaxserve import LLM, SamplingParams
    path, ids = sys.argv[1], json.loads(sys.argv[2])
    result = {}
    for name, kw in (("tp1", dict(tensor_parallel_size=1)), ("tp2", dict(tensor_parallel_size=2)),
                     ("ep2", dict(tensor_parallel_size=2, enable_expert_parallel=True))):
        with LLM(model=path, dtype="float32", max_model_len=512, max_num_batched_tokens=512,
                 num_gpu_blocks_override=64, warmup=False, compilation_cache_dir="", **kw) as llm:
            out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                               use_tqdm=False)[0]
            result[name] = [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]
    print("RESULT" + json.dumps(result))
""")


def test_tensor_and_expert_parallel_over_2_devices_equal_one_device_and_transformers(tmp_path):
    """TP=2 splits each expert's inner dimension (its down bias added once), EP=2 the experts."""
    model = write_checkpoint(tmp_path, "gpt-oss")
    ids = PROMPTS[-1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _EP_CHILD, str(tmp_path), json.dumps(ids)],
                         capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    res = json.loads(lines[0][len("RESULT"):])
    want = _hf_logprobs(model, ids)[np.arange(len(ids) - 1), ids[1:]]
    for name in ("tp2", "ep2"):
        assert np.abs(np.array(res[name]) - np.array(res["tp1"])).max() < 1e-4, name
        assert np.abs(np.array(res[name]) - want).max() < LOGPROB_ATOL, name


def test_gpt_oss_20b_config_reads_as_released():
    """The released config.json's fields (transformers 4.55 layout: rope_scaling + rope_theta,
    MXFP4 quantization_config) as ModelConfig."""
    from jaxserve.config import ModelConfig
    hf = dict(architectures=["GptOssForCausalLM"], attention_bias=True, eos_token_id=200002, experts_per_token=4,
              head_dim=64, hidden_act="silu", hidden_size=2880, initial_context_length=4096, intermediate_size=2880,
              layer_types=["sliding_attention", "full_attention"] * 12, max_position_embeddings=131072,
              model_type="gpt_oss", num_attention_heads=64, num_experts_per_tok=4, num_hidden_layers=24,
              num_key_value_heads=8, num_local_experts=32, pad_token_id=199999, rms_norm_eps=1e-05,
              quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]},
              rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "rope_type": "yarn",
                            "original_max_position_embeddings": 4096, "truncate": False},
              rope_theta=150000, sliding_window=128, swiglu_limit=7.0, tie_word_embeddings=False, vocab_size=201088)
    cfg = ModelConfig.from_hf(hf)
    assert cfg.layer_windows == (128, None) * 12 and cfg.attention_sinks and cfg.eos_token_ids == (200002,)
    assert (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.moe_intermediate_size) == (32, 4, 2880)
    assert cfg.rope_theta == 150000 and cfg.rope_scaling_dict["truncate"] is False
    assert cfg.derived_max_model_len == 131072


def test_config_defaults_and_bad_fields():
    from jaxserve.config import ModelConfig
    hf = dict(architectures=["GptOssForCausalLM"], vocab_size=96, hidden_size=64, intermediate_size=64,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_local_experts=4, num_experts_per_tok=2, sliding_window=16, max_position_embeddings=512)
    cfg = ModelConfig.from_hf(hf)
    assert cfg.layer_windows == (16, None, 16) and cfg.attention_bias and cfg.attention_sinks
    assert (cfg.moe.swiglu_alpha, cfg.moe.swiglu_limit, cfg.moe.norm_topk_prob) == (1.702, 7.0, True)
    with pytest.raises(ValueError, match="swiglu_limit"):
        ModelConfig.from_hf(dict(hf, swiglu_limit=-1.0))
    with pytest.raises(ValueError, match="num_local_experts"):
        ModelConfig.from_hf({k: v for k, v in hf.items() if k != "num_local_experts"})
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf(dict(hf, layer_types=["full_attention"]))
