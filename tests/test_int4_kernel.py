"""The `Int4Weight` kernel (layers/int4.py) against its dequantised reference: tiles by shape, tensor-
parallel blocks, bf16 tiles at batch (`--dtype auto` on CPU), bounded temporaries, the GPTQ bit order.
The checkpoint formats are tests/test_int4.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers import int4 as int4_layer
from jaxserve.layers.int4 import Int4Weight, pack, ref_int4_matmul, unpack
from jaxserve.layers.linear import linear


def _random_weight(rng, k, n, g, asym, act_order, shards=1):
    codes = rng.integers(0, 16, (k, n)).astype(np.uint8)
    return Int4Weight(pack(jnp.asarray(codes)), jnp.asarray(rng.random((k // g, n)) * 0.02, jnp.float32),
                      jnp.asarray(rng.integers(0, 16, (k // g, n)), jnp.uint8) if asym else None,
                      jnp.asarray(rng.permutation(k), jnp.int32) if act_order else None, g, shards)


@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("shards", [1, 4])
def test_int4_linear_matches_dequantised_reference(monkeypatch, asym, act_order, shards):
    rng = np.random.default_rng(7)
    k, n, g = 512, 64, 32
    w = _random_weight(rng, k, n, g, asym, act_order, shards)
    assert np.array_equal(unpack(w.q).shape, (k, n)) and w.shape == (k, n)
    x = jnp.asarray(rng.standard_normal((3, 5, k)), jnp.float32)
    ref = ref_int4_matmul(x, w)
    for tile_groups in (1, 4, 16):            # scanned tiles of 1 and 4 groups, and one tile
        monkeypatch.setattr(int4_layer, "TILE_BYTES", tile_groups * g * n * 4)
        y = jax.jit(linear)(x, w)
        assert y.shape == (3, 5, n) and y.dtype == jnp.float32
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * float(jnp.abs(ref).max()))
    yb = jax.jit(linear)(x.astype(jnp.bfloat16), w)
    assert yb.dtype == jnp.bfloat16
    assert float(jnp.abs(yb.astype(jnp.float32) - ref).max()) < 0.02 * float(jnp.abs(ref).max())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shards", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_int4_linear_tiles_columns_of_a_wide_matrix(monkeypatch, bits, shards):
    """Column tiles (a wide matrix: the tied head), with a remainder tile, two-way tiles, and
    per-device column blocks (`out_shards`) give the reference's numbers."""
    rng = np.random.default_rng(3)
    k, n, g = 256, 148, 32                       # 148 = 2 * 2 * 37: column tiles of 24 leave a remainder
    codes = rng.integers(0, 16, (k, n)) if bits == 4 else rng.integers(-127, 128, (k, n))
    q = pack(jnp.asarray(codes, jnp.uint8)) if bits == 4 else jnp.asarray(codes, jnp.int8)
    w = Int4Weight(q, jnp.asarray(rng.random((k // g, n)) * 0.02, jnp.float32), None, None, g, shards[0],
                   offset=jnp.asarray(rng.random((k // g, n)) * 0.01, jnp.float32) if bits == 4 else None,
                   bits=bits, out_shards=shards[1])
    x = jnp.asarray(rng.standard_normal((3, k)), jnp.float32)
    ref = ref_int4_matmul(x, w)
    monkeypatch.setattr(int4_layer, "MIN_TILE_COLS", 8)
    ks, ns = k // shards[0], n // shards[1]
    for tile_bytes, want in ((ks * 30 * 4, (ks, 24)),                        # no divisor of 148 or 74: a remainder
                             (g * 8 * 4, (g, 8)),                            # under 8 columns: rows split too
                             (ks * ns * 4, (ks, ns))):                       # one tile
        monkeypatch.setattr(int4_layer, "TILE_BYTES", tile_bytes)
        assert int4_layer.tile_shape(ks, ns, g) == want
        np.testing.assert_allclose(jax.jit(linear)(x, w), ref, rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("in_shards", [1, 2])
def test_bf16_tiles_from_min_rows_and_f32_below(bits, in_shards):
    """`with_bf16_tiles` (`--dtype auto` on CPU): f32 activations of >= min_rows rows multiply bf16
    tiles with f32 accumulation (the rows rounded to bf16, the weights dequantised to bf16), fewer
    rows keep the f32 tiles bit for bit; the result stays f32."""
    rng = np.random.default_rng(5)
    k, n, g = 256, 96, 32
    codes = rng.integers(0, 16, (k, n)) if bits == 4 else rng.integers(-127, 128, (k, n))
    q = pack(jnp.asarray(codes, jnp.uint8)) if bits == 4 else jnp.asarray(codes, jnp.int8)
    w = Int4Weight(q, jnp.asarray(rng.random((k // g, n)) * 0.02, jnp.float32), None, None, g, in_shards,
                   offset=jnp.asarray(rng.random((k // g, n)) * 0.01, jnp.float32) if bits == 4 else None, bits=bits)
    tiled = int4_layer.with_bf16_tiles({"w": w, "other": jnp.ones(3)}, min_rows=16)
    assert tiled["w"].bf16_min_rows == 16 and w.bf16_min_rows is None
    full = int4_layer.dequantize(w.q, w.scale, None, g, jnp.float32, w.offset, bits)
    for rows in (2, 15, 16, 40):
        x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
        y = jax.jit(linear)(x, tiled["w"])
        assert y.dtype == jnp.float32
        if rows < 16:
            np.testing.assert_array_equal(y, jax.jit(linear)(x, w))
            continue
        ref16 = jnp.dot(x.astype(jnp.bfloat16).astype(jnp.float32), full.astype(jnp.bfloat16).astype(jnp.float32),
                        precision="highest")
        np.testing.assert_allclose(y, ref16, rtol=1e-5, atol=1e-5 * float(jnp.abs(ref16).max()))
        ref = ref_int4_matmul(x, w)
        assert float(jnp.abs(y - ref).max()) < 0.01 * float(jnp.abs(ref).max())


def test_the_cpu_default_dtype_takes_bf16_tiles_where_they_pay_and_float32_does_not(monkeypatch):
    from jaxserve.layers import int4_cpu
    from jaxserve.loader.loader import bf16_tiles_pay, cpu_matmuls_for
    w = _random_weight(np.random.default_rng(1), 64, 16, 32, False, False)
    monkeypatch.setattr(int4_cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert bf16_tiles_pay()
    assert cpu_matmuls_for(w, "auto", platform="cpu").bf16_min_rows == int4_layer.BF16_MIN_ROWS
    assert cpu_matmuls_for(w, "float32", platform="cpu").bf16_min_rows is None
    assert cpu_matmuls_for(w, "auto", platform="gpu").bf16_min_rows is None     # bf16 activations there already
    # an x86 CPU without bf16 multiplies (AVX2 only: bf16 tiles measured slower): f32 tiles
    monkeypatch.setattr(int4_cpu, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    assert not bf16_tiles_pay() and cpu_matmuls_for(w, "auto", platform="cpu").bf16_min_rows is None
    monkeypatch.setenv("JAXSERVE_CPU_BF16_TILES", "1")                          # the override
    assert cpu_matmuls_for(w, "auto", platform="cpu").bf16_min_rows == int4_layer.BF16_MIN_ROWS
    monkeypatch.setenv("JAXSERVE_CPU_BF16_TILES", "0")
    monkeypatch.setattr(int4_cpu, "cpu_flags", lambda: None)                   # not x86 Linux
    assert cpu_matmuls_for(w, "auto", platform="cpu").bf16_min_rows is None
    monkeypatch.delenv("JAXSERVE_CPU_BF16_TILES")
    assert cpu_matmuls_for(w, "auto", platform="cpu").bf16_min_rows == int4_layer.BF16_MIN_ROWS


def test_int4_matmul_never_materialises_the_whole_matrix():
    """Compiled temporaries stay a few tiles: far below the f32 matrix a whole dequantisation needs."""
    k, n = 8192, 2048
    w = _random_weight(np.random.default_rng(0), k, n, 128, True, False)
    x = jnp.ones((4, k), jnp.float32)
    temp = jax.jit(linear).lower(x, w).compile().memory_analysis().temp_size_in_bytes
    full = k * n * 4
    print(f"int4 matmul temporaries {temp / 2**20:.1f} MiB, whole f32 matrix {full / 2**20:.1f} MiB")
    assert temp < 1.5 * int4_layer.TILE_BYTES < full / 8


def test_pack_and_unpack_round_trip_gptq_bit_order():
    codes = np.arange(16, dtype=np.uint8).reshape(16, 1) % 16
    q = np.asarray(pack(jnp.asarray(codes)))
    assert q.shape == (2, 1) and q.view(np.uint32)[0, 0] == 0x76543210   # row 8r + j in bits 4j
    assert np.array_equal(np.asarray(unpack(jnp.asarray(q))), codes)
