"""The Response object of `/v1/responses` and its output items, built from the chat endpoint's
answer: `reasoning`, `message` (one `output_text` part) and `function_call` items, usage in the
Responses shape, and the chat messages a follow-up turn (previous_response_id) sees."""

from __future__ import annotations

import time
import uuid

from jaxserve.server.openai.responses_protocol import ResponsesRequest, template_arguments


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShell:
    """A Response's fields that do not depend on the output (echoes of the request)."""

    def __init__(self, request: ResponsesRequest, response_id: str, model: str,
                 temperature: float):
        self.request = request
        self.id = response_id
        self.model = model
        self.temperature = temperature
        self.created_at = int(time.time())

    def body(self, output: list[dict], finish_reason: str | None, usage: dict | None,
             status: str | None = None, error: dict | None = None) -> dict:
        """status defaults from finish_reason: "incomplete" when max_output_tokens ended it."""
        r = self.request
        if status is None:
            status = "incomplete" if finish_reason == "length" else "completed"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "metadata": r.metadata or {}, "model": self.model, "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None,
                          "summary": None},
            "store": bool(r.store), "temperature": self.temperature,
            "text": {"format": (r.text.format if r.text else None) or {"type": "text"}},
            "tool_choice": r.tool_choice, "tools": r.tools or [], "top_p": r.top_p,
            "truncation": r.truncation or "disabled", "usage": usage, "user": r.user}


# -- output items ---------------------------------------------------------------------------------
def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed"
            else [], "status": status}


def message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": new_id("msg"), "role": "assistant", "status": status,
            "content": [output_text(text)] if status == "completed" else []}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call_id: str, name: str, arguments: str,
                       status: str = "completed") -> dict:
    return {"type": "function_call", "id": new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def message_status(finish_reason: str | None) -> str:
    """A message item's status: "incomplete" when max_output_tokens cut it (OpenAI's)."""
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(message: dict, finish_reason: str | None) -> list[dict]:
    """A chat message as output items: reasoning, then the text (left out only when the answer
    is tool calls alone), then one function_call per tool call."""
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(message["reasoning"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append({**message_item(message.get("content") or ""),
                      "status": message_status(finish_reason)})
    items.extend(function_call_item(c["id"], c["function"]["name"], c["function"]["arguments"])
                 for c in calls)
    return items


def output_messages(output: list[dict]) -> list[dict]:
    """Output items as the chat messages a follow-up turn sees (one assistant turn)."""
    text = "".join(part["text"] for item in output if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"],
                           "arguments": template_arguments(item["arguments"])}}
             for item in output if item["type"] == "function_call"]
    message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


def response_usage(chat_usage: dict, reasoning_tokens: int, cache_block: int | None) -> dict:
    """cache_block: the prefix cache's block size (None when prefix caching is off); the input's
    full blocks that were not cached before are the tokens this request wrote to the cache."""
    details = chat_usage.get("prompt_tokens_details") or {}
    n, cached = chat_usage["prompt_tokens"], details.get("cached_tokens") or 0
    written = max(n // cache_block * cache_block - cached, 0) if cache_block else 0
    return {"input_tokens": n,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
            "output_tokens": chat_usage.get("completion_tokens") or 0,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": chat_usage["total_tokens"]}
