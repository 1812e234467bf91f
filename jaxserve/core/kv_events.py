"""KV-cache events (vLLM's `--kv-events-config`): what the block pool tells an external indexer
(llm-d's KV-cache manager, a prefix-aware router) about the prefix cache, recorded on the host as
the pool changes and published by the engine after each step (`engine/kv_event_publisher.py`).

- `BlockStored`: blocks registered under their chained hashes (one event per contiguous run of
  one request's blocks: the hashes, the parent of the first (None for a sequence's first block),
  their token ids, the block size, the LoRA adapter keying the chain);
- `BlockRemoved`: hashes that left the cache (evicted, or unregistered because their K/V will not
  be written);
- `AllBlocksCleared`: `reset_prefix_cache`.

The host tier (`core/host_tier.py`) reports its blocks with medium "CPU", one hash per event and
no token ids, as vLLM's offloading connector does.

Replaying them in order rebuilds exactly the pool's set of cached hashes. Host side, no jax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MEDIUM_GPU = "GPU"      # vLLM's name for the device pool, whatever the device
MEDIUM_CPU = "CPU"      # and for the host tier (`--kv-offloading-size`)


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str = MEDIUM_GPU


@dataclass
class BlockRemoved:
    block_hashes: list[int] = field(default_factory=list)
    medium: str = MEDIUM_GPU


@dataclass
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """The events since the last `take()`, in order; consecutive removals share one event."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def stored(self, event: BlockStored) -> None:
        self.events.append(event)

    def removed(self, block_hash: int, medium: str = MEDIUM_GPU) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash], medium))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out
