"""`llama3_json`: Llama 3.1 / 3.2 / 3.3 JSON calls (the "JSON based tool calling" of Meta's
prompt format), optionally after `<|python_tag|>`, several separated by `;`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", ...}

As in vLLM, an output that does not start with `{` or `<|python_tag|>` is plain content, and an
output with calls has no content.
"""

from __future__ import annotations

from jaxserve.server.openai.tool_parsers.base import (
    ParsedOutput,
    ToolParser,
    json_call,
    json_value_end,
)

BOT = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    keeps_special_tokens = True     # <|python_tag|> is a special token

    def parse(self, text: str, final: bool) -> ParsedOutput:
        body = text.lstrip()
        if body.startswith(BOT):
            body = body[len(BOT):].lstrip()
        elif not final and BOT.startswith(body):
            return ParsedOutput(None, [])          # maybe the tag, maybe not: wait
        if not body:
            return ParsedOutput(text if final else None, [])   # only whitespace so far
        if not body.startswith("{"):
            return ParsedOutput(text, [])                      # plain text, no calls
        calls = []
        pos = 0
        while pos < len(body):
            end = json_value_end(body, pos)
            if end is None:
                calls.append(json_call(body[pos:].lstrip(), final))
                break
            calls.append(json_call(body[pos:end].lstrip(), True))
            rest = body[end:].lstrip()
            if not rest.startswith(";"):
                if rest and final:
                    raise ValueError("text after the last tool call")
                break
            rest = rest[1:].lstrip()
            pos = len(body) - len(rest)
        return ParsedOutput(None, calls)
