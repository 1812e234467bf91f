"""`tool_choice` "required" and a named function: the JSON schema that forces a valid call (the
output is then constrained by structured output), and the parsers that read such an output.

    required: [{"name": <one of the tools>, "parameters": <that tool's schema>}, ...]
    named:    <the function's parameters object>          (vLLM's shapes)

Unlike vLLM, a `required` item admits no keys besides name and parameters (a small model would
otherwise wander into made-up keys), `parallel_tool_calls: false` caps the array at one call, and
the JSON is compact (protocol.py sets `disable_any_whitespace`, as OpenAI's arguments look; free
whitespace lets a small model indent until max_tokens).
"""

from __future__ import annotations

import copy

from jaxserve.server.openai.tool_parsers.base import (
    CallState,
    ParsedOutput,
    ToolParser,
    json_call_array,
)

_EMPTY_OBJECT = {"type": "object", "properties": {}}


def _parameters(tool: dict) -> dict:
    return copy.deepcopy(tool["function"].get("parameters") or _EMPTY_OBJECT)


def tool_choice_schema(tool_choice, tools: list[dict], parallel_tool_calls: bool = True
                       ) -> dict | None:
    """The JSON schema for `tool_choice`, or None when the output is free ("none", "auto").
    `tools` must already be validated (see protocol.py)."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        tool = next(t for t in tools if t["function"]["name"] == name)
        return _parameters(tool)
    if tool_choice != "required":
        return None
    defs: dict = {}
    items = []
    for tool in tools:
        params = _parameters(tool)
        for key, value in params.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise ValueError(f"Tool definition '{key}' has multiple schemas, which is not "
                                 "supported.")
            defs[key] = value
        items.append({"properties": {"name": {"type": "string",
                                              "enum": [tool["function"]["name"]]},
                                     "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class NamedToolParser(ToolParser):
    """The whole output is the arguments of the named function, sent as generated."""

    name = "named"

    def __init__(self, function_name: str):
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput(None, [CallState(self.function_name, text, text if final else None,
                                             verbatim=True)])

    def extract(self, text: str) -> ParsedOutput:
        return self.parse(text, final=True)


class RequiredToolParser(ToolParser):
    """The output is a JSON array of {"name", "parameters"} objects."""

    name = "required"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        body = text.lstrip()
        if not body:
            if final:
                raise ValueError("no tool calls")
            return ParsedOutput(None, [])
        if not body.startswith("["):
            raise ValueError("tool_choice 'required' output must be a JSON array")
        return ParsedOutput(None, json_call_array(body, final))
