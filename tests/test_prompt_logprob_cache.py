"""Prompt logprobs through the prefix cache, host side (fakes, no model): a scoring request hits
a block only where the block's prompt-logprob entries are cached or computed in the same step,
gets exactly the entries a cold run gives (position by position, any k up to the stored one),
and eviction, chunked prefill and preemption keep it exact."""

import random
import zlib

import pytest
from test_scheduler import FakeRunner, add, check_pool_invariants, make

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams

MAX_K = 5


def _h(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def entry(tokens, pos, k):
    """What a model would give for prompt position pos: the chosen logprob depends on tokens
    <= pos, the top-k on tokens < pos (the logits one position earlier)."""
    top = tuple(_h("id", tuple(tokens[:pos]), i) % 50 for i in range(MAX_K))
    vals = tuple(-(_h("lp", tuple(tokens[:pos]), i) % 1000) / 100 for i in range(MAX_K))
    return (tokens[pos], -(_h(tuple(tokens[:pos + 1])) % 1000) / 100,
            _h("rank", tuple(tokens[:pos + 1])) % 9 + 1, top[:k], vals[:k])


class ScoringRunner(FakeRunner):
    """FakeRunner that also scores prompt positions as the model runner does: a row with
    prompt_logprobs gives one entry per computed position whose next token is in the prompt."""

    def execute_scoring(self, out):
        sampled = self.execute(out)
        scored = {}
        for row in out.scheduled:
            if not row.prompt_logprobs:
                continue
            req = self.sched.requests[row.request_id]
            k = req.sampling_params.prompt_logprobs
            scored[row.request_id] = [
                (p + 1, entry(req.prompt_token_ids, p + 1, k))
                for p in range(row.num_computed_tokens, row.num_computed_tokens + len(row.token_ids))
                if p + 1 < req.num_prompt_tokens]
        return sampled, scored


def make_scoring(**kwargs):
    sched, _ = make(**kwargs)
    return sched, ScoringRunner(sched)


def run(sched, runner, max_steps=5000):
    """Run to the end like LLMEngine.step; returns {rid: {position: entry}} (first kept)."""
    got = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return got
        out = sched.schedule()
        sampled, scored = runner.execute_scoring(out)
        for rid, entries in sched.prompt_logprobs_of_step(out, scored).items():
            for pos, e in entries:
                got.setdefault(rid, {}).setdefault(pos, e)
        sched.update_from_output(out, sampled)
        check_pool_invariants(sched)
    raise AssertionError("did not finish")


def check(got, prompts, ks):
    for rid, prompt in prompts.items():
        want = {p: entry(prompt, p, ks[rid]) for p in range(1, len(prompt))}
        assert got.get(rid, {}) == want, rid


CONTEXT = [random.Random(1).randrange(50) for _ in range(40)]


def test_second_choice_takes_the_context_from_the_cache():
    sched, runner = make_scoring(block_size=4, budget=64)
    prompts = {"a": CONTEXT + [1, 2, 3], "b": CONTEXT + [4, 5]}
    ks = {"a": 2, "b": 2}
    add(sched, "a", prompts["a"], max_tokens=1, prompt_logprobs=2)
    got = run(sched, runner)
    add(sched, "b", prompts["b"], max_tokens=1, prompt_logprobs=2)
    got.update(run(sched, runner))
    check(got, prompts, ks)
    # 10 full context blocks, but the 10th one's last target is the first token after the
    # context (1 for a, 4 for b): its entries are keyed by it, so b hits 9 blocks
    assert sched.prefix_cache_stats.hits == 36


def test_choices_admitted_in_the_same_step_share_the_blocks_in_flight():
    sched, runner = make_scoring(block_size=4, budget=256)
    prompts = {c: CONTEXT + [i, i + 1] for i, c in enumerate("abcd")}
    for rid, p in prompts.items():
        add(sched, rid, p, max_tokens=1, prompt_logprobs=1)
    out = sched.schedule()
    assert [len(r.token_ids) for r in out.scheduled] == [42, 6, 6, 6]   # 9 blocks of 4 from the cache
    sampled, scored = runner.execute_scoring(out)
    got = {rid: dict(e) for rid, e in sched.prompt_logprobs_of_step(out, scored).items()}
    sched.update_from_output(out, sampled)
    check(got, prompts, dict.fromkeys(prompts, 1))


def test_async_a_choice_admitted_while_the_context_step_runs_takes_its_promise():
    """Async scheduling schedules step N + 1 before step N's results are applied: a choice
    admitted then hits the blocks step N is scoring (their promise holds until N's results are
    recorded), and gets exactly the cold entries with its own step's results."""
    sched, _ = make(block_size=4, budget=64, async_scheduling=True)
    runner = ScoringRunner(sched)
    prompts = {"a": CONTEXT + [1, 2], "b": CONTEXT + [1, 3]}
    add(sched, "a", prompts["a"], max_tokens=1, prompt_logprobs=2)
    first = sched.schedule()
    first_results = runner.execute_scoring(first)          # step N, still "in flight"
    add(sched, "b", prompts["b"], max_tokens=1, prompt_logprobs=2)
    second = sched.schedule()
    assert [len(r.token_ids) for r in second.scheduled] == [2]      # 10 blocks of 4 hit
    assert second.prompt_logprob_hits == {"b": 10}
    got = {}
    for out, (sampled, scored) in ((first, first_results), (second, runner.execute_scoring(second))):
        for rid, entries in sched.prompt_logprobs_of_step(out, scored).items():
            got.setdefault(rid, {}).update(entries)
        sched.update_from_output(out, sampled)
        check_pool_invariants(sched)
    check(got, prompts, {"a": 2, "b": 2})
    assert not sched.take_errored() and not sched.has_unfinished_requests()


def test_a_choice_admitted_on_a_failed_steps_promise_finishes_with_an_error():
    sched, _ = make(block_size=4, budget=64, async_scheduling=True)
    runner = ScoringRunner(sched)
    add(sched, "a", CONTEXT + [1, 2], max_tokens=1, prompt_logprobs=2)
    first = sched.schedule()
    runner.execute_scoring(first)       # it ran, then failed when its results were read
    add(sched, "b", CONTEXT + [1, 3], max_tokens=1, prompt_logprobs=2)
    add(sched, "c", [7, 8, 9], max_tokens=2)
    second = sched.schedule()
    assert second.prompt_logprob_hits == {"b": 10}
    assert [r.request_id for r in sched.fail_step(first)] == ["a"]
    sampled, scored = runner.execute_scoring(second)
    assert "b" not in sched.prompt_logprobs_of_step(second, scored)
    (errored,) = sched.take_errored()
    assert errored.request_id == "b" and errored.status == RequestStatus.FINISHED_ERROR
    sched.update_from_output(second, sampled)
    check_pool_invariants(sched)
    assert list(sched.requests) == ["c"]


def test_fewer_top_logprobs_hit_more_miss():
    sched, runner = make_scoring(block_size=4, budget=64)
    add(sched, "a", CONTEXT + [1], max_tokens=1, prompt_logprobs=3)
    run(sched, runner)          # the 10th block's entries are keyed by the 1 after it
    for rid, k, hits in (("fewer", 1, 36), ("more", 4, 0), ("none", None, 40)):
        before = sched.prefix_cache_stats.hits
        params = {} if k is None else {"prompt_logprobs": k}
        add(sched, rid, CONTEXT + [7], max_tokens=1, **params)
        got = run(sched, runner)
        assert sched.prefix_cache_stats.hits - before == hits, rid
        if k is not None:
            check(got, {rid: CONTEXT + [7]}, {rid: k})


def test_evicting_a_block_drops_its_entries():
    m = KVCacheManager(num_blocks=4, block_size=4)
    a = Request("a", list(range(9)), SamplingParams(prompt_logprobs=1))
    hits, _ = m.get_computed_blocks(a)
    m.allocate_slots(a, 9, hits)
    m.record_prompt_logprobs(a, [(p, entry(a.prompt_token_ids, p, 1)) for p in range(1, 9)])
    assert len(m.prompt_logprobs) == 2
    m.free(a)
    b = Request("b", list(range(9)), SamplingParams(prompt_logprobs=1))
    assert m.get_computed_blocks(b)[1] == 8
    c = Request("c", [7] * 13, SamplingParams())
    m.allocate_slots(c, 13)                       # needs all 4 blocks: both cached ones evicted
    assert len(m.prompt_logprobs) == 0 and m.get_computed_blocks(b)[1] == 0


def test_generation_blocks_are_no_hit_for_scoring():
    sched, runner = make_scoring(block_size=4, budget=64)
    add(sched, "gen", CONTEXT + [1], max_tokens=1)
    run(sched, runner)
    add(sched, "score", CONTEXT + [2], max_tokens=1, prompt_logprobs=0)
    got = run(sched, runner)
    assert sched.requests == {} and sched.prefix_cache_stats.hits == 0
    check(got, {"score": CONTEXT + [2]}, {"score": 0})


@pytest.mark.parametrize("seed", range(4))
def test_random_choices_chunks_evictions_and_preemptions_stay_exact(seed):
    """Groups of choices sharing contexts, random k, small budgets (chunks off block edges), a
    small pool (evictions, preemptions), arrivals between steps: every position of every request
    gets exactly what a cold run gives."""
    rng = random.Random(seed)
    sched, runner = make_scoring(num_blocks=20, block_size=4, budget=rng.choice([7, 16, 30]),
                         max_num_seqs=6)
    contexts = [[rng.randrange(50) for _ in range(rng.randrange(5, 50))] for _ in range(4)]
    prompts, ks, got = {}, {}, {}
    for i in range(40):
        rid = f"r{i}"
        prompts[rid] = rng.choice(contexts) + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
        ks[rid] = rng.choice([0, 1, 3, 5])
        add(sched, rid, prompts[rid], max_tokens=rng.randrange(1, 4), prompt_logprobs=ks[rid],
            ignore_eos=True)
        for _ in range(rng.randrange(0, 3)):
            if sched.has_unfinished_requests():
                out = sched.schedule()
                sampled, scored = runner.execute_scoring(out)
                for r, entries in sched.prompt_logprobs_of_step(out, scored).items():
                    for pos, e in entries:
                        got.setdefault(r, {}).setdefault(pos, e)
                sched.update_from_output(out, sampled)
                check_pool_invariants(sched)
    for rid, entries in run(sched, runner).items():
        for pos, e in entries.items():
            got.setdefault(rid, {}).setdefault(pos, e)
    check(got, prompts, ks)
    assert sched.prefix_cache_stats.hits > 0
