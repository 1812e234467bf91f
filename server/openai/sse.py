"""Server-sent events of the streaming endpoints: one `data: {...}` line per chunk, the closing
`data: [DONE]` and `SSEStream`, what a streaming endpoint returns (its lines and token counts)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from jaxserve.engine.async_llm import RequestStream

SSE_DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class SSEStream:
    """A streamed response: its SSE lines (`async for`, `aclose()`) and `usage`, the token counts
    of what was generated, filled in when the stream ends or is closed (for the access log).
    `aclose()` also closes (aborts) `streams`: a generator closed before its first line skips
    its own `finally`."""

    def __init__(self, lines: AsyncIterator[str], usage_out: dict,
                 streams: list[RequestStream] = ()):
        self._lines = lines
        self.usage = usage_out
        self._streams = streams

    def __aiter__(self):
        return self._lines.__aiter__()

    async def aclose(self) -> None:
        try:
            await self._lines.aclose()
        finally:
            for s in self._streams:
                s.close()
