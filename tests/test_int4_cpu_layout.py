"""The fused CPU kernel's weight layout (`layers.int4_layout.cpu_layout`): column blocks, zero points
folded into the offsets, f16 scales where every value is one. The same matrix: the dequantised
values, the kernel's results and the tiles' results are bit-identical to the checkpoint layout's;
the engine lays its int4 weights out so with `--dtype auto` on one CPU device."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_int4_cpu_kernel import _close, _weight

from jaxserve.layers import int4_cpu
from jaxserve.layers.embedding import embed_rows
from jaxserve.layers.experts import ExpertWeight
from jaxserve.layers.int4 import (
    Int4Weight,
    checkpoint_layout,
    dequantize,
    ref_int4_matmul,
    with_bf16_tiles,
    with_fused_kernel,
)
from jaxserve.layers.int4_layout import COL_BLOCK, INT8_GROUP, cpu_layout, dense_as_int8, int8_of, with_cpu_layout
from jaxserve.layers.linear import DenseWeight, linear
from jaxserve.layers.scan import scan_layers


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert int4_cpu.load() is None, int4_cpu.load()


def _f16(a):
    return a.astype(jnp.float16).astype(jnp.float32)


def _gguf(rng, k, n, kind, layers=None):
    """A weight as loader/gguf_quant.py builds one from a GGUF file: f16 scales d and, for Q4_1,
    the offset m + 8 d (the symmetric zero 8) from an f16 minimum m."""
    w = _weight(rng, k, n, 32, {"q4_1": "offset", "q4_0": "symmetric", "q8_0": "int8"}[kind], layers=layers)
    d = _f16(w.scale)
    offset = None
    if kind == "q4_1":
        offset = _f16(-jnp.asarray(rng.random(d.shape), jnp.float32) * 0.1) + 8 * d
    return dataclasses.replace(w, scale=d, offset=offset)


def _dequantized(w: Int4Weight) -> jax.Array:
    w = checkpoint_layout(w)
    return dequantize(w.q, w.scale, w.zero, w.group_size, offset=w.offset, bits=w.bits, zero_point=w.zero_point)


@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q8_0", "gptq", "gptq-f16"])
def test_the_layout_keeps_the_matrix_and_stores_f16_where_exact(kind):
    rng = np.random.default_rng(0)
    if kind.startswith("gptq"):
        w = _weight(rng, 256, 192, 64, "zero")
        if kind == "gptq-f16":
            w = dataclasses.replace(w, scale=_f16(w.scale))
    else:
        w = _gguf(rng, 256, 192, kind)
    c = cpu_layout(w)
    assert c.col_block == COL_BLOCK and c.shape == w.shape == (256, 192)
    assert c.q.shape[-3:] == (192 // COL_BLOCK, w.q.shape[-2], COL_BLOCK)
    assert bool(jnp.all(_dequantized(c) == _dequantized(w)))
    # GGUF's scales and (for Q4_1) its minimum m, f16 in the file, are f16 again: 0.625 bytes a
    # Q4_1 weight instead of 0.75
    assert c.scale.dtype == (jnp.float32 if kind == "gptq" else jnp.float16)
    if kind == "q4_1":
        assert c.zero is None and c.zero_point == 0 and c.offset.dtype == jnp.float16
        assert c.nbytes / (256 * 192) == pytest.approx(0.625)
    if kind.startswith("gptq"):
        # zeros times f16 scales are no f16 offsets: the one-byte zero array stays
        assert c.zero is not None and c.offset is None
    assert c.dtype == jnp.float32          # what it computes in, whatever the scales' storage
    assert checkpoint_layout(c).q.shape == w.q.shape


def test_what_the_layout_leaves_alone():
    rng = np.random.default_rng(1)
    odd = _gguf(rng, 64, 48, "q4_1")                      # 48 columns: no whole 64-column block
    assert cpu_layout(odd) is odd
    split = dataclasses.replace(_gguf(rng, 64, 128, "q4_1"), in_shards=2)
    assert cpu_layout(split) is split
    experts = ExpertWeight(with_fused_kernel(_gguf(rng, 64, 128, "q4_1", layers=2)))
    dense = with_fused_kernel(_gguf(rng, 64, 128, "q4_1"))
    out = with_cpu_layout({"experts": experts, "dense": dense, "tiles": _gguf(rng, 64, 128, "q4_1")})
    assert out["experts"].w.col_block == 0 and out["tiles"].col_block == 0    # experts; off the kernel
    assert out["dense"].col_block == COL_BLOCK


@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q8_0", "gptq"])
@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (128, 320)])
def test_the_kernel_gives_the_checkpoint_layouts_numbers(kind, k, n):
    """Every row count, f32 and int8 parts of x: bit for bit the kernel's result on the checkpoint
    layout (the same sums in the same order), and the reference's within f32 rounding."""
    rng = np.random.default_rng(k + n)
    w = _weight(rng, k, n, 32, "zero") if kind == "gptq" else _gguf(rng, k, n, kind)
    c = cpu_layout(w)
    for int8_x in [False, True] if kind != "q8_0" and int4_cpu.int8_dot() else [False]:
        fn = jax.jit(lambda x, w, i8=int8_x: int4_cpu.matmul(x, w.q, w.scale, w.zero, w.offset, None, w.group_size,
                                                             w.bits, int8_x=i8, zero_point=w.group_zero,
                                                             col_block=w.col_block))
        for rows in range(1, int4_cpu.MAX_ROWS + 1):
            x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
            y = fn(x, c)
            assert bool(jnp.all(y == fn(x, w))), (int8_x, rows)
            if not int8_x:
                _close(y, ref_int4_matmul(x, w))


def test_linear_on_the_layout_kernel_and_tiles_and_gradients():
    rng = np.random.default_rng(2)
    w = with_bf16_tiles(with_fused_kernel(_gguf(rng, 256, 320, "q4_1")))
    c = cpu_layout(w)
    fn = jax.jit(linear)
    for rows in [1, 2, 4, 5, 16, 40]:         # the kernel; f32 tiles; bf16 tiles
        x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.float32)
        assert (int4_cpu.TARGET in fn.lower(x, c).as_text()) == (rows <= int4_cpu.FUSED_MAX_ROWS)
        assert bool(jnp.all(fn(x, c) == fn(x, w))), rows
    # the tiles over several column tiles and a remainder: a wide matrix, tiled as the head is
    wide = cpu_layout(_gguf(rng, 64, 64 * 300, "q8_0"))
    x = jnp.asarray(rng.standard_normal((6, 64)), jnp.float32)
    _close(fn(x, wide), ref_int4_matmul(x, checkpoint_layout(wide)))

    def loss(x, w):
        return jnp.sum(jnp.sin(linear(x, w)))
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.float32)
    _close(jax.grad(loss)(x, c), jax.grad(loss)(x, dataclasses.replace(w, fused_max_rows=None)))


def test_the_layer_scan_hands_the_kernel_the_blocked_stack():
    rng = np.random.default_rng(3)
    L, k = 3, 128
    w = with_fused_kernel(_gguf(rng, k, k, "q4_1", layers=L))
    c = cpu_layout(w)
    bias = jnp.asarray(rng.standard_normal((L, k)), jnp.float32)

    def run(x, w):
        def body(h, xs):
            lw, _, b = xs
            return jnp.tanh(linear(h, lw["w"]) + b), None
        return scan_layers(body, x, ({"w": w}, jnp.arange(L, dtype=jnp.int32), bias))

    x = jnp.asarray(rng.standard_normal((2, k)), jnp.float32)
    text = jax.jit(run).lower(x, c).as_text()
    q_type = f"tensor<{L}x{k // COL_BLOCK}x{k // 8}x{COL_BLOCK}xi32>"
    assert any(int4_cpu.TARGET in line and q_type in line for line in text.splitlines()), "stack not passed whole"
    assert bool(jnp.all(jax.jit(run)(x, c) == jax.jit(run)(x, w)))


def test_embedding_rows_of_a_blocked_table():
    rng = np.random.default_rng(4)
    for kind in ["q8_0", "q4_1"]:
        table = _gguf(rng, 64, 256, kind)                  # [E, V]
        ids = jnp.asarray([0, 63, 64, 255, 130, 0], jnp.int32)
        assert bool(jnp.all(embed_rows(cpu_layout(table), ids) == embed_rows(table, ids)))


def test_the_kernel_refuses_blocks_it_does_not_take():
    rng = np.random.default_rng(5)
    c = cpu_layout(_gguf(rng, 64, 128, "q4_1"))
    assert int4_cpu.fits(c.q, c.scale, c.zero, c.offset, 32, 4, False, COL_BLOCK)
    assert not int4_cpu.fits(c.q, c.scale, c.zero, c.offset, 32, 4, False, 48)
    mixed = c.offset.astype(jnp.float32)                   # scales and offsets of one dtype
    assert not int4_cpu.fits(c.q, c.scale, c.zero, mixed, 32, 4, False, COL_BLOCK)


def test_the_engine_lays_out_its_kernel_weights():
    from jaxserve.loader.loader import cpu_matmuls_for
    w = {"w": _gguf(np.random.default_rng(6), 64, 128, "q4_1")}
    on = cpu_matmuls_for(w, "auto", 1, platform="cpu")["w"]
    assert on.col_block == COL_BLOCK and on.scale.dtype == jnp.float16
    for off in [cpu_matmuls_for(w, "auto", 2, platform="cpu"), cpu_matmuls_for(w, "float32", 1, platform="cpu")]:
        assert off["w"].col_block == 0 and off["w"].scale.dtype == jnp.float32


def test_a_dense_matrix_rounded_to_int8_codes_and_f16_scales():
    """`int8_of` (GGUF's Q8_0 rounding): every value within half a code of its group's scale,
    the scales exact in f16 (the layout stores them so), the kernel's product within that of the
    dense one; `dense_as_int8` leaves stacks, vectors and matrices of partial groups alone."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((192, 128)).astype(np.float32) * np.linspace(0.01, 3, 128, dtype=np.float32)
    a[:INT8_GROUP, 5] = 0                               # a group of zeros: scale 0, codes 0
    w = int8_of(DenseWeight(jnp.asarray(a)))
    assert w.bits == 8 and w.q.dtype == jnp.int8 and w.shape == a.shape and w.group_size == INT8_GROUP
    scale = np.asarray(w.scale)
    assert np.array_equal(_f16(scale), scale) and scale[0, 5] == 0
    back = np.asarray(dequantize(w.q, w.scale, group_size=w.group_size, bits=8))
    step = np.repeat(scale, INT8_GROUP, axis=0)
    assert np.all(np.abs(back - a) <= 0.5 * step + 1e-3 * np.abs(a) + 1e-12)
    laid = cpu_layout(with_fused_kernel(w))
    x = jnp.asarray(rng.standard_normal((3, 192)).astype(np.float32))
    got, dense = np.asarray(linear(x, laid)), np.asarray(x @ a)
    assert np.abs(got - dense).max() < 1e-2 * np.abs(dense).max()
    tree = dict(m=DenseWeight(jnp.asarray(a)), stack=DenseWeight(jnp.zeros((2, 64, 8))),
                odd=DenseWeight(jnp.zeros((40, 8))), v=jnp.ones(8))
    out = dense_as_int8(tree)
    assert isinstance(out["m"], Int4Weight)
    assert all(isinstance(out[k], DenseWeight) for k in ("stack", "odd")) and out["v"] is tree["v"]
