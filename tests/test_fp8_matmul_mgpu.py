"""The Mosaic GPU FP8 matmul (jaxserve/pallas/fp8_matmul.py, `fp8_matmul_mgpu`).

Gates, as for the attention kernel: GPU interpret mode (jax >= 0.11, on CPU) against
`ref_fp8_matmul` on random shapes (M 1..300, K and N multiples of 128 and not), every scale
granularity and activation scheme; lowering for CUDA under an H100 AbstractDevice (layouts,
shared memory) for every shipped tile configuration; `gpu`-marked: compiled on a GPU.
On jax < 0.11 these skip with a reason starting "needs jax".
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_lowering import lower_for_cuda

from jaxserve.pallas import fp8_matmul as fm

needs_mgpu = pytest.mark.skipif(
    not fm.MGPU_AVAILABLE,
    reason=f"needs jax >= 0.11 for Mosaic GPU plgpu.kernel + GPU interpret mode (this is {jax.__version__}); "
           "run with the Python 3.12 venv")

# (M, K, N, weight scales, activations, x dtype)
CASES = [
    (1, 256, 128, "block", "dynamic", "bfloat16"),
    (37, 200, 130, "channel", "dynamic", "float32"),
    (70, 384, 256, "tensor", "static", "bfloat16"),
    (129, 128, 200, "block", "dynamic", "float32"),
    (300, 130, 128, "channel", "static", "float32"),
    (64, 1000, 192, "block", "dynamic", "bfloat16"),      # more K slices than the decode tiles' slots
    (33, 384, 200, "group", "dynamic", "float32"),        # 1 x 128 groups: per-slice column scales
    (130, 300, 128, "group", "static", "bfloat16"),
]


def _inputs(m, k, n, granularity, dtype, seed):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w, s = fm.quantize_weight(jax.random.normal(kw, (k, n)) * 0.05, granularity)
    return x, w, s


def _reference(x, w, s, activations):
    """ref_fp8_matmul on the same e4m3 activations the kernel multiplies."""
    if activations == "static":
        xs = jnp.full((x.shape[0], 1), 0.02, jnp.float32)
        return fm.ref_fp8_matmul((x.astype(jnp.float32) / xs).clip(-448, 448).astype(fm.FP8), w, s, x_scale=xs)
    grouped = fm.scale_kind(s.shape, w.shape[1]) in ("block", "group")
    xq, xs = fm.quantize_activations(x, 128 if grouped else None)
    return fm.ref_fp8_matmul(xq, w, s, x_scale=xs)


@needs_mgpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_interpret_matches_reference(case):
    m, k, n, granularity, activations, dtype = case
    x, w, s = _inputs(m, k, n, granularity, dtype, seed=m + k + n)
    y = fm.fp8_matmul_mgpu(x, w, s, activations=activations, input_scale=jnp.float32(0.02), interpret=True)
    ref = _reference(x, w, s, activations)
    assert y.shape == (m, n) and y.dtype == x.dtype
    tol = 2e-2 if dtype == "bfloat16" else 1e-5        # bf16 output rounding vs f32 accumulation
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=tol, atol=tol * float(jnp.abs(ref).max()))


@needs_mgpu
def test_k_major_weight_and_w8a16_through_the_public_entry():
    """Weights stored [N, K] (what the loader keeps for this kernel) give the same result; W8A16
    is not a kernel case and goes to XLA."""
    x, w, s = _inputs(8, 256, 128, "block", "float32", seed=1)
    y = fm.fp8_matmul_mgpu(x, w.T, s, k_major=True, interpret=True)
    np.testing.assert_allclose(y, _reference(x, w, s, "dynamic"), rtol=1e-5, atol=1e-5)
    y16 = fm.fp8_matmul(x, w.T, s, activations="none", kernel="pallas", k_major=True)
    np.testing.assert_allclose(y16, fm.ref_fp8_matmul(x, w, s), rtol=1e-5, atol=1e-5)


@needs_mgpu
@pytest.mark.parametrize("tiles", fm.SHIPPED_TILES, ids=str)
@pytest.mark.parametrize("granularity", ["block", "group", "channel"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_shipped_tiles_lower_for_cuda(tiles, granularity, dtype):
    assert fm.smem_bytes(tiles, dtype) <= 227 * 1024
    f = jax.jit(functools.partial(fm.fp8_matmul_mgpu, activations="dynamic", tiles=tiles))
    k = n = 1024
    scale = {"block": (k // 128, n // 128), "group": (k // 128, n), "channel": (1, n)}[granularity]
    text = lower_for_cuda(f, jax.ShapeDtypeStruct((tiles.tile_m, k), jnp.dtype(dtype)),
                          jax.ShapeDtypeStruct((k, n), fm.FP8), jax.ShapeDtypeStruct(scale, jnp.float32))
    assert "mosaic_gpu" in text


def test_old_jax_gets_a_clear_error():
    if fm.MGPU_AVAILABLE:
        pytest.skip("needs jax < 0.11 (this jax has Mosaic GPU's plgpu.kernel)")
    x, w, s = _inputs(4, 128, 128, "block", "float32", seed=0)
    with pytest.raises(ValueError, match="needs jax >= 0.11"):
        fm.fp8_matmul_mgpu(x, w, s)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_compiled_matches_reference(case):
    m, k, n, granularity, activations, dtype = case
    x, w, s = _inputs(m, k, n, granularity, dtype, seed=m + k + n)
    y = jax.jit(functools.partial(fm.fp8_matmul_mgpu, activations=activations))(x, w, s, input_scale=jnp.float32(0.02))
    ref = _reference(x, w, s, activations)
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=tol, atol=tol * float(jnp.abs(ref).max()))


RACE_TILES = [fm.Fp8Tiles(64, 64, stages=2), fm.DECODE_TILES]


@needs_mgpu
@pytest.mark.parametrize("tiles", RACE_TILES, ids=str)
@pytest.mark.parametrize("scales,seed", [("block", 3), ("channel", 4)])
def test_interpret_finds_no_races(tiles, scales, seed):
    """The interpreter's race detector over more K slices than slots (every slot refilled while
    later slices are in flight): block scales promote per K slice; per-channel weights use one
    accumulator over K, a slot refilled after its wgmma's wait. It tracks TMA copies and ordinary
    SMEM loads (the scales), not wgmma operand reads (jax 0.11.2)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret
    x, w, s = _inputs(64, 1024, 128, scales, "bfloat16", seed=seed)
    gpu_interpret.reset_gpu_interpret_mode_state()
    y = fm.fp8_matmul_mgpu(x, w, s, tiles=tiles, interpret=fm.plgpu.InterpretGPUParams(detect_races=True))
    assert not gpu_interpret.get_races().races_found
    np.testing.assert_allclose(np.asarray(y, np.float32), _reference(x, w, s, "dynamic"), rtol=2e-2,
                               atol=2e-2 * float(jnp.abs(y).max()))


@needs_mgpu
def test_stacked_pallas_weight_lowers_inside_scan():
    """What the model does: `linear` on an Fp8Weight(kernel="pallas", K-major) sliced by lax.scan
    over layers, bf16 activations, lowered for CUDA."""
    from jaxserve.layers.fp8 import Fp8Weight
    from jaxserve.layers.linear import linear

    def model(x, w):
        return jax.lax.scan(lambda h, wl: (linear(h, wl), None), x, w)[0]
    w = Fp8Weight(jax.ShapeDtypeStruct((2, 512, 512), fm.FP8), jax.ShapeDtypeStruct((2, 4, 4), jnp.float32),
                  activations="dynamic", kernel="pallas", k_major=True)
    text = lower_for_cuda(jax.jit(model), jax.ShapeDtypeStruct((16, 512), jnp.bfloat16), w)
    assert "mosaic_gpu" in text
