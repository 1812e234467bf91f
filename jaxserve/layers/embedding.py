"""The token embedding table, dense or kept quantized, and its use as the tied lm_head.

A table is a plain array [V, E], or an `Int4Weight` [E, V] (a GGUF Q8_0/Q4_0/Q4_1 table kept
quantized, loader/gguf_quant.py): stored as the tied head's [in, out] matrix, so one quantized
copy serves both the lookup (columns gathered, then dequantized: only the looked-up rows ever
exist in full precision) and the logits (`linear`'s tiled int4/int8 matmul).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.layers.int4 import Int4Weight, dequantize, plain_scales
from jaxserve.layers.int4_layout import take_columns
from jaxserve.layers.linear import linear


def num_rows(table) -> int:
    """V: the vocabulary rows this (possibly per-device) table holds."""
    return table.shape[-1] if isinstance(table, Int4Weight) else table.shape[0]


def embed_rows(table, ids: jax.Array) -> jax.Array:
    """table, ids [T] (in range) -> [T, E]: f32 for a quantized table, else the table's dtype."""
    if not isinstance(table, Int4Weight):
        return table[ids]

    c = plain_scales(take_columns(table, ids))
    w = dequantize(c.q, c.scale, c.zero, c.group_size, offset=c.offset, bits=c.bits,
                   zero_point=c.zero_point)                                  # [E, T]
    return w.T


def tied_logits(hidden: jax.Array, table) -> jax.Array:
    """hidden [R, E] @ the table's transpose -> logits [R, V] in f32 (the tied lm_head)."""
    if isinstance(table, Int4Weight):
        return linear(hidden, table, out_dtype=jnp.float32)
    return jnp.einsum("re,ve->rv", hidden, table, preferred_element_type=jnp.float32)
