"""`hermes`: Hermes 2 Pro / Qwen2.5 / Qwen3 calls, one JSON object per tag pair:

    I'll look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Content is the text before the first `<tool_call>` (right-stripped); a last block whose closing
tag is missing still counts when its JSON is complete (the model stopped at EOS).
"""

from __future__ import annotations

from jaxserve.server.openai.tool_parsers.base import (
    ParsedOutput,
    ToolParser,
    content_or_none,
    json_call,
    streamable_content,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    keeps_special_tokens = True     # <tool_call> is an added (special) token in some vocabularies

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(START)
        if first < 0:
            return ParsedOutput(streamable_content(text, final, (START,)), [])
        calls = []
        pos = first
        while pos >= 0:
            body_start = pos + len(START)
            stop = text.find(END, body_start)
            body = text[body_start:] if stop < 0 else text[body_start:stop]
            body = body.lstrip()
            if body or stop >= 0 or final:
                calls.append(json_call(body, final=final or stop >= 0))
            if stop < 0:
                break
            pos = text.find(START, stop + len(END))
        return ParsedOutput(content_or_none(text[:first].rstrip()), calls)
