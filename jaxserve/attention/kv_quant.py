"""KV cache quantisation for `--kv-cache-dtype auto|fp8|fp8_e4m3|fp8_e5m2|int8`.

Scales are per token and kv head, computed when the token's K/V is written (vLLM's
`calculate_kv_scales`, made finer: one f32 scale per `[token, kv_head]` instead of one per layer),
so no calibration pass is needed and a new token never re-quantises old ones:

    scale[t, k] = max_d |x[t, k, d]| / QMAX        (never 0: all-zero rows get scale 1)
    q[t, k, d]  = cast(x[t, k, d] / scale[t, k])   (round to nearest, saturated to +-QMAX)
    x'          = q * scale

QMAX: float8_e4m3fn 448, float8_e5m2 57344, int8 127 (symmetric; -128 is never produced).
Worst-case elementwise error relative to the row's absmax: e4m3 2^-4, e5m2 2^-3, int8 1/254.
Pure jnp; every function is jit-friendly.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_STORAGE = {
    "bfloat16": jnp.bfloat16,       # unquantised, half of f32's bytes (vLLM's name; no scales)
    "fp8": jnp.float8_e4m3fn,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
    "int8": jnp.int8,
}
_QMAX = {
    jnp.dtype(jnp.float8_e4m3fn): 448.0,
    jnp.dtype(jnp.float8_e5m2): 57344.0,
    jnp.dtype(jnp.int8): 127.0,
}


def kv_storage_dtype(name: str, model_dtype) -> jnp.dtype:
    """Cache element dtype for a `--kv-cache-dtype` value ('auto' keeps the model dtype)."""
    if name == "auto":
        return jnp.dtype(model_dtype)
    if name not in _STORAGE:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(_STORAGE)}; got {name!r}")
    return jnp.dtype(_STORAGE[name])


def is_quantized(storage_dtype) -> bool:
    """True when a cache of this dtype carries per-token-head scales."""
    return jnp.dtype(storage_dtype) in _QMAX


def qmax(storage_dtype) -> float:
    """Largest magnitude the quantised code uses (448 / 57344 / 127)."""
    return _QMAX[jnp.dtype(storage_dtype)]


def quantize_kv(x: jax.Array, storage_dtype) -> tuple[jax.Array, jax.Array | None]:
    """x [T, K, D] -> (q [T, K, D] storage_dtype, scale [T, K] f32).

    For an unquantised storage dtype (auto/bf16/f32) returns (x cast, None): such caches have
    no scale arrays (`KVCache.k_scale is None`).
    """
    storage_dtype = jnp.dtype(storage_dtype)
    if not is_quantized(storage_dtype):
        return x.astype(storage_dtype), None
    top = _QMAX[storage_dtype]
    xf = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(xf), axis=-1)                                   # [T, K]
    # Floor at the smallest normal f32 so a tiny-but-nonzero row cannot underflow to scale 0.
    scale = jnp.maximum(absmax / top, jnp.finfo(jnp.float32).tiny)
    scale = jnp.where(absmax > 0, scale, 1.0)
    y = xf / scale[..., None]
    if storage_dtype == jnp.int8:
        y = jnp.round(y)
    y = jnp.clip(y, -top, top)   # f32 rounding of x/scale can land a hair above QMAX
    return y.astype(storage_dtype), scale.astype(jnp.float32)


def dequantize_kv(q: jax.Array, scale: jax.Array | None, out_dtype) -> jax.Array:
    """q [..., D] with scale [...] (or None) -> q * scale in out_dtype."""
    if scale is None:
        return q.astype(out_dtype)
    return (q.astype(jnp.float32) * scale[..., None].astype(jnp.float32)).astype(out_dtype)
