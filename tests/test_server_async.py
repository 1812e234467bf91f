"""AsyncLLM and OpenAIServing against a fake engine (no model): aborts on disconnect, engine death."""

from __future__ import annotations

import asyncio
import time

import pytest

from jaxserve.config import EngineArgs
from jaxserve.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError
from jaxserve.engine.llm_engine import EngineStats
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.server.openai.protocol import CompletionRequest, OpenAIError
from jaxserve.server.openai.serving import OpenAIServing


class FakeTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)

    def decode_token(self, i):
        return chr(97 + i % 26)


class FakeEngine:
    """Emits one token per step per request; `fail_at` makes step() raise."""

    def __init__(self, fail_at: int | None = None, tokens: int = 1000):
        self.args = EngineArgs()
        self.tokenizer = FakeTokenizer()
        self.max_model_len = 512
        self.model_name = "fake"
        self.default_sampling_params: dict = {}
        self.requests: dict[str, int] = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.fail_at = fail_at
        self.tokens = tokens
        self.pending: list[RequestOutput] = []

        class _Cfg:
            vocab_size = 100
        self.model_config = _Cfg()

    def add_request(self, rid, prompt, params, arrival_time=None, priority=0):
        if not prompt["prompt_token_ids"]:
            raise ValueError("The decoder prompt cannot be empty")
        self.requests[rid] = 0

    def abort_request(self, ids):
        for rid in ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)
                self.pending.append(RequestOutput(rid, None, [1], None,
                                                  [CompletionOutput(0, "", [], None, None,
                                                                    "abort")], True))

    def has_unfinished_requests(self):
        return bool(self.requests or self.pending)

    def step(self):
        time.sleep(0.005)           # a step takes time; consumers must not outrun it
        self.steps += 1
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise RuntimeError("device fell over")
        outs, self.pending = self.pending, []
        for rid in list(self.requests):
            self.requests[rid] += 1
            done = self.requests[rid] >= self.tokens
            outs.append(RequestOutput(rid, None, [1], None, [CompletionOutput(
                0, "x", [5], None, None, "length" if done else None)], done))
            if done:
                del self.requests[rid]
        return outs

    def stats(self):
        return EngineStats(len(self.requests), 0, 0.0, 0, 0, 0, 0, 0)

    def shutdown(self):
        pass


def delta(max_tokens=5):
    return SamplingParams(max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)


def test_consumer_that_stops_iterating_aborts_its_request():
    async def main():
        engine = FakeEngine()
        llm = AsyncLLM(engine=engine)
        await llm.start()
        gen = llm.generate({"prompt_token_ids": [1]}, delta(), "r1")
        async for _ in gen:
            break
        await gen.aclose()
        for _ in range(50):
            if not engine.requests:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == ["r1"] and not engine.requests
        await llm.shutdown()
    asyncio.run(main())


def test_slow_consumer_gets_merged_deltas_not_a_growing_backlog():
    """The engine runs ahead of a reader that sleeps: outputs merge into one pending slot, and
    the concatenated deltas are exactly the tokens produced."""
    async def main():
        engine = FakeEngine(tokens=40)
        llm = AsyncLLM(engine=engine)
        await llm.start()
        stream = await llm.add_request("slow", {"prompt_token_ids": [1]}, delta(40))
        received, tokens = 0, []
        async for out in stream:
            received += 1
            tokens += out.outputs[0].token_ids
            assert stream.has_pending is False      # one slot: nothing queued behind it
            await asyncio.sleep(0.05)               # ~10 engine steps per read
        assert tokens == [5] * 40 and out.outputs[0].finish_reason == "length"
        assert received < 20, received              # merged, not one output per token
        await llm.shutdown()
    asyncio.run(main())


def test_cumulative_outputs_replace_the_pending_one():
    async def main():
        llm = AsyncLLM(engine=FakeEngine())
        await llm.start()
        stream = await llm.add_request("c", {"prompt_token_ids": [1]},
                                       SamplingParams(max_tokens=5))
        first = RequestOutput("c", None, [1], None, [CompletionOutput(0, "a", [1], None, None)],
                              False)
        second = RequestOutput("c", None, [1], None,
                               [CompletionOutput(0, "ab", [1, 2], None, None)], False)
        stream._pending = None
        stream.put(first)
        stream.put(second)
        assert stream._pending.outputs[0].text == "ab" and stream._pending.outputs[0].token_ids \
            == [1, 2]
        stream.close()
        await llm.shutdown()
    asyncio.run(main())


def test_cancelled_consumer_task_aborts_its_request():
    async def main():
        engine = FakeEngine()
        llm = AsyncLLM(engine=engine)
        await llm.start()

        async def consume():
            async for _ in llm.generate({"prompt_token_ids": [1]}, delta(), "r2"):
                await asyncio.sleep(0.01)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(50):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == ["r2"]
        await llm.shutdown()
    asyncio.run(main())


def test_engine_death_fails_streams_and_later_requests_with_503():
    async def main():
        llm = AsyncLLM(engine=FakeEngine(fail_at=3))
        await llm.start()
        serving = OpenAIServing(llm, ["fake"])
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate({"prompt_token_ids": [1]}, delta(), "r3"):
                pass
        assert llm.errored and not llm.is_ready
        with pytest.raises(OpenAIError) as info:
            await serving.create_completion(CompletionRequest(prompt="hi", max_tokens=3))
        assert info.value.status == 503
        await llm.shutdown(graceful=False)
    asyncio.run(main())


def test_validation_error_from_the_engine_is_raised_by_add_request():
    async def main():
        llm = AsyncLLM(engine=FakeEngine())
        await llm.start()
        with pytest.raises(ValueError, match="cannot be empty"):
            await llm.add_request("r4", {"prompt_token_ids": []}, delta())
        assert "r4" not in llm._streams
        await llm.shutdown()
    asyncio.run(main())


def test_waiting_limit_raises_overloaded():
    async def main():
        llm = AsyncLLM(engine=FakeEngine(), max_waiting_requests=0)
        await llm.start()
        with pytest.raises(EngineOverloadedError):
            await llm.add_request("r5", {"prompt_token_ids": [1]}, delta())
        await llm.shutdown()
    asyncio.run(main())


def test_serving_streams_end_with_done_and_one_finish_reason():
    async def main():
        llm = AsyncLLM(engine=FakeEngine(tokens=3))
        await llm.start()
        serving = OpenAIServing(llm, ["fake"])
        chunks = [c async for c in await serving.create_completion(
            CompletionRequest(prompt="hi", max_tokens=3, stream=True,
                              stream_options={"include_usage": True}))]
        assert chunks[-1] == "data: [DONE]\n\n"
        assert sum('"finish_reason": "length"' in c for c in chunks) == 1
        assert '"choices": []' in chunks[-2]
        await llm.shutdown()
    asyncio.run(main())


def test_chat_prompt_passes_add_special_tokens_to_the_tokenizer():
    """vLLM's chat default: the template writes the special tokens, encode adds none, unless the
    request sets add_special_tokens."""
    from jaxserve.server.openai.protocol import ChatCompletionRequest

    class Recorder(FakeTokenizer):
        calls = []

        def apply_chat_template(self, messages, tokenize=False, **kw):
            return "".join(m["content"] for m in messages)

        def encode(self, text, add_special_tokens=True):
            self.calls.append(add_special_tokens)
            return super().encode(text)

    engine = FakeEngine()
    engine.tokenizer = Recorder()
    serving = OpenAIServing(AsyncLLM(engine=engine))
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    serving._chat_prompt(ChatCompletionRequest(messages=msgs))
    serving._chat_prompt(ChatCompletionRequest(messages=msgs, add_special_tokens=True))
    assert Recorder.calls == [False, True]
