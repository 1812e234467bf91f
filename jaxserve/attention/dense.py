"""Paged attention that reverse-mode autodiff can go through: the training path.

The reference path (`reference.py`) loops with dynamic trip counts (`fori_loop` bounds read from
the batch), which JAX cannot differentiate. Here every sequence's whole context is gathered from
its block table at once and each query scores the contexts of all S sequences in one einsum, the
other sequences masked out: fixed shapes, no loops, so `jax.grad` works. The cost grows with
S * M * B per token, so it suits training batches of short sequences (`jaxserve/training`), not
serving. Same arguments and result as `ragged_paged_attention_ref`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.pallas.common import layer_window, token_layout


def dense_paged_attention(q, k_pages, v_pages, meta: AttentionMetadata, *, sm_scale: float,
                          sliding_window: int | None = None, soft_cap: float | None = None,
                          k_scale=None, v_scale=None):
    """q [T, H, D]; k_pages, v_pages [R, B, K, D]; scales [R, B, K] or None -> [T, H, D]."""
    T, H, D = q.shape
    B, K = k_pages.shape[1], k_pages.shape[2]
    S, M = meta.block_tables.shape
    window = layer_window(meta, sliding_window)
    seq, pos, real = token_layout(meta, T)

    def context(pages, scale):       # [S, C = M * B, K, D]: each sequence's cache positions
        g = pages[meta.block_tables].astype(jnp.float32)                  # [S, M, B, K, D]
        if scale is not None:
            g = g * scale[meta.block_tables][..., None]
        return g.reshape(S, M * B, K, D)

    k, v = context(k_pages, k_scale), context(v_pages, v_scale)
    qf = (q.astype(jnp.float32) * sm_scale).reshape(T, K, H // K, D)
    s = jnp.einsum("tkgd,sckd->tkgsc", qf, k)                              # [T, K, G, S, C]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    kpos = jnp.arange(M * B, dtype=jnp.int32)
    mask = ((jnp.arange(S, dtype=jnp.int32)[None, :, None] == seq[:, None, None])
            & (kpos[None, None, :] <= pos[:, None, None]) & real[:, None, None])   # [T, S, C]
    if window is not None:
        mask &= kpos[None, None, :] > pos[:, None, None] - window
    mask = mask[:, None, None]
    s = jnp.where(mask, s, -jnp.inf).reshape(T, K, H // K, S * M * B)
    # a padding token masks everything: softmax over -inf is nan, so give it zeros instead
    p = jax.nn.softmax(jnp.where(real[:, None, None, None], s, 0.0), axis=-1)
    p = jnp.where(mask.reshape(T, 1, 1, S * M * B), p, 0.0).reshape(T, K, H // K, S, M * B)
    out = jnp.einsum("tkgsc,sckd->tkgd", p, v)
    return out.reshape(T, H, D).astype(q.dtype)
