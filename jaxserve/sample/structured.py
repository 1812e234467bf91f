"""Structured output on the device: the packed token bitmask applied to a batch of logit rows.

`bitmask [R, W]` int32, W = ceil(V / 32): bit j of word w set means token 32 * w + j may be
sampled (llguidance's layout). Rows that are not constrained hold all ones (-1). Disallowed
tokens get -1e30, not -inf, so softmax, logprobs and penalties stay finite (an all-masked row
cannot occur: a grammar always allows some token or EOS).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.pallas.common import target_platform

_NEG = -1e30


def allowed_tokens(bitmask: jax.Array, vocab: int) -> jax.Array:
    """[R, W] int32 -> [R, vocab] bool. A broadcast shift, not a gather by token id (half the
    time on XLA:CPU)."""
    R = bitmask.shape[0]
    bits = jnp.right_shift(bitmask[:, :, None], jnp.arange(32, dtype=jnp.int32)) & 1  # [R, W, 32]
    return bits.reshape(R, -1)[:, :vocab].astype(bool)


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits [R, V] with the tokens the bitmask forbids set to -1e30."""
    return jnp.where(allowed_tokens(bitmask, logits.shape[-1]), logits, _NEG)


def maybe_apply_bitmask(logits: jax.Array, bitmask: jax.Array | None) -> jax.Array:
    """`apply_bitmask` when some row is constrained (some word is not all ones); otherwise the
    logits untouched (one [R, W] compare, the cost of an unconstrained batch). On GPU always
    `apply_bitmask` (all-ones rows come back unchanged): XLA:GPU runs a conditional by copying
    its predicate to the host and blocking the stream, and the select costs one pass."""
    if bitmask is None:
        return logits
    if target_platform() == "gpu":
        return apply_bitmask(logits, bitmask)
    return jax.lax.cond(jnp.any(bitmask != -1), apply_bitmask, lambda x, _: x, logits, bitmask)
