"""Scoring through the prefix cache on the default model: lm-eval's multiple-choice requests
(4 continuations of one context, `prompt_logprobs` / `echo` + `logprobs` + `max_tokens` 1) take
the context's blocks and prompt logprobs from the cache, and get what a cold run computes, in
`LLM`, in the server's /v1/completions and with a chunked prefill."""

from __future__ import annotations

import asyncio

import pytest
from conftest import engine_variant
from test_server_faults import _Borrowed

from jaxserve import SamplingParams
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.server.openai.protocol import CompletionRequest
from jaxserve.server.openai.serving import OpenAIServing

CONTEXT = ("Question: A farmer has a field of wheat that is ready for harvest, but the forecast "
           "says heavy rain will arrive in two days and the harvester can only cover half of "
           "the field each day. The farmer's neighbour offers to lend a second machine if the "
           "farmer helps with the neighbour's barley next week. What should the farmer do?\n"
           "Answer:")
CHOICES = [" Accept the offer and harvest everything before the rain",
           " Wait for the rain to pass", " Sell the field", " Plant barley instead"]


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.get_tokenizer()
    ctx = tok.encode(CONTEXT)
    assert len(ctx) >= 64
    return [ctx + tok.encode(c) for c in CHOICES]


def _score(llm, prompts, k):
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _same(got, want, ids):
    """Position by position: the same tokens in each entry, logprobs within float noise (the
    uncached tail is computed in differently shaped steps)."""
    assert len(got) == len(want) == len(ids) and got[0] is None
    for pos in range(1, len(ids)):
        assert set(got[pos]) == set(want[pos]), pos
        for tid, lp in got[pos].items():
            assert lp.logprob == pytest.approx(want[pos][tid].logprob, abs=2e-3), (pos, tid)
            assert lp.rank == want[pos][tid].rank or abs(lp.logprob - want[pos][tid].logprob) < 1e-4


@pytest.fixture(scope="module")
def cold(llm, prompts):
    """Each choice scored alone with the prefix cache off."""
    from conftest import engine_variant
    with engine_variant(llm, enable_prefix_caching=False):
        return [_score(llm, [p], 2)[0].prompt_logprobs for p in prompts]


def test_choices_score_the_context_once_and_equal_a_cold_run(llm, variant, prompts, cold):
    with variant(llm) as sched:
        first = _score(llm, prompts, 2)              # admitted together: hits computed in flight
        again = _score(llm, prompts, 1)              # stored entries serve a smaller k
        more = _score(llm, prompts[:1], 3)           # a larger k was never stored: no hit
        stats = sched.prefix_cache_stats
    bs = llm.llm_engine.cache_config.block_size
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= bs for o in first[1:] + again)
    assert more[0].num_cached_tokens == 0
    assert stats.hits == sum(o.num_cached_tokens for o in first + again + more)
    for outs in (first, again):
        for out, want, ids in zip(outs, cold, prompts):
            k = 2 if outs is first else 1
            trimmed = [None] + [{t: v for t, v in e.items() if v.rank <= k or t == ids[pos]}
                                for pos, e in enumerate(want) if pos]
            _same(out.prompt_logprobs, trimmed, ids)


def test_chunked_prefill_with_hits_stays_exact(llm, variant, prompts, cold):
    with variant(llm, max_num_batched_tokens=16) as sched:
        outs = _score(llm, prompts, 2)
        hits = sched.prefix_cache_stats.hits
    assert hits > 0
    for out, want, ids in zip(outs, cold, prompts):
        _same(out.prompt_logprobs, want, ids)


def test_lm_eval_requests_through_the_server_hit_the_cache(llm, variant, prompts, cold):
    """echo + logprobs + max_tokens 1, four choices sent at once: the same token logprobs as a
    cold run, and the engine's prefix-cache hit counter (jaxserve:prefix_cache_hits) grows."""

    async def main():
        async_llm = AsyncLLM(engine=_Borrowed(llm.llm_engine))
        await async_llm.start()
        serving = OpenAIServing(async_llm, ["m"])
        try:
            reqs = [CompletionRequest(prompt=p, echo=True, logprobs=1, max_tokens=1, temperature=0)
                    for p in prompts]
            return await asyncio.gather(*(serving.create_completion(r) for r in reqs))
        finally:
            await async_llm.shutdown()

    with variant(llm):
        before = llm.llm_engine.stats().prefix_cache_hits
        bodies = asyncio.run(main())
        hits = llm.llm_engine.stats().prefix_cache_hits - before
    assert hits >= 3 * 64
    for body, want, ids in zip(bodies, cold, prompts):
        got = body["choices"][0]["logprobs"]["token_logprobs"][:len(ids)]
        assert got[0] is None
        assert got[1:] == pytest.approx([want[p][ids[p]].logprob for p in range(1, len(ids))],
                                        abs=2e-3)


def test_async_choices_arriving_while_another_request_decodes(llm, prompts, cold):
    """Async scheduling: the choices are scheduled while earlier steps still run (the server
    case: lm-eval's requests arrive beside others). The first choice's context blocks are
    promised to the later ones across steps in flight: all hit, and the entries equal a cold
    run (once an engine crash: "prompt logprobs ... vanished from the cache")."""
    engine = llm.llm_engine
    with engine_variant(llm, async_scheduling=True):
        decode = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        engine.add_request("decoding", {"prompt_token_ids": prompts[0][:10]}, decode)
        for _ in range(3):
            engine.step()
        score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
        for i, p in enumerate(prompts):
            engine.add_request(f"choice{i}", {"prompt_token_ids": p}, score)
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        hits = engine.stats().prefix_cache_hits
    assert hits >= 3 * 64 and all(done[f"choice{i}"].num_cached_tokens >= 64 for i in (1, 2, 3))
    for i, (want, ids) in enumerate(zip(cold, prompts)):
        _same(done[f"choice{i}"].prompt_logprobs, want, ids)
