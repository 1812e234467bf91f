"""`LayerMixWeight`: a stack of layers whose matrices are stored in different quantized layouts
(a GGUF Q4_K_M file keeps half of its `ffn_down` and `attn_v` layers in Q6_K, the rest in Q4_K).

Each layout keeps its own `Int4Weight` stack of the layers stored that way, so every layer stays in
its own bytes (no common layout wider than either). The layer scan hands the mix to its body whole
with `layer` set (`layers.scan.scan_layers`); `linear` picks the part holding that layer with a
`lax.switch` (on the CPU a branch taken on the host, no copy) and runs that part's kernel on the
layer in place, as it runs an unmixed stack's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.layers.int4 import Int4Weight
from jaxserve.layers.linear import linear, register_linear


@dataclasses.dataclass
class LayerMixWeight:
    """L stacked layers [L, in, out] held as parts, one `Int4Weight` stack per layout.

    parts: the stacks, [L_i, in, out] each (sum L_i = L).
    part_of: for each layer, the part holding it; index_in_part: its index in that part.
    layer: an int32 index (the scan's), or None: the whole stack (no matmul then).
    """

    parts: tuple[Int4Weight, ...]
    part_of: tuple[int, ...]
    index_in_part: tuple[int, ...]
    layer: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        inner = self.parts[0].shape[-2:]
        return inner if self.layer is not None else (len(self.part_of), *inner)

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


jax.tree_util.register_dataclass(LayerMixWeight, data_fields=["parts", "layer"],
                                 meta_fields=["part_of", "index_in_part"])


@register_linear(LayerMixWeight)
def mix_linear(x: jax.Array, w: LayerMixWeight, out_dtype=None) -> jax.Array:
    """x [..., in] @ layer `w.layer` [in, out] -> [..., out], by the kernel of the part holding it."""
    if w.layer is None:
        raise ValueError("a LayerMixWeight multiplies one layer at a time (its `layer` set by the layer scan)")
    which = jnp.asarray(w.part_of, jnp.int32)[w.layer]
    local = jnp.asarray(w.index_in_part, jnp.int32)[w.layer]
    dtype = out_dtype or x.dtype

    def branch(part):
        return lambda x, i: linear(x, dataclasses.replace(part, layer=i), out_dtype=dtype)
    return jax.lax.switch(which, [branch(p) for p in w.parts], x, local)
