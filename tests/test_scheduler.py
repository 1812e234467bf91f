"""Scheduler driven by a fake runner that keeps a fake paged KV cache.

The fake cache stores, at every slot, the token whose K/V would be there. The fake runner writes
all rows of a step first, then reads every row's whole context back through its block table and
asserts it equals the request's tokens; the next token is a hash of what it read. So wrong block
tables or bad prefix-cache hits show up as assertion failures or different tokens.
"""

import random
import zlib

import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.sampling_params import SamplingParams

VOCAB = 50


def next_token(tokens):
    return zlib.crc32(repr(list(tokens)).encode()) % VOCAB


def reference_output(prompt, max_tokens, max_model_len):
    tokens, out = list(prompt), []
    while len(out) < max_tokens and len(tokens) < max_model_len:
        tok = next_token(tokens)
        tokens.append(tok)
        out.append(tok)
    return out


class FakeRunner:
    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.bs = sched.block_size
        self.cache = [None] * (sched.kv_cache_manager.num_blocks * self.bs)

    def slot(self, block_ids, pos):
        return block_ids[pos // self.bs] * self.bs + pos % self.bs

    def execute(self, out):
        for row in out.scheduled:   # every K/V write of the step happens before any read
            for i, tok in enumerate(row.token_ids):
                self.cache[self.slot(row.block_ids, row.num_computed_tokens + i)] = tok
        sampled = {}
        for row in out.scheduled:
            request = self.sched.requests[row.request_id]
            end = row.num_computed_tokens + len(row.token_ids)
            assert len(row.block_ids) * self.bs >= end + row.num_lookahead_tokens
            context = [self.cache[self.slot(row.block_ids, p)] for p in range(end)]
            assert context == request.all_token_ids[:end], row.request_id
            if row.sample:
                sampled[row.request_id] = [next_token(context)]
        return sampled


def make(num_blocks=64, block_size=4, budget=64, max_model_len=128, max_num_seqs=16,
         policy="fcfs", chunked=True, caching=True, spec=0, async_scheduling=False):
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                      max_model_len=max_model_len, policy=policy,
                                      enable_chunked_prefill=chunked,
                                      num_speculative_tokens=spec, async_scheduling=async_scheduling),
                      CacheConfig(block_size=block_size, enable_prefix_caching=caching),
                      num_blocks=num_blocks)
    return sched, FakeRunner(sched)


def add(sched, rid, prompt, priority=0, arrival=None, **params):
    r = Request(rid, prompt, SamplingParams(**params), arrival_time=arrival, priority=priority,
                max_model_len=sched.config.max_model_len)
    sched.add_request(r)
    return r


def step(sched, runner):
    out = sched.schedule()
    return out, sched.update_from_output(out, runner.execute(out))


def run_all(sched, runner, max_steps=10_000):
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        outs.append(step(sched, runner)[0])
    raise AssertionError("did not finish")


def check_pool_invariants(sched):
    pool = sched.kv_cache_manager.block_pool
    in_use = [b for b in pool.blocks if b.ref_cnt > 0]
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    assert pool.get_num_free_blocks() + len(in_use) == pool.num_blocks
    assert {b.block_id for b in pool.free_block_queue.blocks()} == \
        {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    held = {}
    for blocks in sched.kv_cache_manager.req_to_blocks.values():
        for b in blocks:
            held[b.block_id] = held.get(b.block_id, 0) + 1
    assert held == {b.block_id: b.ref_cnt for b in in_use}
    for h, b in pool.cached_block_hash_to_block.items():
        assert b.block_hash == h
    assert set(sched.kv_cache_manager.req_to_blocks) <= {r.request_id for r in sched.running}


def add_random(sched, rng, prefixes, live, expected, rid):
    """Add a random request; its prompt shares a prefix with a fixed prompt or with the live
    tokens (outputs included) of another request, so prefix hits land on blocks filled by
    decodes too. `expected[rid]`: its deterministic output (max_model_len 64)."""
    source = rng.choice(prefixes) if rng.random() < 0.5 or not live else \
        rng.choice(list(live.values())).all_token_ids
    prompt = source[:rng.randrange(1, 40)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 24))]
    prompt = prompt[:40] or [1]
    max_tokens = rng.randrange(1, 24)
    live[rid] = add(sched, rid, prompt, priority=rng.randrange(3), max_tokens=max_tokens)
    expected[rid] = reference_output(prompt, max_tokens, 64)


@pytest.mark.parametrize("policy,caching,spec,chunked", [
    ("fcfs", True, 0, True), ("fcfs", False, 0, True), ("priority", True, 0, True),
    ("fcfs", True, 2, True), ("priority", True, 1, False), ("priority", True, 0, True), ("priority", True, 2, True)])
@pytest.mark.parametrize("seed", range(int(__import__("os").environ.get("SEEDS", 3))))
def test_random_add_step_abort_never_leaks_blocks(policy, caching, spec, chunked, seed):
    rng = random.Random(f"{policy}{caching}{spec}{chunked}{seed}")
    sched, runner = make(num_blocks=24, block_size=4, budget=48 if chunked else 64,
                         max_model_len=64, max_num_seqs=6, policy=policy, caching=caching,
                         spec=spec, chunked=chunked)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    live, expected, finished, next_id, preemptions_seen = {}, {}, {}, 0, 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.25 and len(live) < 20:
            add_random(sched, rng, prefixes, live, expected, f"r{next_id}")
            next_id += 1
        elif op < 0.30 and live:
            rid = rng.choice(sorted(live))
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            r = live.pop(rid)
            assert r.status == RequestStatus.FINISHED_ABORTED
            assert r.output_token_ids == expected[rid][:r.num_output_tokens]
            assert rid not in sched.kv_cache_manager.req_to_blocks
        else:
            out, changed = step(sched, runner)
            assert out.num_scheduled_tokens <= sched.config.max_num_batched_tokens
            assert len(sched.running) <= sched.config.max_num_seqs
            preemptions_seen += len(out.preempted_request_ids)
            for r in changed:
                if r.is_finished():
                    finished[r.request_id] = live.pop(r.request_id)
        check_pool_invariants(sched)
    for rid in list(live):
        if rng.random() < 0.5:
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            live.pop(rid)
    preemptions_seen += sum(len(o.preempted_request_ids) for o in run_all(sched, runner))
    finished.update(live)
    check_pool_invariants(sched)
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert sched.kv_cache_manager.req_to_blocks == {} and sched.num_running == 0
    assert sched.num_waiting == 0
    for rid, r in finished.items():   # with a deterministic runner the schedule is invisible
        assert r.output_token_ids == expected[rid], rid
    assert sched.num_preemptions_total == preemptions_seen > 0
    assert (sched.prefix_cache_stats.hits > 0) == caching


def test_prefix_hit_counted_as_num_cached_tokens():
    sched, runner = make(block_size=16, budget=256, max_model_len=256)
    prefix = list(range(48))
    a = add(sched, "a", prefix + [1, 2, 3, 4], max_tokens=2)
    run_all(sched, runner)
    b = add(sched, "b", prefix + [5, 6], max_tokens=2)
    out, _ = step(sched, runner)
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 48
    assert out.scheduled[0].num_computed_tokens == 48 and len(out.scheduled[0].token_ids) == 2
    assert sched.prefix_cache_stats.hits == 48
    assert sched.prefix_cache_stats.queries == 52 + 50
    run_all(sched, runner)
    assert b.output_token_ids == reference_output(prefix + [5, 6], 2, 256)


def test_running_decodes_come_first_and_chunks_respect_budget():
    sched, runner = make(num_blocks=128, block_size=4, budget=16, max_model_len=256)
    add(sched, "a", list(range(3)), max_tokens=50)
    step(sched, runner)                       # a's prompt, a now decodes
    b = add(sched, "b", list(range(100, 140)), max_tokens=3)
    c = add(sched, "c", list(range(200, 205)), max_tokens=3)
    out, _ = step(sched, runner)
    assert [r.request_id for r in out.scheduled] == ["a", "b"]
    assert [len(r.token_ids) for r in out.scheduled] == [1, 15]
    assert [r.sample for r in out.scheduled] == [True, False]
    while b.num_computed_tokens < b.num_prompt_tokens:
        out, _ = step(sched, runner)
        assert out.num_scheduled_tokens <= 16
        assert out.scheduled[0].request_id == "a" and len(out.scheduled[0].token_ids) == 1
    assert c.status == RequestStatus.RUNNING    # admitted with the leftover budget
    run_all(sched, runner)
    assert b.output_token_ids == reference_output(range(100, 140), 3, 256)


def test_without_chunked_prefill_a_prompt_waits_for_room():
    sched, runner = make(num_blocks=128, block_size=4, budget=32, max_model_len=32,
                         chunked=False)
    add(sched, "a", list(range(20)), max_tokens=5)
    add(sched, "b", list(range(100, 125)), max_tokens=5)
    out, _ = step(sched, runner)
    assert [(r.request_id, len(r.token_ids)) for r in out.scheduled] == [("a", 20)]
    assert sched.num_waiting == 1          # b's 25 tokens do not fit in the 12 left over
    out, _ = step(sched, runner)
    assert [(r.request_id, len(r.token_ids)) for r in out.scheduled] == [("a", 1), ("b", 25)]


def test_preempted_request_resumes_with_same_tokens():
    prompts = {f"r{i}": [i * 7 % VOCAB] * 5 + list(range(i, i + 6)) for i in range(4)}
    sched, runner = make(num_blocks=16, block_size=4, budget=64, max_model_len=64,
                         caching=False)
    reqs = {rid: add(sched, rid, p, max_tokens=30, ignore_eos=True) for rid, p in prompts.items()}
    outs = run_all(sched, runner)
    preempted = [rid for o in outs for rid in o.preempted_request_ids]
    assert preempted and sched.num_preemptions_total == len(preempted)
    assert preempted[0] == "r3"                       # the newest goes first
    for rid, r in reqs.items():
        assert r.output_token_ids == reference_output(prompts[rid], 30, 64)
        assert r.get_finished_reason() == "length"
    assert sum(r.num_preemptions for r in reqs.values()) == len(preempted)
    assert sched.kv_cache_manager.get_num_free_blocks() == 16


def test_preempted_request_goes_to_the_front_of_waiting():
    sched, runner = make(num_blocks=6, block_size=4, budget=64, max_model_len=24, caching=False)
    add(sched, "a", list(range(8)), max_tokens=16)
    add(sched, "b", list(range(10, 18)), max_tokens=16)
    step(sched, runner)
    add(sched, "c", list(range(20, 22)), max_tokens=2)
    for _ in range(20):
        out, _ = step(sched, runner)
        if out.preempted_request_ids:
            break
    assert out.preempted_request_ids == ["b"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert sched.requests["b"].status == RequestStatus.PREEMPTED
    assert sched.requests["b"].num_computed_tokens == 0


def test_priority_policy_orders_waiting_and_preempts_lowest_priority():
    sched, runner = make(num_blocks=64, block_size=4, budget=8, max_model_len=64,
                         max_num_seqs=1, policy="priority")
    add(sched, "low", [1, 2], priority=5, arrival=1.0, max_tokens=1)
    add(sched, "high", [3, 4], priority=0, arrival=2.0, max_tokens=1)
    add(sched, "high_late", [5, 6], priority=0, arrival=3.0, max_tokens=1)
    order = [o.scheduled[0].request_id for o in run_all(sched, runner)]
    assert order == ["high", "high_late", "low"]

    sched, runner = make(num_blocks=7, block_size=4, budget=64, max_model_len=28,
                         policy="priority", caching=False)
    add(sched, "urgent", list(range(8)), priority=0, arrival=2.0, max_tokens=20)
    add(sched, "lazy", list(range(10, 18)), priority=9, arrival=1.0, max_tokens=20)
    outs = run_all(sched, runner)
    assert {rid for o in outs for rid in o.preempted_request_ids} == {"lazy"}


def test_abort_frees_blocks_at_once_waiting_and_running():
    sched, runner = make(num_blocks=32, block_size=4, budget=8, max_model_len=64)
    add(sched, "run", list(range(20)), max_tokens=5)
    add(sched, "wait", list(range(30, 40)), max_tokens=5)
    step(sched, runner)                    # "run" gets a prefill chunk, "wait" stays waiting
    assert sched.num_running == 1 and sched.num_waiting == 1
    assert sched.kv_cache_manager.get_num_free_blocks() == 30
    sched.finish_requests(["run", "wait"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.get_num_free_blocks() == 32
    assert not sched.has_unfinished_requests() and sched.num_running == sched.num_waiting == 0
    assert sched.schedule().finished_request_ids == ["run", "wait"]
    assert sched.schedule().finished_request_ids == []


def test_abort_between_schedule_and_update_is_ignored():
    sched, runner = make()
    add(sched, "a", [1, 2, 3])
    out = sched.schedule()
    sampled = runner.execute(out)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, sampled) == []


def test_stop_conditions_in_vllm_order():
    sched, runner = make()
    prompt = [1, 2, 3]
    ref = reference_output(prompt, 10, 128)

    def run(rid, eos=None, **params):
        r = add(sched, rid, prompt, **params)
        r.sampling_params.update_from_tokenizer(eos)
        run_all(sched, runner)
        return r

    r = run("eos", eos=ref[2], max_tokens=10)
    assert r.output_token_ids == ref[:3] and r.get_finished_reason() == "stop"
    assert r.stop_reason is None
    r = run("stop_id", stop_token_ids=[ref[1]], max_tokens=10)
    assert r.output_token_ids == ref[:2] and r.stop_reason == ref[1]
    r = run("min_tokens", stop_token_ids=[ref[0]], min_tokens=2, max_tokens=10)
    assert r.output_token_ids[0] == ref[0] and len(r.output_token_ids) > 1
    r = run("ignore_eos", eos=ref[0], ignore_eos=True, max_tokens=4)
    assert r.output_token_ids == ref[:4] and r.get_finished_reason() == "length"
    r = run("max_tokens", max_tokens=5)
    assert len(r.output_token_ids) == 5 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    sched2, runner2 = make(max_model_len=8)
    r = add(sched2, "model_len", prompt, max_tokens=None)
    assert r.max_tokens == 5
    run_all(sched2, runner2)
    assert r.num_tokens == 8 and r.get_finished_reason() == "length"


def test_add_request_rejects_bad_prompts():
    sched, _ = make(max_model_len=16, num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="longer than the maximum model length of 16"):
        add(sched, "long", list(range(17)))
    with pytest.raises(ValueError, match="empty"):
        add(sched, "empty", [])
    small, _ = make(max_model_len=64, num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="prompt .* longer than the whole KV cache") as info:
        add(small, "big", list(range(10)), max_tokens=10)
    assert info.value.param == "prompt"
    with pytest.raises(ValueError, match="KV blocks") as info:      # the prompt fits, the rest not
        add(small, "long_output", list(range(6)), max_tokens=10)
    assert info.value.param == "max_tokens" and not small.has_unfinished_requests()
    add(sched, "ok", [1])
    with pytest.raises(ValueError, match="already"):
        add(sched, "ok", [1])


def test_draft_tokens_are_scheduled_within_the_budget():
    sched, runner = make(num_blocks=64, block_size=4, budget=10, spec=3)
    for i in range(3):
        add(sched, f"r{i}", [i + 1], max_tokens=8)
    step(sched, runner)                                  # prefills: no drafts yet
    for r in sched.running:
        r.spec_token_ids = [7, 7, 7]
    out = sched.schedule()
    # each sampling row costs 1 + its drafts: two rows of 4 fit in 10, the third gets 1 draft
    assert [len(r.spec_token_ids) for r in out.scheduled] == [3, 3, 1]
    assert [len(r.token_ids) for r in out.scheduled] == [4, 4, 2]
    assert all(len(r.block_ids) * 4 >= r.num_computed_tokens + len(r.token_ids)
               for r in out.scheduled)


def test_max_num_seqs_caps_running():
    sched, runner = make(max_num_seqs=2)
    for i in range(5):
        add(sched, f"r{i}", [i + 1, 2], max_tokens=3)
    out, _ = step(sched, runner)
    assert len(out.scheduled) == 2 and sched.num_waiting == 3
    run_all(sched, runner)


def test_sample_row_without_a_token_is_an_error_not_a_hang():
    sched, runner = make()
    add(sched, "a", [1, 2, 3])
    out = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update_from_output(out, {})


def test_request_sample_seed_prefers_the_params_seed():
    assert Request("a", [1], SamplingParams(seed=7), sample_seed=99).sample_seed == 7
    assert Request("b", [1], SamplingParams(), sample_seed=99).sample_seed == 99
    assert Request("c", [1], SamplingParams(seed=-5 + 2**40)).sample_seed == (2**40 - 5) & 0xFFFFFFFF
    assert 0 <= Request("d", [1], SamplingParams()).sample_seed < 2**32


def test_failed_step_finishes_its_rows_with_error_and_uncaches_what_it_would_have_written():
    """A step that raised wrote no K/V: its requests end with "error", every hash it registered
    is gone (also on a block a same-step request took as a hit), other requests go on, and the
    cache is then read back correctly by the fake runner."""
    sched, runner = make(num_blocks=32, block_size=4, budget=64)
    prompt = list(range(10, 22))                      # 3 full blocks
    other = add(sched, "other", [1, 2, 3, 4, 5], max_tokens=6)
    step(sched, runner)                               # "other" is prefilled and running
    add(sched, "a", prompt, max_tokens=3)
    add(sched, "b", prompt + [7], max_tokens=3)   # same step: hits the blocks a just hashed
    sched.finish_requests("other", RequestStatus.FINISHED_ABORTED)   # a finished id to resend
    pool = sched.kv_cache_manager.block_pool
    written_before = dict(pool.cached_block_hash_to_block)     # "other"'s first block
    out = sched.schedule()
    assert {r.request_id for r in out.scheduled} == {"a", "b"}
    assert sched.get_request("b").num_computed_tokens == 12   # hits on blocks hashed this step
    failed = sched.fail_step(out)                     # the runner raised: nothing was written
    assert {r.request_id for r in failed} == {"a", "b"}
    assert all(r.get_finished_reason() == "error" for r in failed)
    assert pool.cached_block_hash_to_block == written_before
    assert sched.kv_cache_usage == 0.0 and not sched.has_unfinished_requests()
    assert other.request_id in sched.schedule().finished_request_ids   # resent to the worker
    again = add(sched, "again", prompt, max_tokens=3)
    run_all(sched, runner)                            # reads its context back: no stale hit
    assert again.num_cached_tokens == 0
    assert again.output_token_ids == reference_output(prompt, 3, 128)
