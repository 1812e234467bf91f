"""RMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.pallas.common import target_platform


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm computed in f32 (as transformers does), cast back to the input dtype. `offset`:
    the scale is `offset + weight` (Gemma stores its norms as w and scales by 1 + w, in f32)."""
    xf = x.astype(jnp.float32)
    if target_platform() == "cpu":
        ms = row_sum(xf * xf) / xf.shape[-1]
    else:
        ms = jnp.mean(xf * xf, axis=-1, keepdims=True)
    xf = xf * jax.lax.rsqrt(ms + eps)
    return ((weight.astype(jnp.float32) + offset) * xf).astype(x.dtype)


def row_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis (kept, size 1) in one fixed order: halves added elementwise, zeros
    padded to a power of two. XLA:CPU's reduce sums a row in another order once a batch has 8
    rows or more (it vectorizes across rows), so a row's norm, and every logit after it, would
    depend on how many rows share its step; this costs the same up to 64 rows (and ~0.3 ms a
    norm at 2048 rows of 576)."""
    n = x.shape[-1]
    p = 1 << (n - 1).bit_length()
    if p != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, p - n)])
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x
