"""The Responses API's request (`POST /v1/responses`) and its translation into a chat request.

A Responses request is served by the chat completion path (chat template, sampling, tool and
reasoning parsers), so this module's job is the mapping, done where the input enters:

    input (a string, or message / function_call / function_call_output / reasoning items)
        -> chat `messages` (after `instructions` as a system message and the stored
           conversation of `previous_response_id`)
    max_output_tokens -> max_completion_tokens     text.format -> response_format
    tools (flat function tools) -> chat tools      tool_choice {"type": "function", "name"}
    reasoning.effort -> reasoning_effort           -> {"type": "function", "function": {name}}

Everything the chat path does not know (an input item or tool type this server cannot run, a
malformed text.format) is refused here with a 400 naming the Responses field.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import field_validator

from jaxserve.server.openai.protocol import (
    ChatCompletionRequest,
    OpenAIBaseModel,
    OpenAIError,
    validate_request,
)

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
INPUT_ITEMS = ("message", "function_call", "function_call_output", "reasoning")


class ReasoningConfig(OpenAIBaseModel):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None   # accepted; no summaries here


class TextConfig(OpenAIBaseModel):
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(OpenAIBaseModel):
    # OpenAI fields, in the order of https://platform.openai.com/docs/api-reference/responses/create
    background: bool | None = False
    include: list[str] | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    model: str | None = None
    parallel_tool_calls: bool | None = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    store: bool | None = True
    stream: bool | None = False
    temperature: float | None = None
    text: TextConfig | None = None
    tool_choice: str | dict[str, Any] | None = "auto"
    tools: list[dict[str, Any]] | None = None
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    user: str | None = None
    # vLLM's extras
    request_id: str | None = None
    priority: int = 0

    @field_validator("max_output_tokens")
    @classmethod
    def _positive_max_output_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"max_output_tokens must be at least 1, got {value}")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512
        if value is not None:
            if len(value) > 16:
                raise ValueError(f"metadata may hold at most 16 pairs, got {len(value)}")
            for k, v in value.items():
                if len(k) > 64 or len(v) > 512:
                    raise ValueError(f"metadata key {k[:64]!r}: keys are at most 64 characters "
                                     "and values at most 512")
        return value

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background responses are not supported by this server; leave "
                             "background false")
        return value

    @field_validator("truncation")
    @classmethod
    def _no_auto_truncation(cls, value: str | None) -> str | None:
        if value == "auto":
            raise ValueError("truncation 'auto' is not supported; an input longer than the "
                             "context is refused ('disabled')")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("top_logprobs is not supported on /v1/responses; use "
                             "/v1/chat/completions for log probabilities")
        return value

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value):
        if not value:
            raise ValueError("input must be a non-empty string or list of items")
        return value

    # -- the chat request ---------------------------------------------------------------------
    def chat_tools(self) -> list[dict] | None:
        """`tools` in the chat shape; only function tools run here."""
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type")
            if kind != "function":
                raise OpenAIError(400, f"tool type {kind!r} is not supported: this server runs "
                                       "function tools only ({\"type\": \"function\", \"name\": "
                                       "..., \"parameters\": {...}})", param=f"tools.{i}.type")
            name = tool.get("name")
            if not isinstance(name, str) or not name:
                raise OpenAIError(400, "a function tool needs a non-empty string name",
                                  param=f"tools.{i}.name")
            params = tool.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise OpenAIError(400, "parameters must be a JSON schema object",
                                  param=f"tools.{i}.parameters")
            fn = {"name": name, "parameters": params}
            if isinstance(tool.get("description"), str):
                fn["description"] = tool["description"]
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self):
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise OpenAIError(400, f"tool_choice {choice!r} is not supported; use 'none', 'auto', "
                               "'required' or {\"type\": \"function\", \"name\": ...}",
                          param="tool_choice")

    def response_format(self) -> dict | None:
        """text.format as the chat request's response_format."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return None
        kind = fmt.get("type")
        if kind in ("text", "json_object"):
            return {"type": kind}
        if kind != "json_schema":
            raise OpenAIError(400, f"text.format type {kind!r} is not supported; use 'text', "
                                   "'json_object' or 'json_schema'", param="text.format.type")
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise OpenAIError(400, "text.format.schema must be a JSON schema object",
                              param="text.format.schema")
        name = fmt.get("name")
        if not isinstance(name, str) or not name:
            raise OpenAIError(400, "text.format.name must be a non-empty string",
                              param="text.format.name")
        return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                       "strict": fmt.get("strict") is True}}

    def to_chat(self, conversation: list[dict]) -> ChatCompletionRequest:
        """The chat request that serves this one. `conversation`: the chat messages of the
        previous_response_id chain, then `input_messages(self.input)`; `instructions` goes
        first (OpenAI does not carry a previous response's instructions over)."""
        messages = ([{"role": "system", "content": self.instructions}]
                    if self.instructions else []) + conversation
        tools = self.chat_tools()
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "stream": bool(self.stream),
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls,
            "user": self.user, "priority": self.priority,
            "response_format": self.response_format()}
        if tools is not None or self.tool_choice not in ("auto", "none", None):
            body.update(tools=tools, tool_choice=self.chat_tool_choice())
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        try:
            return validate_request(ChatCompletionRequest, body)
        except OpenAIError as e:
            raise responses_error(e) from None


# -- input items -> chat messages -----------------------------------------------------------------
def input_messages(value: str | list[dict]) -> list[dict]:
    """`input` as chat messages. Consecutive assistant text and function_call items become one
    assistant turn (as a chat model wrote them); reasoning items are dropped (chat templates
    do not render past reasoning)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict] = []
    for i, item in enumerate(value):
        kind = _item_type(item)
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise OpenAIError(400, f"message role {role!r} is not supported; use one of "
                                       f"{', '.join(MESSAGE_ROLES)}", param=f"input.{i}.role")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), f"input.{i}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i),
                                 "arguments": template_arguments(_string(item, "arguments", i))}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and i > 0 \
                    and _item_type(value[i - 1]) in ("message", "function_call"):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                             "content": _text(item.get("output"), f"input.{i}.output")})
        elif kind != "reasoning":
            raise OpenAIError(400, f"input item type {kind!r} is not supported; use one of "
                                   f"{', '.join(INPUT_ITEMS)}", param=f"input.{i}.type")
    return messages


def _item_type(item: dict):
    return item.get("type") or "message"    # OpenAI's "easy" messages leave the type out


def _string(item: dict, key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise OpenAIError(400, f"{item.get('type')} items need a string {key}",
                          param=f"input.{i}.{key}")
    return value


def template_arguments(text: str):
    """A call's arguments as the template renders them: the object when they are a JSON object
    (templates write `arguments | tojson`), else the text as given."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _text(content, param: str) -> str:
    """A message's content (a string or text parts) as one string; other parts are refused
    (the model reads text only)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(400, "content must be a string or a list of input_text parts",
                          param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise OpenAIError(400, f"content part type {kind!r} is not supported: this model "
                                   "reads text only (parts of type 'input_text' with a 'text' "
                                   "string)", param=f"{param}.{j}")
        texts.append(part["text"])
    return "\n".join(texts)


# The chat request's field names in errors, as the Responses request spells them.
_RENAMED = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
            "response_format": "text.format", "reasoning_effort": "reasoning.effort",
            "messages": "input"}
_RENAMED_IN_TEXT = re.compile(r"\b(max_completion_tokens|max_tokens|response_format|"
                              r"reasoning_effort)\b")


def responses_error(err: OpenAIError) -> OpenAIError:
    """An error of the chat path with the Responses request's field names."""
    param = err.param
    if param:
        head, _, rest = param.partition(".")
        param = _RENAMED.get(head, head) + ("." + rest if rest else "")
    message = _RENAMED_IN_TEXT.sub(lambda m: _RENAMED[m.group(1)], err.message)
    return OpenAIError(err.status, message, err.type, param)
