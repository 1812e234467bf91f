"""Tool call parsers by vLLM's `--tool-call-parser` names. See base.py for the contract."""

from __future__ import annotations

from jaxserve.server.openai.tool_parsers.base import CallState, ParsedOutput, ToolParser
from jaxserve.server.openai.tool_parsers.hermes import HermesToolParser
from jaxserve.server.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from jaxserve.server.openai.tool_parsers.mistral import MistralToolParser
from jaxserve.server.openai.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r} (--tool-call-parser); choose from "
                         f"{', '.join(TOOL_PARSERS)}") from None


__all__ = ["TOOL_PARSERS", "get_tool_parser", "ToolParser", "CallState", "ParsedOutput"]
