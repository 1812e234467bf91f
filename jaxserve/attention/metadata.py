"""What one step's attention needs to know about the batch, as device arrays."""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    slot_mapping: jax.Array   # [T] int32, slot of each new token's K/V; N * B for padding
    block_tables: jax.Array   # [S, M] int32, block ids per sequence
    kv_lens: jax.Array        # [S] int32, tokens in the cache after this step; 0 for padding
    cu_q_lens: jax.Array      # [S + 1] int32, cumulative new-token counts
    num_seqs: jax.Array       # [1] int32, real sequences
    # [1] int32, this layer's sliding window (a query sees itself and window - 1 earlier tokens),
    # set per layer by models whose layers differ (Gemma 2/3; pallas.common.NO_WINDOW on global
    # layers); None: the attention call's static `sliding_window` (Mistral: every layer alike)
    sliding_window: jax.Array | None = None
