"""fp8 KV pools on CPU are held as uint8 bit patterns (`KVCache.codes`): a write never converts the
whole pool (issue 11 item 8: XLA:CPU converted fp8 pools to f16 and back on every scatter, so a
step cost grew with the pool), and attention reads the same values as from an fp8 pool."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import kv_cache as kvc
from jaxserve.attention import kv_quant
from jaxserve.attention.backend import paged_attention
from jaxserve.attention.metadata import AttentionMetadata

L, N, B, K, D, H = 2, 64, 16, 2, 64, 4


def _write(cache, k, v, slots, fp8):
    quantize = functools.partial(kv_quant.quantize_kv, storage_dtype=fp8)
    return kvc.write(cache, jnp.int32(1), k, v, slots, quantize)


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_byte_pool_write_converts_no_pool_sized_array(fp8):
    cache = kvc.allocate(L, N, B, K, D, fp8, quantized=True, fp8_as_bytes=True)
    assert cache.k.dtype == jnp.uint8 and cache.dtype == jnp.dtype(fp8)
    x = jnp.ones((16, K, D), jnp.float32)
    slots = jnp.arange(16, dtype=jnp.int32)
    hlo = jax.jit(_write, static_argnums=4, donate_argnums=0).lower(cache, x, x, slots, fp8).compile().as_text()
    pool = rf"\[{L * N},{B},{K},{D}\]|\[{L},{N},{B},{K},{D}\]"
    converts = [line for line in hlo.splitlines()
                if re.search(r"\b(convert|bitcast-convert)\(", line) and re.search(pool, line)]
    assert not converts, converts


def test_byte_pool_attention_equals_fp8_pool():
    rng = np.random.default_rng(0)
    fp8 = jnp.float8_e4m3fn
    T = 24
    k, v = (jnp.asarray(rng.standard_normal((T, K, D)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
    slots = jnp.asarray(np.r_[np.arange(10), 32 + np.arange(14)], jnp.int32)   # blocks 0 and 2..
    meta = AttentionMetadata(slots, jnp.asarray([[0, 0, 0, 0], [2, 3, 0, 0]], jnp.int32),
                             jnp.asarray([10, 14], jnp.int32), jnp.asarray([0, 10, 24], jnp.int32),
                             jnp.asarray([2], jnp.int32))
    outs, pools = [], []
    for as_bytes in (False, True):
        cache = kvc.allocate(L, N, B, K, D, fp8, quantized=True, fp8_as_bytes=as_bytes)
        cache = _write(cache, k, v, slots, fp8)
        out, cache = jax.jit(lambda q, c: paged_attention(q, c, jnp.int32(1), meta, backend="reference",
                                                          sm_scale=D ** -0.5))(q, cache)
        outs.append(np.asarray(out))
        pools.append(np.asarray(kvc.as_values(cache.k, cache.codes)).astype(np.float32))
        assert cache.codes == (jnp.dtype(fp8).name if as_bytes else None)
    np.testing.assert_array_equal(pools[0], pools[1])
    np.testing.assert_array_equal(outs[0], outs[1])
    assert np.abs(outs[0]).max() > 0
