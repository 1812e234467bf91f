"""Block pool and KV cache manager: free queue order, prefix-cache hits, LRU eviction, reset."""

import pytest

from jaxserve.core.block_hash import builtin_hash as hash_block_tokens
from jaxserve.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request
from jaxserve.sampling_params import SamplingParams

BS = 16


def req(request_id, tokens, **params):
    return Request(request_id, list(tokens), SamplingParams(**params))


def admit(m, r, num_new=None):
    """What the scheduler does when it takes a request from waiting: lookup, allocate, compute."""
    hits, n = m.get_computed_blocks(r)
    num_new = r.num_tokens - n if num_new is None else num_new
    assert m.allocate_slots(r, num_new, hits) is not None
    r.num_computed_tokens = n + num_new
    return n


def test_free_queue_remove_from_middle_and_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q.blocks()] == [0, 1, 3, 4] and q.num_free_blocks == 4
    q.append(blocks[2])
    q.appendleft(q.popleft())
    assert [b.block_id for b in q.blocks()] == [0, 1, 3, 4, 2]
    with pytest.raises(ValueError):
        q.remove(KVCacheBlock(9))


def test_pool_hands_out_every_id_and_refuses_overdraw():
    pool = BlockPool(4)
    got = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in got) == [0, 1, 2, 3] and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(got)
    assert pool.get_num_free_blocks() == 4 and pool.usage == 0.0
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks(got[:1])


def test_hash_chain_is_deterministic_and_depends_on_parent():
    a = hash_block_tokens(1, list(range(16)))
    assert a == hash_block_tokens(1, list(range(16)))
    assert a != hash_block_tokens(2, list(range(16)))
    assert a != hash_block_tokens(1, list(range(1, 17)))


def test_shared_three_block_prefix_hits_48_tokens():
    m = KVCacheManager(num_blocks=16, block_size=BS)
    prefix = list(range(100, 148))
    a = req("a", prefix + [1, 2, 3])
    b = req("b", prefix + [7, 8])
    assert admit(m, a) == 0
    assert admit(m, b) == 48
    assert m.get_block_ids("b")[:3] == m.get_block_ids("a")[:3]
    assert m.block_pool.blocks[m.get_block_ids("a")[0]].ref_cnt == 2
    assert (m.prefix_cache_stats.queries, m.prefix_cache_stats.hits) == (51 + 50, 48)


def test_never_returns_the_whole_prompt():
    m = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(48))            # exactly three full blocks
    admit(m, req("a", prompt))
    hits, n = m.get_computed_blocks(req("b", prompt))
    assert n == 32 and len(hits) == 2   # the last block is recomputed for its logits


def test_only_full_blocks_of_known_tokens_are_hashed():
    m = KVCacheManager(num_blocks=16, block_size=BS)
    a = req("a", range(40))
    hits, _ = m.get_computed_blocks(a)
    m.allocate_slots(a, 20, hits, num_lookahead_tokens=30)   # chunk of 20, 30 slots of slack
    assert len(m.get_block_ids("a")) == 4
    assert [m.block_pool.blocks[i].block_hash is not None for i in m.get_block_ids("a")] == \
        [True, False, False, False]
    a.num_computed_tokens = 20
    m.allocate_slots(a, 20)
    assert len(m.block_pool.cached_block_hash_to_block) == 2


def test_same_step_request_hits_blocks_allocated_earlier_in_the_step():
    m = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(40))
    a, b = req("a", prompt), req("b", prompt)
    hits, _ = m.get_computed_blocks(a)
    m.allocate_slots(a, 40, hits)        # not computed yet: the step has not run
    assert admit(m, b) == 32


def test_freed_sequence_evicts_tail_first_and_lru_across_requests():
    m = KVCacheManager(num_blocks=6, block_size=4)
    a = req("a", range(12))      # 3 full blocks
    b = req("b", range(50, 58))  # 2 full blocks
    admit(m, a)
    admit(m, b)
    ids_a, ids_b = m.get_block_ids("a"), m.get_block_ids("b")
    m.free(a)
    m.free(b)
    queue = [blk.block_id for blk in m.block_pool.free_block_queue.blocks()]
    # the never-used block first, then a (freed first) tail-first, then b tail-first
    assert queue == [5] + ids_a[::-1] + ids_b[::-1]
    # a new request evicts in that order: the spare block, then a's last block
    c = req("c", range(200, 206))
    admit(m, c)
    assert m.get_block_ids("c") == [5, ids_a[2]]
    assert m.get_computed_blocks(req("a2", range(12)))[1] == 8   # a's first two blocks survive


def test_unhashed_blocks_are_reused_before_cached_ones():
    m = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", range(6))       # one full (cached) block + one partial block
    admit(m, a)
    full, partial = m.get_block_ids("a")
    m.free(a)
    queue = [blk.block_id for blk in m.block_pool.free_block_queue.blocks()]
    assert queue[0] == partial and queue[-1] == full


def test_cached_free_block_is_revived_from_the_middle_of_the_queue():
    m = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", range(9))
    admit(m, a)
    m.free(a)
    free_before = m.get_num_free_blocks()
    b = req("b", list(range(8)) + [99])
    assert admit(m, b) == 8
    assert m.get_num_free_blocks() == free_before - 3   # 2 revived + 1 new
    assert all(m.block_pool.blocks[i].ref_cnt == 1 for i in m.get_block_ids("b"))


def test_allocate_returns_none_and_changes_nothing_when_out_of_blocks():
    m = KVCacheManager(num_blocks=3, block_size=4)
    admit(m, req("a", range(8)))
    b = req("b", range(100, 108))
    assert m.allocate_slots(b, 8) is None
    assert m.get_block_ids("b") == [] and m.get_num_free_blocks() == 1


def test_free_hit_blocks_count_against_free_space():
    m = KVCacheManager(num_blocks=3, block_size=4)
    a = req("a", range(9))
    admit(m, a)
    m.free(a)                                   # 2 cached free blocks + 1 plain free block
    b = req("b", list(range(8)) + [1, 2, 3, 4, 5])
    hits, n = m.get_computed_blocks(b)
    assert n == 8
    assert m.allocate_slots(b, 5, hits) is None  # needs 2 new + 2 revived > 3
    assert m.get_num_free_blocks() == 3


def test_reset_prefix_cache_only_when_idle():
    m = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", range(9))
    admit(m, a)
    assert not m.reset_prefix_cache()
    m.free(a)
    assert m.reset_prefix_cache()
    assert m.get_computed_blocks(req("b", range(9)))[1] == 0
    assert m.block_pool.cached_block_hash_to_block == {}


def test_disabled_prefix_caching_never_hashes():
    m = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    admit(m, req("a", range(9)))
    assert admit(m, req("b", range(9))) == 0
    assert all(b.block_hash is None for b in m.block_pool.blocks)


def test_prompt_logprobs_requests_miss_blocks_without_cached_scores():
    m = KVCacheManager(num_blocks=8, block_size=4)
    admit(m, req("a", range(9)))
    assert admit(m, req("b", range(9), prompt_logprobs=1)) == 0


def test_dropped_row_unregisters_the_blocks_it_would_have_filled():
    m = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", range(7))
    admit(m, a)                                  # blocks 0 (full) and 1 (3 tokens)
    a.append_output_token(42)                    # position 7 will fill block 1 this step
    m.allocate_slots(a, 1)
    assert m.block_pool.blocks[m.get_block_ids("a")[1]].block_hash is not None
    m.uncache_uncomputed_blocks(a)               # the row is dropped before the step runs
    first, second = (m.block_pool.blocks[i] for i in m.get_block_ids("a"))
    assert first.block_hash is not None and second.block_hash is None
    m.free(a)
    assert m.get_computed_blocks(req("b", list(range(7)) + [42, 1]))[1] == 4
