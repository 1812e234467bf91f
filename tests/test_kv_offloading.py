"""The host KV tier (`--kv-offloading-size`): prefix-cache blocks the device pool evicts are
copied to host memory and restored on a later hit instead of recomputed.

- bookkeeping (`core/host_tier.py`, `KVCacheManager`): evict -> offload -> hit -> restore, LRU,
  pinning, a failed step's copies forgotten, no block leaked in either tier;
- the engine on the tiny model in f32: a prefix restored from the host gives bit-identical greedy
  tokens and prompt logprobs to the same prefix hit in a device pool large enough to keep it
  (same hits, same programs: only where the K/V came from differs), and the same greedy tokens
  as no caching at all; a randomized multi-turn run under chunked prefill, preemption and TP 2
  against no caching, with both tiers whole at the end;
- the flags, refusals, metrics and KV events (medium "CPU").
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxserve.core.host_tier import HostKVTier
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
from jaxserve.core.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams

TINY = str(Path(__file__).resolve().parent / "data" / "tiny-llama")


def _request(rid: str, tokens: list[int], **params) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4, **params))


def _admit(m: KVCacheManager, req: Request) -> int:
    hits, n = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens - n, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return n


def _whole(m: KVCacheManager) -> None:
    """Nothing held: every device block free, every host slot free or holding one hash."""
    pool, tier = m.block_pool, m.host_tier
    assert pool.get_num_free_blocks() == pool.num_blocks and not m.req_to_blocks
    slots = list(tier._lru.values()) + tier._free
    assert sorted(slots) == list(range(tier.num_slots))


# -- bookkeeping ------------------------------------------------------------------------------
def test_evicted_blocks_go_to_the_host_and_come_back_on_a_hit():
    m = KVCacheManager(num_blocks=4, block_size=4, num_host_blocks=8)
    a = _request("a", range(1, 14))             # 3 full blocks + 1 token
    assert _admit(m, a) == 0
    assert not m.take_host_copies()
    m.free(a)
    b = _request("b", range(100, 113))          # reuses all 4 blocks: a's 3 cached ones go out
    _admit(m, b)
    copies = m.take_host_copies()
    assert len(copies.offload) == 3 and not copies.restore
    assert {slot for _, slot in copies.offload} == {m.host_tier.lookup(h) for h in a.block_hashes}
    m.free(b)
    a2 = _request("a2", range(1, 14))
    assert _admit(m, a2) == 12                   # all 3 blocks from the host tier
    copies = m.take_host_copies()
    assert [slot for slot, _ in copies.restore] == [m.host_tier.lookup(h) for h in a2.block_hashes]
    assert [blk for _, blk in copies.restore] == m.get_block_ids("a2")[:3]
    # the restored blocks are registered again: a third request hits them on the device
    assert all(m.block_pool.get_cached_block(h) is not None for h in a2.block_hashes)
    assert m.prefix_cache_stats.host_hits == 12 and m.prefix_cache_stats.hits == 0
    m.free(a2)
    a3 = _request("a3", range(1, 14))
    assert _admit(m, a3) == 12 and not m.take_host_copies().restore
    assert m.prefix_cache_stats.hits == 12
    m.free(a3)
    _whole(m)


def test_the_device_hit_is_taken_first_and_the_host_continues_it():
    m = KVCacheManager(num_blocks=6, block_size=2, num_host_blocks=8)
    a = _request("a", range(1, 10))      # 4 full blocks
    _admit(m, a)
    m.free(a)        # free queue: a's partial block, the unused one, then a's full ones, last first
    b = _request("b", [50, 51, 52, 53, 54])  # takes 3 blocks: the last is a's 4th full one
    _admit(m, b)
    assert len(m.take_host_copies().offload) == 1
    m.free(b)
    a2 = _request("a2", range(1, 10))
    hits, n = m.get_computed_blocks(a2)
    assert n == 8 and len(hits.blocks) == 3 and len(hits.host_hashes) == 1
    m.allocate_slots(a2, 1, hits)
    assert len(m.take_host_copies().restore) == 1


def test_lru_eviction_pinning_and_events():
    tier = HostKVTier(num_slots=2, block_size=4)
    log = tier.event_log = __import__("jaxserve.core.kv_events", fromlist=["KVEventLog"]).KVEventLog()
    tier.offload(0, 11)
    tier.offload(1, 22)
    tier.offload(2, 11)          # already held: becomes most recent, no copy
    assert len(tier.take_copies().offload) == 2
    slot22 = tier.pin(22)        # a restore in this schedule pins 22 ...
    tier.restore(slot22, 3)
    tier.offload(4, 33)          # ... so 11 goes, though 22 is older
    assert 11 not in tier and 22 in tier and 33 in tier
    tier.pin(22), tier.pin(33)
    tier.offload(5, 44)          # every slot pinned: not kept
    assert 44 not in tier
    copies = tier.take_copies()
    assert copies.restore == [(slot22, 3)] and [b for b, _ in copies.offload] == [4]
    events = log.take()
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved, BlockStored]
    assert all(e.medium == MEDIUM_CPU for e in events)
    assert events[2].block_hashes == [11] and events[0].token_ids == []
    assert tier.stats.offloaded == 3 and tier.stats.evicted == 1 and tier.stats.restored == 1


def test_a_failed_steps_copies_are_forgotten():
    from jaxserve.config import CacheConfig, SchedulerConfig
    from jaxserve.core.scheduler import Scheduler
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                  CacheConfig(block_size=4, num_blocks=5, num_host_blocks=8))
    m = s.kv_cache_manager
    s.add_request(_request("a", range(1, 14)))
    out = s.schedule()
    s.update_from_output(out, _sampled(out))
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    s.add_request(_request("b", range(100, 113)))
    out = s.schedule()                           # evicts two of a's full blocks to the host
    assert len(out.host_copies.offload) == 2
    s.update_from_output(out, _sampled(out))
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    s.add_request(_request("a2", range(1, 14)))
    out = s.schedule()                           # a device hit, then the host restores 2
    assert len(out.host_copies.restore) == 2
    restored = [blk for _, blk in out.host_copies.restore]
    s.fail_step(out)
    # the restored blocks' hashes are gone (their copy may not have run) ...
    assert all(m.block_pool.blocks[b].block_hash is None for b in restored)
    # ... and a step that failed after offloading leaves no host entry behind
    s.add_request(_request("c", range(200, 213)))
    out = s.schedule()
    offloaded = [slot for _, slot in out.host_copies.offload] if out.host_copies else []
    s.fail_step(out)
    assert all(slot not in m.host_tier._lru.values() for slot in offloaded)
    _whole(m)


def _sampled(out):
    return {r.request_id: [7] for r in out.scheduled if r.sample}


def test_reset_prefix_cache_empties_the_host_tier_too():
    m = KVCacheManager(num_blocks=4, block_size=4, num_host_blocks=8)
    a = _request("a", range(1, 14))
    _admit(m, a)
    m.free(a)
    b = _request("b", range(100, 113))
    _admit(m, b)
    m.free(b)
    assert len(m.host_tier) == 3
    assert m.reset_prefix_cache()
    assert len(m.host_tier) == 0
    _whole(m)


def test_prompt_logprob_entries_live_while_the_host_tier_holds_the_block():
    m = KVCacheManager(num_blocks=4, block_size=4, num_host_blocks=1)
    a = _request("a", range(1, 10), prompt_logprobs=1)     # 2 full blocks
    _admit(m, a)
    entries = [(pos, (a.all_token_ids[pos], -1.0, 1, [0], [-1.0])) for pos in range(1, 9)]
    m.record_prompt_logprobs(a, entries)
    assert len(m.prompt_logprobs) == 2
    m.free(a)
    b = _request("b", range(100, 113))
    _admit(m, b)          # a's two blocks are reused; the one-slot tier keeps the second only
    assert len(m.host_tier) == 1 and len(m.prompt_logprobs) == 1


# -- flags and refusals -------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_offloading_size=0), "kv_offloading_size must be > 0"),
    (dict(kv_offloading_size=1, enable_prefix_caching=False), "needs prefix caching"),
    (dict(kv_offloading_backend="lmcache", kv_offloading_size=1), "kv_offloading_backend must be 'native'"),
    (dict(kv_offloading_backend="native"), "kv_offloading_backend needs kv_offloading_size"),
    (dict(kv_offloading_size=1, nnodes=2), "nnodes > 1"),
    (dict(kv_offloading_size=1, speculative_config={"model": TINY, "num_speculative_tokens": 2}),
     "speculative method 'draft_model'"),
    (dict(kv_offloading_size=1, speculative_config={"method": "eagle3", "model": TINY}),
     "speculative method 'eagle3'"),
])
def test_bad_offloading_settings_name_the_field(kwargs, match):
    from jaxserve.config import EngineArgs
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kwargs)


def test_the_flags_parse_as_vllms():
    from server.cli.main import build_parser
    args = build_parser().parse_args(["serve", "m", "--kv-offloading-size", "2.5",
                                      "--kv-offloading-backend", "native"])
    assert args.kv_offloading_size == 2.5 and args.kv_offloading_backend == "native"


# -- the engine ---------------------------------------------------------------------------------
def _engine(**kw):
    from jaxserve import LLM
    base = dict(model=TINY, load_format="dummy", max_model_len=256, block_size=4, dtype="float32",
                max_num_seqs=4, max_num_batched_tokens=64, warmup=False, compilation_cache_dir="",
                program_cache_dir="")
    return LLM(**(base | kw))


def _turns(llm, convs, params):
    out = []
    for conv in convs:
        o = llm.generate([{"prompt_token_ids": conv}], params, use_tqdm=False)[0]
        out.append((o.outputs[0].token_ids, o.num_cached_tokens,
                    [None if e is None else {t: lp.logprob for t, lp in e.items()}
                     for e in o.prompt_logprobs]))
    return out


def test_a_prefix_restored_from_the_host_equals_one_kept_on_the_device():
    rng = random.Random(0)
    convs = [[rng.randrange(3, 1000) for _ in range(41)] for _ in range(6)]
    # round 2 resends each conversation with a new turn: 10 full blocks of each are hits
    work = convs + [c + [5, 6, 7] for c in convs]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    runs = {}
    for name, kw in (("host", dict(num_gpu_blocks_override=24, kv_offloading_size=0.001)),
                     ("device", dict(num_gpu_blocks_override=400)),
                     ("none", dict(num_gpu_blocks_override=24, enable_prefix_caching=False))):
        with _engine(**kw) as llm:
            runs[name] = _turns(llm, work, params)
            stats = llm.llm_engine.stats()
            if name == "host":
                m = llm.llm_engine.scheduler.kv_cache_manager
                assert stats.external_prefix_cache_hits == 6 * 40 and stats.prefix_cache_hits == 0
                assert stats.kv_offload_bytes_to_device == 60 * llm.llm_engine.runner.host_tier.block_bytes
                assert stats.kv_offload_bytes_to_host > 0 and 0 < stats.kv_offload_host_usage <= 1
                _whole(m)
            if name == "device":
                assert stats.prefix_cache_hits == 6 * 40
    assert [r[1] for r in runs["host"]] == [0] * 6 + [40] * 6
    # restored K/V is the K/V computed: identical to the device hit, bit for bit
    assert runs["host"] == runs["device"]
    assert [r[0] for r in runs["host"]] == [r[0] for r in runs["none"]]


# Runs in a child with 2 simulated devices: multi-turn conversations that outgrow a small pool,
# several at a time (preemption), in 16-token chunks, on 1 and 2 devices, against no caching.
_CHILD = textwrap.dedent("""
    import json, random, sys
    from jaxserve import LLM, SamplingParams
    TINY, = sys.argv[1:]
    def run(**kw):
        rng = random.Random(1)
        convs = [[rng.randrange(3, 1000) for _ in range(rng.randrange(20, 60))] for _ in range(8)]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        out = []
        with LLM(model=TINY, load_format="dummy", max_model_len=256, block_size=4, dtype="float32",
                 max_num_seqs=4, max_num_batched_tokens=16, num_gpu_blocks_override=48,
                 warmup=False, compilation_cache_dir="", program_cache_dir="", **kw) as llm:
            for turn in range(3):
                batch = rng.sample(range(8), 6)
                outs = llm.generate([{"prompt_token_ids": convs[i]} for i in batch], params,
                                    use_tqdm=False)
                for i, o in zip(batch, outs):
                    out.append(o.outputs[0].token_ids)
                    convs[i] = convs[i] + o.outputs[0].token_ids + [rng.randrange(3, 1000) for _ in range(5)]
            e = llm.llm_engine
            m, s = e.scheduler.kv_cache_manager, e.stats()
            whole = m.block_pool.get_num_free_blocks() == m.block_pool.num_blocks
            if m.host_tier is not None:
                t = m.host_tier
                whole = whole and sorted(list(t._lru.values()) + t._free) == list(range(t.num_slots))
            return dict(tokens=out, whole=whole, preemptions=s.num_preemptions_total,
                        host_hits=s.external_prefix_cache_hits, restored=s.kv_offload_bytes_to_device)
    runs = dict(none=run(enable_prefix_caching=False), host=run(kv_offloading_size=0.001),
                host_tp2=run(kv_offloading_size=0.001, tensor_parallel_size=2))
    print("RESULT" + json.dumps(runs))
""")


@pytest.mark.slow
def test_randomized_multi_turn_under_chunking_preemption_and_tp2():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _CHILD, TINY], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(proc.stdout.split("RESULT", 1)[1])
    for name in ("host", "host_tp2"):
        r = runs[name]
        assert r["tokens"] == runs["none"]["tokens"], name
        assert r["whole"] and r["host_hits"] > 0 and r["restored"] > 0, (name, r)
        assert r["preemptions"] > 0, "the pool was meant to force preemption"


# -- the copies (worker side) -------------------------------------------------------------------
def test_chunks_cover_every_copy_with_a_few_sizes():
    from jaxserve.worker.kv_host_tier import CHUNKS, chunks
    for n in range(1, 700):
        parts = chunks(n)
        assert sum(c for _, c, _ in parts) == n and all(size in CHUNKS and c <= size for _, c, size in parts)
        assert [s for s, _, _ in parts] == [sum(c for _, c, _ in parts[:i]) for i in range(len(parts))]


@pytest.mark.parametrize("kv_dtype, quantized", [("float32", False), ("float8_e4m3fn", True)])
def test_blocks_round_trip_through_host_memory_exactly_without_compiling(kv_dtype, quantized):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.attention import kv_cache as kvc
    from jaxserve.core.host_tier import HostCopies
    from jaxserve.worker.kv_host_tier import HostTierCopies, host_bytes_per_block
    cache = kvc.allocate(2, 600, 4, 2, 8, jnp.dtype(kv_dtype), quantized=quantized,
                         fp8_as_bytes=quantized)
    rng = np.random.default_rng(0)
    cache = jax.tree.map(lambda x: jnp.asarray(rng.integers(0, 200, x.shape).astype(x.dtype)), cache)
    original = jax.device_get(cache)
    sharding = jax.tree.map(lambda x: x.sharding, cache)
    copies = HostTierCopies(cache, sharding, 301 * host_bytes_per_block(cache) / 2**30)
    assert copies.num_slots == 301
    cache = copies.warmup(cache)
    programs = (copies._gather._cache_size(), copies._scatter._cache_size())
    # blocks 0..299 out to slots 300..1 reversed, then back into blocks 300..599
    n = 300
    cache = copies.apply(cache, HostCopies(offload=[(b, n - b) for b in range(n)]), step_id=1)
    copies.land(1)
    cache = copies.apply(cache, HostCopies(restore=[(n - b, n + b) for b in range(n)]), step_id=2)
    got = jax.device_get(cache)
    for a, b in zip(jax.tree_util.tree_leaves(original), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(b[:, n:], a[:, :n])        # copied exactly
        np.testing.assert_array_equal(b[:, :n], a[:, :n])        # the sources untouched
    assert (copies._gather._cache_size(), copies._scatter._cache_size()) == programs
    assert copies.bytes_offloaded == copies.bytes_restored == n * copies.block_bytes
