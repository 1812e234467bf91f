"""Consuming the engine's request streams for the endpoints: wait for every final output,
interleave several streams (n > 1, several prompts), and turn a failed step or a dead engine
into the OpenAI error the client gets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from jaxserve.engine.async_llm import EngineDeadError, RequestStream
from jaxserve.outputs import RequestOutput
from jaxserve.server.openai.protocol import OpenAIError


def _step_failed() -> OpenAIError:
    return OpenAIError(500, "Internal server error: the engine step that computed this request "
                            "failed (the server keeps serving; retry the request)",
                       "InternalServerError")


def check_not_failed(out: RequestOutput) -> None:
    """finish_reason "error" (the model step raised for this request) is a 500, as in vLLM."""
    if any(c.finish_reason == "error" for c in out.outputs):
        raise _step_failed()


async def collect_all(streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of each stream (FINAL_ONLY requests yield exactly one)."""
    async def last(stream: RequestStream) -> RequestOutput:
        final = None
        async for out in stream:
            final = out
        return final

    try:
        finals = list(await asyncio.gather(*(last(s) for s in streams)))
        for out in finals:
            check_not_failed(out)
        return finals
    except EngineDeadError as e:
        raise OpenAIError(503, str(e)) from None
    finally:
        for s in streams:
            s.close()


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output); closes them all on exit."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()
        for s in streams:
            s.close()
