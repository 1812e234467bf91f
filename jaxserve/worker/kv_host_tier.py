"""The host KV tier's memory and copies (`--kv-offloading-size`; the bookkeeping is
`core/host_tier.py`).

The tier is one host array per pool array (K, V and their scales), `[L, H, B, K, D]` beside the
pool's `[L, N, B, K, D]`, holding blocks exactly as stored (bf16, fp8 bit patterns, int8 and
scales alike). A step's copies run before its program, in dispatch order:

- offload: one jitted gather of the evicted blocks on the device (it reads them before anything
  of this step writes them), whose copy to the host starts at once (`copy_to_host_async`); the
  result lands in its host slots when the step's results are collected, so nothing waits on it;
- restore: the slots' rows taken from the host arrays, put on the devices split as the pool is
  (each tensor-parallel shard receives only its heads), and scattered into their blocks by a
  jitted program that donates the pool (in place).

Copies run in chunks of `CHUNKS` blocks (the last padded: gather reads block 0 and drops it,
scatter writes past the pool and is dropped), so ten small programs, compiled in the warm-up,
serve every step. The host arrays are numpy (pageable memory), allocated lazily by the OS as
slots are first written.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxserve.attention import kv_cache as kvc

CHUNKS = (1, 4, 16, 64, 256)


def chunks(n: int) -> list[tuple[int, int, int]]:
    """(start, count, padded size) covering n copies: full chunks of the largest size, then the
    rest padded to the smallest size that holds it."""
    out, start, top = [], 0, CHUNKS[-1]
    while n - start > top:
        out.append((start, top, top))
        start += top
    if n > start:
        out.append((start, n - start, next(c for c in CHUNKS if c >= n - start)))
    return out


def host_bytes_per_block(cache: kvc.KVCache) -> int:
    """Bytes one block costs across all layers, pool arrays and tensor-parallel shards."""
    return sum(x.size // x.shape[1] * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache))


class HostTierCopies:
    def __init__(self, cache: kvc.KVCache, shardings: kvc.KVCache, size_gib: float) -> None:
        self.block_bytes = host_bytes_per_block(cache)
        self.num_slots = int(size_gib * 2**30 // self.block_bytes)
        if self.num_slots < 1:
            raise ValueError(f"kv_offloading_size {size_gib} GiB holds no KV block "
                             f"({self.block_bytes} bytes each)")
        self.num_blocks = cache.num_blocks
        self.host = jax.tree.map(
            lambda x: np.zeros((x.shape[0], self.num_slots) + x.shape[2:], x.dtype), cache)
        self.shardings = shardings
        self._gather = jax.jit(lambda c, ids: jax.tree.map(lambda x: x[:, ids], c),
                               out_shardings=shardings)
        self._scatter = jax.jit(
            lambda c, ids, v: jax.tree.map(lambda x, y: x.at[:, ids].set(y, mode="drop"), c, v),
            out_shardings=shardings, donate_argnums=0)
        # Offloads whose data is on its way to the host: (step id, gathered blocks, slots).
        self._pending: list[tuple[int, kvc.KVCache, list[int]]] = []
        self.bytes_offloaded = 0
        self.bytes_restored = 0

    def apply(self, cache: kvc.KVCache, copies, step_id: int) -> kvc.KVCache:
        """Run one step's copies (`core.host_tier.HostCopies`) before its program; the new pool."""
        if copies.offload:
            ids, slots = zip(*copies.offload)
            for start, count, size in chunks(len(ids)):
                part = ids[start:start + count] + (0,) * (size - count)
                gathered = self._gather(cache, np.array(part, np.int32))
                for x in jax.tree_util.tree_leaves(gathered):
                    x.copy_to_host_async()
                self._pending.append((step_id, gathered, list(slots[start:start + count])))
            self.bytes_offloaded += len(ids) * self.block_bytes
        if copies.restore:
            self.land()         # a slot restored may be one still on its way (this step's, too)
            slots, ids = zip(*copies.restore)
            for start, count, size in chunks(len(ids)):
                rows = np.array(slots[start:start + count] + (slots[0],) * (size - count))
                values = self._rows(rows)
                part = ids[start:start + count] + (self.num_blocks,) * (size - count)
                cache = self._scatter(cache, np.array(part, np.int32), values)
            self.bytes_restored += len(ids) * self.block_bytes
        return cache

    def warmup(self, cache: kvc.KVCache) -> kvc.KVCache:
        """Build the copy programs of every chunk size (reads block 0, writes nothing)."""
        for size in CHUNKS:
            jax.block_until_ready(self._gather(cache, np.zeros(size, np.int32)))
            values = self._rows(np.zeros(size, np.int64))
            cache = self._scatter(cache, np.full(size, self.num_blocks, np.int32), values)
        return cache

    def _rows(self, slots: np.ndarray) -> kvc.KVCache:
        """Host slots' blocks (a copy) on the devices, split as the pool is."""
        return jax.device_put(jax.tree.map(lambda h: h[:, slots], self.host), self.shardings)

    def land(self, step_id: int | None = None) -> None:
        """Write the offloads of steps up to `step_id` (all: None) into their host slots."""
        keep = []
        for entry in self._pending:
            sid, gathered, slots = entry
            if step_id is not None and sid > step_id:
                keep.append(entry)
                continue
            data = jax.device_get(gathered)
            for h, x in zip(jax.tree_util.tree_leaves(self.host), jax.tree_util.tree_leaves(data)):
                h[:, slots] = x[:, :len(slots)]
        self._pending = keep
