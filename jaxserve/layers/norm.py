"""RMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm computed in f32 (as transformers does), cast back to the input dtype. `offset`:
    the scale is `offset + weight` (Gemma stores its norms as w and scales by 1 + w, in f32)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return ((weight.astype(jnp.float32) + offset) * xf).astype(x.dtype)
