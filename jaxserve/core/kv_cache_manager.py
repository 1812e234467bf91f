"""The KV cache manager: which blocks each request holds, and automatic prefix caching.

Host side, no jax (vLLM v1's `kv_cache_manager.py`). The scheduler talks to it through three calls:
`get_computed_blocks` (prefix-cache lookup for a request about to be scheduled from waiting),
`allocate_slots` (grow a request's block table for this step's tokens; None when out of blocks)
and `free` (drop a finished or preempted request's blocks).

Prefix caching hashes FULL blocks only, as a chain: hash_i = H(hash_{i-1}, tokens of block i), so a
hash names the whole prefix up to and including its block (`core/block_hash.py`: xxh3-128 over
fixed-width bytes by default, or vLLM's algorithms, `--prefix-caching-hash-algo`).

Requests asking for prompt logprobs hit a block only where its prompt-logprob entries are cached
too (`prompt_logprob_cache.py`): the entries of the blocks they compute are recorded after each
step, and evicting a block's hash drops them.

With a host tier (`num_host_blocks`, `core/host_tier.py`) a cached block the pool reuses is copied
to host memory first, and a request's prefix lookup continues there past the pool's hits: those
blocks get fresh device blocks that the step fills from the host before it runs, and count as
computed tokens like any hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.core.block_hash import BlockHasher
from jaxserve.core.block_pool import BlockPool, KVCacheBlock
from jaxserve.core.host_tier import HostCopies, HostKVTier
from jaxserve.core.kv_events import BlockStored, KVEventLog
from jaxserve.core.prompt_logprob_cache import Entry, PromptLogprobCache
from jaxserve.core.request import Request


@dataclass
class KVCacheBlocks:
    """A list of blocks crossing the scheduler / cache-manager border; `host_hashes`: the hashes
    of the blocks after them that the host tier holds (restored into new blocks on allocation)."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    host_hashes: list[int] = field(default_factory=list)

    def get_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks) + len(self.host_hashes)


@dataclass
class PrefixCacheStats:
    """Counted once per (re)admission from waiting: queries = prompt tokens looked up,
    hits = tokens found in the cache (the device pool; `host_hits`: those the host tier
    supplied, vLLM's external prefix-cache hits)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    host_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_algo: str = "builtin", num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.hasher = BlockHasher(hash_algo)
        self.enable_caching = enable_caching
        self.prompt_logprobs = PromptLogprobCache(block_size)
        self.block_pool = BlockPool(num_blocks, enable_caching, on_evict=self._evicted)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the hash map.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.host_tier: HostKVTier | None = None
        if num_host_blocks:
            if not enable_caching:
                raise ValueError("kv_offloading_size: the host KV tier keeps prefix-cache blocks; "
                                 "it needs enable_prefix_caching")
            self.host_tier = HostKVTier(num_host_blocks, block_size)
            self.block_pool.on_reuse = self.host_tier.offload
            self.host_tier.on_drop = self._left_host

    # A block's prompt-logprob entries live while either tier holds its hash.
    def _evicted(self, block_hash: int) -> None:
        if self.host_tier is None or block_hash not in self.host_tier:
            self.prompt_logprobs.drop(block_hash)

    def _left_host(self, block_hash: int) -> None:
        if self.block_pool.get_cached_block(block_hash) is None:
            self.prompt_logprobs.drop(block_hash)

    def record_events(self) -> KVEventLog:
        """KV-cache events from now on, of the device pool and the host tier."""
        log = self.block_pool.record_events()
        if self.host_tier is not None:
            self.host_tier.event_log = log
        return log

    def take_host_copies(self) -> HostCopies | None:
        """The copies the host tier needs before the step being scheduled (None: no tier)."""
        return None if self.host_tier is None else self.host_tier.take_copies()

    # --- queries ------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def _update_block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """Extend request.block_hashes to cover its first num_full_blocks full blocks."""
        hashes, bs, tokens = request.block_hashes, self.block_size, request.all_token_ids
        lora = getattr(request, "lora_request", None)
        lora_name = None if lora is None else lora.lora_name
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(self.hasher(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs], lora_name))
        return hashes

    def cached_prefix_blocks(self, token_ids: list[int], lora_name: str | None = None) -> int:
        """How many full blocks of a prompt's prefix the cache holds now (a data-parallel
        balancer's question, asked from another thread: lookups only). As a request would hit:
        never the block holding the last token; the host tier's blocks after the pool's count."""
        if not self.enable_caching:
            return 0
        bs, parent, n, tier = self.block_size, None, 0, self.host_tier
        on_host = False
        for i in range((len(token_ids) - 1) // bs):
            parent = self.hasher(parent, token_ids[i * bs:(i + 1) * bs], lora_name)
            on_host = on_host or self.block_pool.get_cached_block(parent) is None
            if on_host and (tier is None or parent not in tier):
                break
            n += 1
        return n

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of the request's tokens: (blocks, num_computed_tokens).

        Never covers every token: the last one is always recomputed so the step yields logits to
        sample from. A request asking for prompt_logprobs hits a block only while the block's
        prompt-logprob entries (with at least as many top logprobs) are cached or computed in
        this step (`_scores_cached`).
        Takes no references; pass the blocks to `allocate_slots` in the same step.
        """
        if not self.enable_caching:
            return KVCacheBlocks(), 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits, host, tier = [], [], self.host_tier
        for block_hash in self._update_block_hashes(request, max_blocks)[:max_blocks]:
            if not self._scores_cached(request, len(hits) + len(host)):
                break
            block = None if host else self.block_pool.get_cached_block(block_hash)
            if block is not None:
                hits.append(block)
            elif tier is not None and block_hash in tier:
                host.append(block_hash)
            else:
                break
        return KVCacheBlocks(hits, host), (len(hits) + len(host)) * self.block_size

    def _scores_cached(self, request: Request, j: int) -> bool:
        """Whether block j may be a hit for this request's prompt logprobs: it asks for none,
        or block j scores no prompt target, or the block's entries are cached / in flight."""
        k = request.sampling_params.prompt_logprobs
        bs = self.block_size
        if k is None or j * bs + 1 >= request.num_prompt_tokens:
            return True
        return self.prompt_logprobs.covers(request.block_hashes[j],
                                           request.all_token_ids[(j + 1) * bs], k)

    def cached_prompt_logprobs(self, request: Request,
                               num_blocks: int) -> list[tuple[int, Entry]] | None:
        """[(position, entry)] of the prompt positions 1 .. num_blocks * B (within the prompt)
        that the request's first num_blocks hit blocks cover, from the cache; None when entries
        it was admitted on never came (the step computing them failed, or its request was
        aborted before they were recorded)."""
        k, bs = request.sampling_params.prompt_logprobs, self.block_size
        out = []
        for j in range(num_blocks):
            if j * bs + 1 >= request.num_prompt_tokens:
                break
            entries = self.prompt_logprobs.get(request.block_hashes[j],
                                               request.all_token_ids[(j + 1) * bs], k)
            if entries is None:     # promised by a step that failed or a request aborted since
                return None
            out.extend((j * bs + 1 + i, e) for i, e in enumerate(entries)
                       if j * bs + 1 + i < request.num_prompt_tokens)
        return out

    def promise_prompt_logprobs(self, request: Request, start: int, end: int) -> None:
        """A scoring row computes positions [start, end) this step: the entries of the blocks
        whose last position it computes are in flight (hits for requests admitted after it)."""
        k, bs = request.sampling_params.prompt_logprobs, self.block_size
        if not self.enable_caching or k is None:
            return
        for j in range(start // bs, end // bs):
            if (j + 1) * bs >= request.num_prompt_tokens or j >= len(request.block_hashes):
                break
            if self.block_pool.get_cached_block(request.block_hashes[j]) is not None:
                self.prompt_logprobs.promise(request.block_hashes[j],
                                             request.all_token_ids[(j + 1) * bs], k)

    def record_prompt_logprobs(self, request: Request, entries: list[tuple[int, Entry]]) -> None:
        """Store the full blocks of prompt-logprob entries a step computed for the request."""
        k = request.sampling_params.prompt_logprobs
        if not self.enable_caching or k is None:
            return
        pool = self.block_pool.cached_block_hash_to_block
        self.prompt_logprobs.record(request.request_id, entries, request.block_hashes,
                                    request.all_token_ids, request.num_prompt_tokens, k,
                                    pool.__contains__)

    # --- mutations ----------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` tokens after the request's computed ones (plus
        `num_lookahead_tokens` of speculative slack); return the newly allocated blocks, or None
        (changing nothing) when the pool cannot supply them.

        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks` (only for a request
        with no blocks yet); they count as computed tokens and get a reference here. Its host-tier
        hits take the first new blocks, which the step fills from host memory.

        Hash registration rule: every block that will be full of KNOWN tokens once this step has
        run (min(computed + new, num_tokens)) is registered now. The runner writes all of a step's
        K/V before attention reads any of it, so a later request in the same step may hit it.
        """
        bs = self.block_size
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        if new_computed_blocks is None and req_blocks:
            # Most decode steps: the tokens fit the blocks held and no block fills up.
            end = request.num_computed_tokens + num_new_tokens
            if (-(-(end + num_lookahead_tokens) // bs) <= len(req_blocks)
                    and (not self.enable_caching
                         or min(end, request.num_tokens) // bs <= self.num_cached_blocks.get(request.request_id, 0))):
                return KVCacheBlocks([])
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else []
        host = new_computed_blocks.host_hashes if new_computed_blocks is not None else []
        if (hits or host) and req_blocks:
            raise ValueError("prefix-cache hits can only be added to a request with no blocks")
        num_computed = request.num_computed_tokens + (len(hits) + len(host)) * bs
        num_required = -(-(num_computed + num_new_tokens + num_lookahead_tokens) // bs)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(hits))
        # Free hits are in the free queue: touching them uses up free blocks too.
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_free_hits:
            return None

        if self.enable_caching and request.num_computed_tokens == 0 and not req_blocks:
            # First allocation since admission (fresh or preempted): record the lookup.
            self.prefix_cache_stats.requests += 1
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += len(hits) * bs
            self.prefix_cache_stats.host_hits += len(host) * bs
        self.block_pool.touch(hits)
        req_blocks = self.req_to_blocks.setdefault(request.request_id, req_blocks)
        req_blocks.extend(hits)
        slots = [self.host_tier.pin(h) for h in host]   # before the allocation may offload
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        for slot, block in zip(slots, new_blocks):
            self.host_tier.restore(slot, block.block_id)
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            num_cached = max(self.num_cached_blocks.get(request.request_id, 0), len(hits))
            num_full = min(num_computed + num_new_tokens, request.num_tokens) // bs
            hashes = self._update_block_hashes(request, num_full)
            stored = [i for i in range(num_cached, num_full)
                      if self.block_pool.cache_full_block(req_blocks[i], hashes[i])]
            if stored and self.block_pool.event_log is not None:
                self._log_stored(request, hashes, stored)
            self.num_cached_blocks[request.request_id] = max(num_cached, num_full)
        return KVCacheBlocks(new_blocks)

    def _log_stored(self, request: Request, hashes: list[int], stored: list[int]) -> None:
        """One BlockStored event per contiguous run of the request's newly registered blocks."""
        bs, tokens, lora = self.block_size, request.all_token_ids, request.lora_request
        runs, start = [], 0
        for j in range(1, len(stored) + 1):
            if j == len(stored) or stored[j] != stored[j - 1] + 1:
                runs.append(stored[start:j])
                start = j
        for run in runs:
            first, last = run[0], run[-1]
            self.block_pool.event_log.stored(BlockStored(
                [hashes[i] for i in run], hashes[first - 1] if first > 0 else None,
                list(tokens[first * bs:(last + 1) * bs]), bs,
                lora_id=None if lora is None else lora.lora_int_id,
                lora_name=None if lora is None else lora.lora_name))

    def uncache_uncomputed_blocks(self, request: Request, start_token: int | None = None) -> None:
        """Unregister the blocks this step's allocation hashed for the request, i.e. those at or
        past its first uncomputed token. Needed when a scheduled row is dropped from the step
        (priority preemption) or its step raised: its K/V will never be written, so the hashes
        would lie. Such a block can be shared only by a request admitted in the same step that
        took it as a prefix hit (a hit on a block hashed earlier in the step); that request's
        row is dropped or failed with it, so the hash goes whatever the block's ref count.
        start_token: the row's first position (default the request's first uncomputed token; async
        scheduling advances that when the row is scheduled)."""
        start_token = request.num_computed_tokens if start_token is None else start_token
        start = start_token // self.block_size
        blocks = self.req_to_blocks.get(request.request_id, [])
        for block in blocks[start:]:
            self.block_pool.uncache_block(block)
        if request.request_id in self.num_cached_blocks:
            self.num_cached_blocks[request.request_id] = min(
                self.num_cached_blocks[request.request_id], start)

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first so a sequence's tail is evicted before
        its (more shareable) head."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.prompt_logprobs.forget(request.request_id)
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False (nothing done) while blocks are in use. The hit/query
        counters are not reset: they feed monotonic Prometheus counters."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prompt_logprobs.clear()
        if self.host_tier is not None:
            self.host_tier.clear()
        return True
