"""The KV block pool: ref counts, a free queue in eviction order, and the prefix-cache hash map.

Host side, no jax (vLLM v1's `block_pool.py`). Block ids 0..num_blocks-1 are all usable.

A block is in exactly one of two states:
- in use: ref_cnt > 0, not in the free queue;
- free: ref_cnt == 0, in the free queue. A free block may still carry a `block_hash`; then it is
  an evictable prefix-cache entry that `touch` revives (O(1) removal from the middle of the queue).
New blocks are taken from the head of the queue, so the head is the next eviction victim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from jaxserve.core.kv_events import KVEventLog


class KVCacheBlock:
    """One KV block: its id, how many requests use it, and its prefix-cache hash (None when not
    full or not cached). prev_free/next_free link it into the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, " \
               f"block_hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks; head = evicted first. All operations are O(1) except
    `blocks()`, which is for tests and debugging."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)   # sentinels keep the link code branch-free
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def _link_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        nxt = prev.next_free
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        """Add at the tail: evicted last."""
        self._link_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Add at the head: evicted first."""
        self._link_after(self._head, block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def blocks(self) -> list[KVCacheBlock]:
        out, cur = [], self._head.next_free
        while cur is not self._tail:
            out.append(cur)
            cur = cur.next_free
        return out


class BlockPool:
    """All KV blocks, the free queue and the hash -> block map of cached full blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 on_evict: Callable[[int], None] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # One block per hash: when two requests fill identical blocks concurrently, the second
        # stays unhashed and is simply freed later.
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}
        # Called with a hash when it leaves the map: what is cached beside the KV goes with it.
        self.on_evict = on_evict
        # KV-cache events (`core/kv_events.py`), recorded only when asked for (`record_events`).
        self.event_log: KVEventLog | None = None
        # Called with (block_id, hash) when a cached block is handed to a new owner (its K/V is
        # about to be overwritten; not when a hash is dropped because its K/V never came): the
        # host KV tier copies it out (`core/host_tier.py`).
        self.on_reuse: Callable[[int, int], None] | None = None

    def record_events(self) -> KVEventLog:
        """Record KV-cache events from now on (the cache is empty when an engine asks)."""
        if self.event_log is None:
            self.event_log = KVEventLog()
        return self.event_log

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0); evictable cached blocks count as free."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_block(self, block: KVCacheBlock, block_hash: int) -> bool:
        """Register a block whose tokens are all known as the holder of `block_hash`; False when
        it was not (caching off, the block already hashed, or another block holds the hash)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free queue (evicting their cache entries), ref 1."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool "
                             f"({self.get_num_free_blocks()} free)")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if self.on_reuse is not None and block.block_hash is not None \
                    and self.cached_block_hash_to_block.get(block.block_hash) is block:
                self.on_reuse(block.block_id, block.block_hash)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget a block's hash (its contents will not be what the hash promises)."""
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block.block_hash)
                if self.event_log is not None:
                    self.event_log.removed(block.block_hash)
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to prefix-cache hits; a free hit leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in eviction order (first freed, first evicted).

        Cached blocks go to the tail (LRU). Blocks without a hash hold nothing reusable, so they
        go to the head and are handed out before any cached block is evicted.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (returns False) while any block is in use, because
        running requests still expect their registered blocks to stay registered (as in vLLM)."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.event_log is not None:
            self.event_log.cleared()
        return True
