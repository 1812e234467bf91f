"""Prompt logprobs of prompts prefilled in several chunks (16-token budget): every prompt position
arrives exactly once (the first None, as vLLM), in `LLM`, in `AsyncLLM` streams (DELTA and
CUMULATIVE) and in `/v1/completions` with `echo` + `logprobs`, streamed or not; and what a
consumer was handed never changes afterwards (the engine thread keeps prefilling)."""

from __future__ import annotations

import asyncio

import pytest
from test_server_faults import _Borrowed, _chunks

from jaxserve import SamplingParams
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.sampling_params import RequestOutputKind
from jaxserve.server.openai.protocol import CompletionRequest
from jaxserve.server.openai.serving import OpenAIServing

CHUNK = 16
TEXT = ("The quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat by the "
        "window, and far away a train whistles through the hills into the evening while the "
        "last light fades over the river")
LENGTHS = [1, CHUNK, 40]          # one token, exactly one chunk, three chunks


@pytest.fixture(scope="module")
def prompts(llm):
    ids = llm.get_tokenizer().encode(TEXT)
    assert len(ids) >= max(LENGTHS)
    return {n: ids[:n] for n in LENGTHS}


@pytest.fixture(scope="module")
def unchunked(llm, prompts):
    """Each prompt's logprobs computed in one chunk (the shared engine's 128-token budget)."""
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts.values()], sp, use_tqdm=False)
    return {n: out.prompt_logprobs for n, out in zip(prompts, outs)}


def _check_positions(lps, ids, want):
    """One entry per prompt position, the first None, each holding that position's token with
    the logprob the unchunked prefill gave."""
    assert len(lps) == len(ids) and lps[0] is None
    for pos in range(1, len(ids)):
        assert ids[pos] in lps[pos], pos
        assert lps[pos][ids[pos]].logprob == pytest.approx(want[pos][ids[pos]].logprob, abs=2e-3)


def test_offline_prompt_logprobs_cover_every_position_when_chunked(llm, variant, prompts,
                                                                   unchunked):
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, ignore_eos=True)
    with variant(llm, max_num_batched_tokens=CHUNK):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts.values()], sp,
                            use_tqdm=False)
    for (n, ids), out in zip(prompts.items(), outs):
        _check_positions(out.prompt_logprobs, ids, unchunked[n])


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_async_stream_delivers_each_prompt_position_once_and_never_changes_it(
        llm, variant, prompts, unchunked, kind):
    sp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1, ignore_eos=True,
                        output_kind=kind)

    async def main():
        async_llm = AsyncLLM(engine=_Borrowed(llm.llm_engine))
        await async_llm.start()
        try:
            got = {}
            for n, ids in prompts.items():
                handed = []         # (the list handed over, its length then)
                async for out in async_llm.generate({"prompt_token_ids": ids}, sp, f"p{n}-{kind}"):
                    if out.prompt_logprobs is not None:
                        handed.append((out.prompt_logprobs, len(out.prompt_logprobs)))
                    await asyncio.sleep(0.01)       # the engine runs on while we hold them
                got[n] = handed
            return got
        finally:
            await async_llm.shutdown()

    with variant(llm, max_num_batched_tokens=CHUNK):
        got = asyncio.run(main())
    for n, ids in prompts.items():
        handed = got[n]
        assert [len(lps) for lps, _ in handed] == [size for _, size in handed]   # untouched
        if kind == RequestOutputKind.DELTA:
            whole = [entry for lps, _ in handed for entry in lps]
        else:
            whole = handed[-1][0]
        _check_positions(whole, ids, unchunked[n])


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_completions_echo_logprobs_cover_the_whole_chunked_prompt(llm, variant, prompts,
                                                                  unchunked, stream):
    tok = llm.get_tokenizer()
    max_tokens = 3

    async def main():
        async_llm = AsyncLLM(engine=_Borrowed(llm.llm_engine))
        await async_llm.start()
        serving = OpenAIServing(async_llm, ["m"])
        try:
            bodies = {}
            for n, ids in prompts.items():
                req = CompletionRequest(prompt=ids, echo=True, logprobs=1, max_tokens=max_tokens,
                                        temperature=0, stream=stream)
                res = await serving.create_completion(req)
                if not stream:
                    bodies[n] = (res["choices"][0]["text"], res["choices"][0]["logprobs"])
                    continue
                chunks = [c for c in (await _chunks(res))[:-1]]
                text = "".join(c["choices"][0]["text"] for c in chunks)
                lp = {k: [x for c in chunks for x in c["choices"][0]["logprobs"][k]]
                      for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
                bodies[n] = (text, lp)
            return bodies
        finally:
            await async_llm.shutdown()

    with variant(llm, max_num_batched_tokens=CHUNK):
        bodies = asyncio.run(main())
    for n, ids in prompts.items():
        text, lp = bodies[n]
        prompt_text = tok.decode(ids, skip_special_tokens=False)
        assert text.startswith(prompt_text)
        assert len(lp["tokens"]) == n + max_tokens == len(lp["token_logprobs"])
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for pos in range(1, n):
            assert lp["token_logprobs"][pos] == pytest.approx(
                unchunked[n][pos][ids[pos]].logprob, abs=2e-3), pos
        assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
        # text_offset runs over the echoed prompt and the completion without a gap
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i])
                                     for i in range(len(lp["tokens"]))]
