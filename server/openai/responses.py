"""`/v1/responses`: OpenAI's Responses API served through the chat completion path.

`ResponsesServing(chat: OpenAIServing, max_stored)`:
- `create_response(request)` translates the request into a chat request (responses_protocol.py),
  runs it with `OpenAIServing.create_chat_completion` (so templates, sampling, structured output,
  tool and reasoning parsing are the chat endpoint's own), and turns the chat answer into a
  Response object: `reasoning`, `message` (output_text) and `function_call` output items and
  usage. Streaming turns the chat chunks into OpenAI's semantic events (responses_stream.py).
- Responses with `store` (the default) are kept in a bounded LRU in this process's memory, with
  the conversation that led to them, for `previous_response_id` and `GET`/`DELETE
  /v1/responses/{id}`; an id that is unknown (never stored, evicted, deleted, or from before a
  restart) is a 404.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxserve.server.openai.protocol import OpenAIError
from jaxserve.server.openai.responses_output import (
    ResponseShell,
    new_id,
    output_items,
    output_messages,
    response_usage,
)
from jaxserve.server.openai.responses_protocol import (
    ResponsesRequest,
    input_messages,
    responses_error,
)
from jaxserve.server.openai.responses_stream import stream_events
from jaxserve.server.openai.serving import OpenAIServing
from jaxserve.server.openai.sse import SSEStream

MAX_STORED = 1024    # responses kept for previous_response_id and GET (least recently used go)


class ResponseStore:
    """Stored responses by id, least recently used evicted past `max_size`: each entry is the
    Response body and the chat messages of its conversation (input and output, without
    instructions), which a follow-up with previous_response_id continues."""

    def __init__(self, max_size: int = MAX_STORED):
        self.max_size = max_size
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, body: dict, conversation: list[dict]) -> None:
        self._items[body["id"]] = (body, conversation)
        self._items.move_to_end(body["id"])
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> tuple[dict, list[dict]]:
        entry = self._items.get(response_id)
        if entry is None:
            raise OpenAIError(404, f"Response with id '{response_id}' not found.",
                              "NotFoundError", param)
        self._items.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]

    def __len__(self) -> int:
        return len(self._items)


class ResponsesServing:
    def __init__(self, chat: OpenAIServing, max_stored: int = MAX_STORED):
        self.chat = chat
        self.store = ResponseStore(max_stored)

    async def create_response(self, request: ResponsesRequest,
                              request_id: str | None = None) -> dict | SSEStream:
        """The Response body, or (stream) its SSE events; errors before the first byte are
        OpenAIErrors with the Responses field names."""
        history = [] if request.previous_response_id is None else \
            self.store.get(request.previous_response_id, "previous_response_id")[1]
        conversation = history + input_messages(request.input)
        chat_request = request.to_chat(conversation)
        rid = new_id("resp")
        try:
            model = self.chat.check_model(request.model)
            result = await self.chat.create_chat_completion(
                chat_request, request_id or request.request_id or rid)
        except OpenAIError as e:
            raise responses_error(e) from None
        shell = ResponseShell(request, rid, model, self._temperature(request))
        if isinstance(result, SSEStream):
            return _EventStream(stream_events(shell, result, lambda body: self._keep(
                request, conversation, body), self._usage), result)
        choice = result["choices"][0]
        output = output_items(choice["message"], choice["finish_reason"])
        reasoning = choice["message"].get("reasoning")
        body = shell.body(output, choice["finish_reason"], self._usage(result["usage"], reasoning))
        self._keep(request, conversation, body)
        return body

    def _keep(self, request: ResponsesRequest, conversation: list[dict], body: dict) -> None:
        if request.store:
            self.store.put(body, conversation + output_messages(body["output"]))

    def _temperature(self, request: ResponsesRequest) -> float:
        if request.temperature is not None:
            return request.temperature
        return self.chat.engine.default_sampling_params.get("temperature", 1.0)

    def _usage(self, chat_usage: dict, reasoning: str | None) -> dict:
        """The Responses usage of a chat usage; the reasoning tokens are the reasoning text
        re-tokenized (the parsers hand back text, not ids)."""
        args = self.chat.engine.engine_args
        n = len(self.chat.engine.tokenizer.encode(reasoning, add_special_tokens=False)) \
            if reasoning else 0
        return response_usage(chat_usage, n, args.block_size if args.enable_prefix_caching
                              else None)

    def retrieve(self, response_id: str) -> dict:
        return self.store.get(response_id)[0]

    def delete(self, response_id: str) -> dict:
        self.store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}




class _EventStream(SSEStream):
    """The events of a chat stream; closing it closes the chat stream too, also when no event
    was read (a generator that never started skips its `finally`), so the engine request is
    aborted whenever the client goes away."""

    def __init__(self, events, chat_stream: SSEStream):
        super().__init__(events, chat_stream.usage)
        self._chat_stream = chat_stream

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            await self._chat_stream.aclose()
