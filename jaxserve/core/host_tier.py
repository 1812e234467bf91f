"""The host KV tier's bookkeeping (vLLM's native KV offloading, `--kv-offloading-size`): which
prefix-cache hashes live in which host slot, in LRU order. Host side, no jax; the copies are the
worker's (`worker/kv_host_tier.py`).

Write-back, not write-through: a cached block is copied to the host only when the device pool
hands it out to a new owner (`BlockPool.get_new_blocks` evicts it), so a block that stays on the
device costs no host bandwidth. A request whose prefix continues in the host tier past the device
pool's hits gets fresh device blocks, and the step copies the host slots into them before it runs
(`restore`). Both copies travel in the SchedulerOutput of the step that decided them
(`take_copies`); the worker issues them before that step's program, offloads first.

Slot reuse is safe without waiting on copies: the worker writes an offload's data into its slot
only after the step that decided it (the device -> host copy is collected later), and reads a
restore's slots when its step is dispatched, so a slot evicted and reused within one schedule is
read (old hash) before it is written (new hash). Slots restored in the schedule being built are
pinned against eviction until `take_copies`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from jaxserve.core.kv_events import MEDIUM_CPU, BlockStored, KVEventLog


@dataclass
class HostTierStats:
    """Counters since start, in blocks."""

    offloaded: int = 0      # device -> host copies
    restored: int = 0       # host -> device copies (prefix hits served from the host tier)
    evicted: int = 0        # host entries dropped for room


@dataclass
class HostCopies:
    """One step's copies: (device block, host slot) to offload, then (host slot, device block)
    to restore."""

    offload: list[tuple[int, int]] = field(default_factory=list)
    restore: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.offload or self.restore)


class HostKVTier:
    def __init__(self, num_slots: int, block_size: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        self.block_size = block_size
        self._lru: OrderedDict[int, int] = OrderedDict()    # hash -> slot; first = evicted next
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self._copies = HostCopies()
        self.stats = HostTierStats()
        self.event_log: KVEventLog | None = None
        # Called with a hash that leaves the tier (what is cached beside its K/V may go too).
        self.on_drop: Callable[[int], None] | None = None

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    @property
    def usage(self) -> float:
        return len(self._lru) / self.num_slots

    def hashes(self) -> set[int]:
        return set(self._lru)

    def lookup(self, block_hash: int) -> int | None:
        """The slot holding `block_hash`, or None (no LRU change: a lookup is not a use)."""
        return self._lru.get(block_hash)

    def offload(self, block_id: int, block_hash: int) -> None:
        """The device pool is reusing `block_id`, which held `block_hash`: keep a copy. Already
        held: it becomes the most recently used. No room (every slot pinned): not kept."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._lru[block_hash] = slot
        self._copies.offload.append((block_id, slot))
        self.stats.offloaded += 1
        if self.event_log is not None:
            self.event_log.stored(BlockStored([block_hash], None, [], self.block_size,
                                              medium=MEDIUM_CPU))

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        victim = next((h for h, slot in self._lru.items() if slot not in self._pinned), None)
        if victim is None:
            return None
        slot = self._lru.pop(victim)
        self.stats.evicted += 1
        self._dropped(victim)
        return slot

    def _dropped(self, block_hash: int) -> None:
        if self.on_drop is not None:
            self.on_drop(block_hash)
        if self.event_log is not None:
            self.event_log.removed(block_hash, MEDIUM_CPU)

    def pin(self, block_hash: int) -> int:
        """The slot of a hit about to be restored, kept from eviction until `take_copies`."""
        slot = self._lru[block_hash]
        self._lru.move_to_end(block_hash)
        self._pinned.add(slot)
        return slot

    def restore(self, slot: int, block_id: int) -> None:
        """Copy `slot` into device block `block_id` before this step."""
        self._copies.restore.append((slot, block_id))
        self.stats.restored += 1

    def take_copies(self) -> HostCopies:
        """This schedule's copies (the SchedulerOutput carries them); unpins its restores."""
        out, self._copies = self._copies, HostCopies()
        self._pinned.clear()
        return out

    def discard(self, slots: list[int]) -> None:
        """Forget the hashes of these slots (their copy may never have run: the step failed)."""
        gone = set(slots)
        for block_hash, slot in list(self._lru.items()):
            if slot in gone:
                del self._lru[block_hash]
                self._free.append(slot)
                self._dropped(block_hash)

    def clear(self) -> None:
        self._lru.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._pinned.clear()
