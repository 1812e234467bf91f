"""Calibrated FP8 weights: GPTQ rounding (jaxserve/loader/fp8_calibrate.py), the layer-by-layer
forward it runs on, and `jaxserve quantize` writing a compressed-tensors checkpoint that loads
back. The default model's quality figures are benchmarks/bench_fp8_quality.py's."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers.fp8 import Fp8Weight
from jaxserve.layers.linear import DenseWeight
from jaxserve.loader.fp8 import quantize_weights
from jaxserve.loader.fp8_calibrate import calibrate_fp8, gptq_fp8, prefill_batch
from jaxserve.loader.loader import load_model
from jaxserve.models import llama
from jaxserve.pallas.fp8_matmul import FP8_MAX

TINY = Path(__file__).parent / "data" / "tiny-llama"
LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def _round_to_nearest(w):
    s = np.abs(w).max(0, keepdims=True) / FP8_MAX
    return np.asarray(jnp.asarray(w / s).astype(jnp.float8_e4m3fn).astype(jnp.float32)) * s


def _inputs(rng, t, k):
    """Correlated inputs with a few large channels, as a transformer layer's are."""
    mix = np.eye(k) + 2 * rng.normal(size=(k, k)) / np.sqrt(k)
    x = rng.normal(size=(t, k)) @ mix
    x[:, :4] *= 20
    return x.astype(np.float32)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_the_output_error_below_round_to_nearest(act_order):
    """||X (W - Q)||^2 on the calibration inputs and on fresh inputs of the same distribution:
    GPTQ's is well below rounding each weight to its nearest e4m3 value; the codes are e4m3
    with the per-channel amax / 448 scales, and K not a multiple of the block works."""
    rng = np.random.default_rng(0)
    k, n = 200, 96
    mix_rng = np.random.default_rng(1)
    x, held = _inputs(mix_rng, 2048, k), _inputs(np.random.default_rng(1), 2048, k)
    w = (rng.normal(size=(k, n)) * 0.05).astype(np.float32)
    codes, scale = gptq_fp8(jnp.asarray(w), jnp.asarray(2 * x.T @ x / len(x)), 0.01, act_order=act_order)
    assert codes.dtype == jnp.float8_e4m3fn and codes.shape == (k, n) and scale.shape == (1, n)
    np.testing.assert_allclose(np.asarray(scale), np.abs(w).max(0, keepdims=True) / FP8_MAX, rtol=1e-6)
    q = np.asarray(codes.astype(jnp.float32) * scale)
    rtn = _round_to_nearest(w)
    for data in (x, held):
        err = lambda m, data=data: float(np.mean((data @ (w - m)) ** 2))
        assert err(q) < 0.5 * err(rtn), (err(q), err(rtn))


def test_unused_input_dimensions_are_zeroed():
    """A dimension no calibration token touched (zero Hessian diagonal) quantises to zero, and
    the rest still comes out finite."""
    rng = np.random.default_rng(2)
    x = _inputs(rng, 512, 128)
    x[:, 5] = 0.0
    w = rng.normal(size=(128, 32)).astype(np.float32)
    codes, scale = gptq_fp8(jnp.asarray(w), jnp.asarray(2 * x.T @ x / len(x)))
    q = np.asarray(codes.astype(jnp.float32) * scale)
    assert np.all(q[5] == 0) and np.all(np.isfinite(q))


def test_a_hessian_f32_cannot_factor_falls_back_to_round_to_nearest():
    """A non-finite Hessian (an overflowed activation) gives round-to-nearest codes, not NaNs."""
    rng = np.random.default_rng(3)
    w = rng.normal(size=(64, 16)).astype(np.float32)
    h = np.eye(64, dtype=np.float32)
    h[3, 3] = np.inf
    codes, scale = gptq_fp8(jnp.asarray(w), jnp.asarray(h))
    q = np.asarray(codes.astype(jnp.float32) * scale)
    np.testing.assert_allclose(q, _round_to_nearest(w), rtol=1e-6)    # XLA's division: last-bit differences


@pytest.fixture(scope="module")
def tiny():
    cfg, weights = load_model(TINY, "float32", load_format="dummy", seed=3)
    rng = np.random.default_rng(4)
    seqs = [list(rng.integers(3, cfg.vocab_size, size=n)) for n in (40, 17, 64, 33)]
    return cfg, weights, seqs


def _hidden(cfg, weights, seqs, **kw):
    tokens, positions, meta, cache = prefill_batch(cfg, seqs)
    return np.asarray(llama.forward(weights, cache, tokens, positions, meta, cfg=cfg, **kw)[0])


def test_layer_by_layer_forward_equals_the_scan(tiny):
    """`forward(each_layer=...)` runs the layers in a Python loop on what each_layer returns:
    with the identity it computes the scanned forward's hidden states."""
    cfg, weights, seqs = tiny
    seen = []

    def each_layer(i, w):
        seen.append((i, w.wq.w.shape))
        return w
    np.testing.assert_allclose(_hidden(cfg, weights, seqs, each_layer=each_layer), _hidden(cfg, weights, seqs),
                               rtol=1e-5, atol=1e-5)
    assert seen == [(i, (cfg.hidden_size, cfg.num_heads * cfg.head_dim)) for i in range(cfg.num_layers)]


def test_calibrated_model_is_closer_to_full_precision_than_round_to_nearest(tiny):
    """Every linear layer but lm_head becomes a stacked per-channel Fp8Weight, and the final
    hidden states on the calibration tokens are closer to the full-precision model's than
    `--quantization fp8`'s round-to-nearest ones."""
    cfg, weights, seqs = tiny
    calibrated = calibrate_fp8(cfg, weights, seqs, activations="none", kernel="xla")
    for name in LINEARS:
        w = getattr(calibrated.layers, name)
        assert isinstance(w, Fp8Weight) and w.granularity == "channel" and w.activations == "none"
        assert w.shape == getattr(weights.layers, name).shape
    assert isinstance(calibrated.lm_head, DenseWeight)
    exact = _hidden(cfg, weights, seqs)
    gptq = np.mean((_hidden(cfg, calibrated, seqs) - exact) ** 2)
    rtn = np.mean((_hidden(cfg, quantize_weights(weights, activations="none", kernel="xla"), seqs) - exact) ** 2)
    assert gptq < 0.8 * rtn, (gptq, rtn)


def test_calibration_errors_name_the_problem(tiny):
    cfg, weights, _ = tiny
    with pytest.raises(ValueError, match="longer than skip_first"):
        calibrate_fp8(cfg, weights, [])
    with pytest.raises(ValueError, match="longer than skip_first"):
        calibrate_fp8(cfg, weights, [[1, 2]], skip_first=2)
    with pytest.raises(ValueError, match="FP8 checkpoint already"):
        calibrate_fp8(cfg, quantize_weights(weights), [[1, 2, 3]])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        calibrate_fp8(cfg, weights, [[1] * (cfg.max_position_embeddings + 1)])


def test_quantize_writes_a_compressed_tensors_checkpoint_that_loads_back(tmp_path):
    """`quantize_model` (what `jaxserve quantize` runs): config.json names the compressed-tensors
    FP8 scheme (W8A8 dynamic here; the CLI test below writes W8A16), the loader reads it back as
    per-channel Fp8Weights, and the engine serves the directory."""
    activations = "dynamic"
    from jaxserve import LLM, SamplingParams
    from jaxserve.quantize import quantize_model
    out = tmp_path / "fp8"
    files = quantize_model(out, str(TINY), num_samples=3, num_tokens=24, activations=activations,
                           load_format="dummy")
    assert "model.safetensors" in files
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    group = q["config_groups"]["group_0"]
    assert q["quant_method"] == "compressed-tensors" and group["weights"]["strategy"] == "channel"
    assert (group["input_activations"] is None) == (activations == "none")
    _, loaded = load_model(out, "float32", fp8_activations="w8a8")   # the scheme as written (W8A8 on FP8 GPUs)
    for name in LINEARS:
        w = getattr(loaded.layers, name)
        assert isinstance(w, Fp8Weight) and w.activations == activations and w.granularity == "channel"
    _, served = load_model(out, "float32")                            # off FP8 hardware (this CPU): W8A16
    assert all(getattr(served.layers, name).activations == "none" for name in LINEARS)
    with LLM(str(out), max_model_len=64, max_num_seqs=2, num_gpu_blocks_override=64, warmup=False) as llm:
        out_ids = llm.generate({"prompt_token_ids": [1, 5, 9]}, SamplingParams(max_tokens=4, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids
    assert len(out_ids) == 4


def test_export_round_trips_round_to_nearest_fp8(tmp_path):
    """An RTN `--quantization fp8` model exported and loaded back has bit-identical codes and
    scales (the export writes Fp8Weights as compressed-tensors whatever made them)."""
    from jaxserve.loader.export import export_model
    from jaxserve.tokenizer.tokenizer import Tokenizer
    cfg, weights = load_model(TINY, "float32", load_format="dummy", seed=5, quantization="fp8")
    tokenizer = Tokenizer.synthetic(cfg.vocab_size, cfg.eos_token_ids[0])
    export_model(tmp_path, cfg, tokenizer, weights)
    _, loaded = load_model(tmp_path, "float32")
    for name in LINEARS:
        a, b = getattr(weights.layers, name), getattr(loaded.layers, name)
        assert np.array_equal(np.asarray(a.w).view(np.uint8), np.asarray(b.w).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))


def test_quantize_cli_reads_a_calibration_file_and_reports_bad_lines(tmp_path, capsys):
    """`jaxserve quantize --calibration-file`: a JSONL corpus calibrates (the dummy tiny model's
    synthetic tokenizer reads "t17 t42" as [17, 42]); a missing file or a line without "text" is
    exit code 2 with a message naming it, and nothing is written."""
    from jaxserve.server.cli.main import main
    corpus = tmp_path / "corpus.jsonl"
    rng = np.random.default_rng(6)
    corpus.write_text("".join(json.dumps({"text": " ".join(f"t{i}" for i in rng.integers(3, 1000, 20))}) + "\n"
                              for _ in range(3)))
    args = [str(TINY), "--load-format", "dummy", "--calibration-tokens", "16", "--activations", "none"]
    assert main(["quantize", str(tmp_path / "ok"), *args, "--calibration-file", str(corpus)]) == 0
    assert "jaxserve serve" in capsys.readouterr().out
    _, loaded = load_model(tmp_path / "ok", "float32")
    assert isinstance(loaded.layers.w_down, Fp8Weight) and loaded.layers.w_down.activations == "none"

    assert main(["quantize", str(tmp_path / "bad"), *args, "--calibration-file", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "t5 t6 t7"}\n{"prompt": "no text"}\n')
    assert main(["quantize", str(tmp_path / "bad"), *args, "--calibration-file", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and '"text"' in err
    assert not (tmp_path / "bad").exists()
