"""The AMX kernel (layers/csrc/amx_matmul.cc): quantized matmuls of many rows on Intel AMX's bf16
tiles, the arithmetic of the engine's bf16 tiles (x and the dequantised weight rounded to bf16,
f32 sums). Runs where the CPU has AMX-BF16 (Sapphire Rapids and later); elsewhere the engine keeps
the tiles, which the fallback test checks on every machine."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_int4_cpu_kernel import _weight

from jaxserve.layers import int4 as int4_layer
from jaxserve.layers import int4_cpu
from jaxserve.layers.int4 import (
    BF16_MIN_ROWS,
    Int4Weight,
    checkpoint_layout,
    unpack,
    with_bf16_tiles,
    with_fused_kernel,
)
from jaxserve.layers.int4_layout import cpu_layout
from jaxserve.layers.linear import linear
from jaxserve.layers.scan import scan_layers

# A CPU without AMX skips these (CI allows that skip); a kernel that did not build fails them in CI.
amx = pytest.mark.skipif(not (int4_cpu.load() is None and int4_cpu.amx()),
                         reason="needs a CPU with AMX-BF16" if int4_cpu.load() is None
                         else f"the kernels did not build: {int4_cpu.load()}")


def _bf16_reference(x, w: Int4Weight):
    """The kernel's arithmetic in f64: each weight code * scale + (offset - zero * scale) rounded
    once to f32 (a fused multiply-add), then to bf16; x rounded to bf16; exact sums."""
    w = checkpoint_layout(w)
    codes = np.asarray(unpack(w.q) if w.bits == 4 else w.q, np.float64)
    g = w.group_size
    s = np.repeat(np.asarray(w.scale, np.float32), g, axis=0)
    zp = np.repeat(np.asarray(w.zero, np.float32), g, axis=0) if w.zero is not None else np.float32(w.group_zero)
    off = np.repeat(np.asarray(w.offset, np.float32), g, axis=0) if w.offset is not None else np.float32(0)
    bias = (off.astype(np.float64) - zp.astype(np.float64) * s).astype(np.float32)
    W = (codes * s + bias).astype(np.float32)
    xb = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    return xb @ np.asarray(jnp.asarray(W).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


def _near(y, ref):
    assert np.abs(np.asarray(y, np.float64) - ref).max() <= 1e-5 * np.abs(ref).max()


@amx
@pytest.mark.parametrize("kind", ["offset", "zero", "symmetric", "int8"])
@pytest.mark.parametrize("k,n,g", [(576, 1536, 32), (1536, 576, 32), (256, 48, 128), (64, 208, 64)])
def test_kernel_matches_the_bf16_reference(kind, k, n, g):
    """Row counts in one tile (1, 5, 16), tiles of a pass partly filled (17, 33, 70), whole passes
    of 64, several passes over one dequantised strip (130), and two row blocks of x, the second
    partly filled (300); both layouts (the kernel's column blocks with f16 scales)."""
    rng = np.random.default_rng(k + n + g)
    w = _weight(rng, k, n, g, kind)
    for layout in (w, cpu_layout(w)):
        call = jax.jit(lambda x, w: int4_cpu.matmul(x, w.q, w.scale, w.zero, w.offset, None, w.group_size, w.bits,
                                                    zero_point=w.group_zero, col_block=w.col_block, amx=True))
        for rows in (1, 5, 16, 17, 33, 64, 70, 130, 300):
            x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
            _near(call(x, layout), _bf16_reference(x, w))


@amx
def test_the_kernel_refuses_what_it_does_not_take():
    rng = np.random.default_rng(1)
    w = _weight(rng, 48, 32, 16, "offset")             # 48 inputs: not chunks of 32
    x = jnp.ones((20, 48), jnp.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        int4_cpu.matmul(x, w.q, w.scale, w.zero, w.offset, None, 16, 4, amx=True)
    with pytest.raises(ValueError, match="int8_x"):
        int4_cpu.matmul(jnp.ones((20, 64), jnp.float32), *(lambda v: (v.q, v.scale, None, v.offset))(
            _weight(rng, 64, 32, 32, "offset")), None, 32, 4, int8_x=True, amx=True)
    # linear keeps such a weight on the tiles
    on = with_fused_kernel(with_bf16_tiles(w), amx_min_rows=BF16_MIN_ROWS)
    assert int4_cpu.AMX_TARGET not in jax.jit(linear).lower(x, on).as_text()


@amx
def test_linear_takes_the_kernel_from_its_rows_up_to_its_limit():
    """Below `amx_min_rows` the fused kernel (up to its rows), from there the AMX kernel, past
    `AMX_MAX_ROWS` the tiles; the AMX results are the bf16 tiles' (the same arithmetic)."""
    rng = np.random.default_rng(2)
    w = cpu_layout(with_fused_kernel(with_bf16_tiles(_weight(rng, 256, 96, 32, "offset")), amx_min_rows=BF16_MIN_ROWS))
    tiles = with_bf16_tiles(_weight(np.random.default_rng(2), 256, 96, 32, "offset"))
    fn = jax.jit(linear)
    for lead in [(1,), (15,), (16,), (4, 8), (int4_cpu.AMX_MAX_ROWS,), (int4_cpu.AMX_MAX_ROWS + 1,)]:
        x = jnp.asarray(rng.standard_normal((*lead, 256)), jnp.float32)
        text, rows = fn.lower(x, w).as_text(), int(np.prod(lead))
        on_amx = BF16_MIN_ROWS <= rows <= int4_cpu.AMX_MAX_ROWS
        assert (int4_cpu.AMX_TARGET in text) == on_amx
        assert (int4_cpu.TARGET in text) == (rows <= int4_cpu.FUSED_MAX_ROWS and not on_amx)
        if on_amx:
            y = fn(x, w)
            assert y.shape == (*lead, 96) and y.dtype == jnp.float32
            np.testing.assert_allclose(y, fn(x, tiles), rtol=1e-3, atol=1e-3 * float(jnp.abs(y).max()))


@amx
def test_the_layer_scan_hands_the_kernel_the_whole_stack():
    rng = np.random.default_rng(3)
    L, k = 3, 128
    w = cpu_layout(with_fused_kernel(with_bf16_tiles(_weight(rng, k, k, 32, "offset", layers=L)),
                                   amx_min_rows=BF16_MIN_ROWS))
    bias = jnp.asarray(rng.standard_normal((L, k)), jnp.float32)

    def body(h, xs):
        lw, layer, b = xs
        return jnp.tanh(linear(h, lw["w"]) + b), None

    def run(x, w):
        return scan_layers(body, x, ({"w": w}, jnp.arange(L, dtype=jnp.int32), bias))

    x = jnp.asarray(rng.standard_normal((32, k)), jnp.float32)
    text = jax.jit(run).lower(x, w).as_text()
    assert any(int4_cpu.AMX_TARGET in line and f"tensor<{L}x" in line for line in text.splitlines())
    plain = dataclasses.replace(checkpoint_layout(w), fused_max_rows=None, amx_min_rows=None)
    np.testing.assert_allclose(jax.jit(run)(x, w), jax.jit(run)(x, plain), atol=2e-2)


@amx
def test_gradients_through_the_kernel_are_the_tiles_gradients():
    rng = np.random.default_rng(4)
    w = with_bf16_tiles(_weight(rng, 128, 64, 32, "offset"))
    x = jnp.asarray(rng.standard_normal((32, 128)), jnp.float32)

    def loss(x, w):
        return jnp.sum(jnp.sin(linear(x, w)))

    gx, gw = jax.grad(loss, argnums=(0, 1), allow_int=True)(x, with_fused_kernel(w, amx_min_rows=BF16_MIN_ROWS))
    rx, rw = jax.grad(loss, argnums=(0, 1), allow_int=True)(x, w)
    for a, b in [(gx, rx), (gw.scale, rw.scale), (gw.offset, rw.offset)]:
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2 * float(jnp.abs(b).max()))


def test_the_engine_takes_the_kernel_where_the_cpu_has_amx(monkeypatch):
    """`--dtype auto` on one CPU device: AMX from the bf16 tiles' rows where `amx()` says so, never
    with f32 tiles (`--dtype float32`), several devices, or without it (`JAXSERVE_CPU_AMX=0`)."""
    from jaxserve.loader.loader import cpu_matmuls_for
    monkeypatch.setenv("JAXSERVE_CPU_BF16_TILES", "1")
    w = {"w": _weight(np.random.default_rng(5), 64, 16, 32, "offset")}
    if int4_cpu.load() is not None:
        pytest.skip(f"no kernel build: {int4_cpu.load()}")
    for has in (True, False):
        monkeypatch.setattr(int4_cpu, "_AMX", [has])
        on = cpu_matmuls_for(w, "auto", 1, platform="cpu")["w"]
        # from where the tiles took over (past the fused kernel's rows): the same numbers as before
        assert on.amx_min_rows == (int4_cpu.FUSED_MAX_ROWS + 1 if has else None)
        assert on.fused_max_rows == int4_cpu.FUSED_MAX_ROWS and int4_layer.BF16_MIN_ROWS <= int4_cpu.FUSED_MAX_ROWS + 1
        assert cpu_matmuls_for(w, "float32", 1, platform="cpu")["w"].amx_min_rows is None
        assert cpu_matmuls_for(w, "auto", 2, platform="cpu")["w"].amx_min_rows is None
    with pytest.raises(ValueError, match="AMX"):
        with_fused_kernel(w, amx_min_rows=BF16_MIN_ROWS)          # _AMX is [False] here


@amx
def test_the_default_model_on_the_kernel_generates_what_the_tiles_do():
    """A decode step of 32 rows of the default model through the AMX kernel and through XLA's bf16
    tiles: the same greedy tokens, logits within bf16's rounding."""
    from jaxserve.default_model import default_model_path
    from jaxserve.loader.loader import cpu_matmuls_for, load_model
    from jaxserve.models.llama import mlp
    cfg, weights = load_model(default_model_path(), "float32", quantization="gguf")
    on = cpu_matmuls_for(weights, "auto", 1, platform="cpu")
    layers = on.layers
    assert layers.w_up.amx_min_rows == int4_cpu.FUSED_MAX_ROWS + 1
    off = jax.tree.map(lambda w: dataclasses.replace(w, amx_min_rows=None) if isinstance(w, Int4Weight) else w,
                       layers, is_leaf=lambda x: isinstance(x, Int4Weight))
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((32, cfg.hidden_size)), jnp.float32)

    def block(layers, x):        # every layer's MLP (gate, up, down) in turn
        return scan_layers(lambda h, xs: (h + mlp(cfg, None, xs[0], h), None), x,
                           (layers, jnp.arange(cfg.num_layers, dtype=jnp.int32)))

    a, b = jax.jit(block)(layers, x), jax.jit(block)(off, x)
    assert int4_cpu.AMX_TARGET in jax.jit(block).lower(layers, x).as_text()
    np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * float(jnp.abs(b).max()))
