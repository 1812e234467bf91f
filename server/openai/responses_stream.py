"""A streamed `/v1/responses`: the chat endpoint's SSE chunks as OpenAI's semantic events.

    response.created, response.in_progress,
    per output item, in order:
      response.output_item.added
        reasoning: response.content_part.added, response.reasoning_text.delta...,
                   response.reasoning_text.done, response.content_part.done
        message:   response.content_part.added, response.output_text.delta...,
                   response.output_text.done, response.content_part.done
        function_call: response.function_call_arguments.delta..., ...arguments.done
      response.output_item.done
    response.completed (response.incomplete when max_output_tokens ended it)

Each event is `event: <type>\\ndata: {..., "sequence_number": n}\\n\\n`, numbered from 0. An
engine failure mid-stream is an `error` event followed by `response.failed`. The chat chunks
are read back from the chat stream's JSON lines (a json.loads per token), which keeps one code
path for templates, sampling and the tool and reasoning parsers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from jaxserve.server.openai.responses_output import (
    ResponseShell,
    function_call_item,
    message_item,
    message_status,
    output_text,
    reasoning_item,
)


class EventWriter:
    def __init__(self):
        self.sequence_number = 0

    def __call__(self, type: str, **fields) -> str:
        obj = {"type": type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {type}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OutputItems:
    """The output items of one streamed response, built from chat deltas; each method returns
    the events it causes. One item is open at a time: a delta of another kind closes it."""

    def __init__(self, event: EventWriter):
        self.event = event
        self.items: list[dict] = []       # finished ones in their final shape
        self._open: dict | None = None    # the item being streamed
        self._text = ""                   # its text or arguments so far
        self._calls: dict[int, int] = {}  # chat tool call index -> output index

    @property
    def _index(self) -> int:
        return len(self.items)

    def reasoning(self, text: str) -> list[str]:
        return self._text_delta("reasoning", text)

    def content(self, text: str) -> list[str]:
        return self._text_delta("message", text)

    def _text_delta(self, kind: str, text: str) -> list[str]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self.close()
            events += self._start(reasoning_item("", "in_progress") if kind == "reasoning"
                                  else message_item("", "in_progress"))
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" \
                else output_text("")
            events.append(self.event("response.content_part.added", item_id=self._open["id"],
                                     output_index=self._index, content_index=0, part=part))
        self._text += text
        name = "response.reasoning_text.delta" if kind == "reasoning" \
            else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(name, item_id=self._open["id"], output_index=self._index,
                                 content_index=0, delta=text, **extra))
        return events

    def tool_call(self, delta: dict) -> list[str]:
        """One entry of a chat delta's tool_calls: the announcement (id and name) opens a
        function_call item; later entries extend its arguments."""
        events = []
        fn = delta.get("function") or {}
        if delta.get("id") is not None:
            events += self.close()
            events += self._start(function_call_item(delta["id"], fn.get("name") or "", "",
                                                     "in_progress"))
            self._calls[delta.get("index", 0)] = self._index
        piece = fn.get("arguments") or ""
        if piece and self._calls.get(delta.get("index", 0)) == self._index \
                and self._open is not None:
            self._text += piece
            events.append(self.event("response.function_call_arguments.delta",
                                     item_id=self._open["id"], output_index=self._index,
                                     delta=piece))
        return events

    def _start(self, item: dict) -> list[str]:
        self._open, self._text = item, ""
        return [self.event("response.output_item.added", output_index=self._index, item=item)]

    def close(self, status: str = "completed") -> list[str]:
        """Finish the open item (its done events); nothing when none is open. status: the
        item's ("incomplete" for a message that max_output_tokens cut)."""
        item, text = self._open, self._text
        if item is None:
            return []
        ids = {"item_id": item["id"], "output_index": self._index}
        events = []
        if item["type"] == "function_call":
            done = {**item, "arguments": text, "status": "completed"}
            events.append(self.event("response.function_call_arguments.done", **ids,
                                     arguments=text, name=item["name"]))
        else:
            if item["type"] == "reasoning":
                part = {"type": "reasoning_text", "text": text}
                events.append(self.event("response.reasoning_text.done", **ids, content_index=0,
                                         text=text))
            else:
                part = output_text(text)
                events.append(self.event("response.output_text.done", **ids, content_index=0,
                                         text=text, logprobs=[]))
            events.append(self.event("response.content_part.done", **ids, content_index=0,
                                     part=part))
            done = {**item, "content": [part],
                    "status": status if item["type"] == "message" else "completed"}
        events.append(self.event("response.output_item.done", output_index=self._index,
                                 item=done))
        self.items.append(done)
        self._open, self._text = None, ""
        return events

    def finish(self, finish_reason: str | None) -> list[str]:
        """Close the last item; an answer with neither text nor calls still gets its (empty)
        message, as the non-streamed response has."""
        events = self.close(message_status(finish_reason))
        if not any(i["type"] in ("message", "function_call") for i in self.items):
            events += self._start(message_item("", "in_progress"))
            events.append(self.event("response.content_part.added", item_id=self._open["id"],
                                     output_index=self._index, content_index=0,
                                     part=output_text("")))
            events += self.close(message_status(finish_reason))
        return events

    def reasoning_text(self) -> str:
        return "".join(p["text"] for i in self.items if i["type"] == "reasoning"
                       for p in i["content"])


async def stream_events(shell: ResponseShell, chat_stream, on_done: Callable[[dict], None],
                        make_usage: Callable[[dict, str], dict]) -> AsyncIterator[str]:
    """The Responses events of a chat stream (an SSEStream with include_usage). on_done gets
    the final Response body (to store it); make_usage(chat usage, reasoning text) gives the
    Responses usage."""
    event = EventWriter()
    output = OutputItems(event)
    started = shell.body([], None, None, status="in_progress")
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    finish_reason, chat_usage = None, None
    try:
        async for line in chat_stream:
            data = line[len("data: "):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                err = chunk["error"]
                yield event("error", code=str(err.get("code")), message=err.get("message"),
                            param=err.get("param"))
                for line_out in output.close():
                    yield line_out
                yield event("response.failed", response=shell.body(
                    output.items, None, None, status="failed",
                    error={"code": "server_error", "message": err.get("message") or ""}))
                return
            if chunk.get("usage") and not chunk.get("choices"):
                chat_usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                for lines in _delta_events(output, delta):
                    yield lines
                finish_reason = choice.get("finish_reason") or finish_reason
        for line_out in output.finish(finish_reason):
            yield line_out
        usage = make_usage(chat_usage, output.reasoning_text()) if chat_usage else None
        body = shell.body(output.items, finish_reason, usage)
        on_done(body)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        yield event(kind, response=body)
    finally:
        await chat_stream.aclose()      # aborts the engine request when the client went away


def _delta_events(output: OutputItems, delta: dict) -> list[str]:
    events = []
    if delta.get("reasoning"):
        events += output.reasoning(delta["reasoning"])
    if delta.get("content"):
        events += output.content(delta["content"])
    for call in delta.get("tool_calls") or []:
        events += output.tool_call(call)
    return events
