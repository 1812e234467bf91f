"""`linear`: the one place a weight meets an activation."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def linear(x: jax.Array, w, b: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ w [in, out] (+ b [out]). Accumulates in f32 for low-precision inputs."""
    pref = jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else None
    y = jnp.einsum("...i,io->...o", x, w, preferred_element_type=pref).astype(x.dtype)
    if b is not None:
        y = y + b.astype(y.dtype)
    return y
