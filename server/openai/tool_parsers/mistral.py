"""`mistral`: Mistral's calls after the `[TOOL_CALLS]` token, in either of its formats:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]   (tokenizer <= v7)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}        (v11 and later)

Content is the text before the first `[TOOL_CALLS]`. Tool call ids are 9 alphanumeric characters,
the only form Mistral's chat templates accept back.
"""

from __future__ import annotations

import json
import re

from jaxserve.server.openai.tool_parsers.base import (
    CallState,
    ParsedOutput,
    ToolParser,
    content_or_none,
    dumps,
    json_call_array,
    json_value_end,
    mistral_call_id,
    streamable_content,
)

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True     # [TOOL_CALLS] and [ARGS] are control tokens

    def new_call_id(self) -> str:
        return mistral_call_id()

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(BOT)
        if first < 0:
            return ParsedOutput(streamable_content(text, final, (BOT,)), [])
        content = content_or_none(text[:first].rstrip())
        rest = text[first + len(BOT):]
        if rest.lstrip().startswith("["):
            return ParsedOutput(content, json_call_array(rest.lstrip(), final))
        segments = rest.split(BOT)
        return ParsedOutput(content, [self._named(seg, final or i < len(segments) - 1)
                                      for i, seg in enumerate(segments)])

    @staticmethod
    def _named(segment: str, complete: bool) -> CallState:
        """`name[ARGS]{...}` (or `name{...}`)."""
        k = segment.find(ARGS)
        brace = segment.find("{")
        if k < 0 and brace < 0:
            if complete:
                raise ValueError("a [TOOL_CALLS] segment without arguments")
            return CallState()
        cut = k if k >= 0 else brace
        name = segment[:cut].strip()
        if not _NAME.fullmatch(name):
            raise ValueError(f"invalid tool name {name!r}")
        raw = segment[cut + len(ARGS):] if k >= 0 else segment[cut:]
        end = json_value_end(raw)
        if end is not None:
            if raw[end:].strip() and complete:
                raise ValueError("text after the arguments of a tool call")
            return CallState(name, "", dumps(json.loads(raw[:end])))
        if complete:
            raise ValueError("unfinished tool call arguments")
        return CallState(name, raw)
