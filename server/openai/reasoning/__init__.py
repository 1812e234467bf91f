"""Reasoning parsers by vLLM's `--reasoning-parser` names: split `<think>...</think>` text from
the answer. `split(text, final)` returns (reasoning, content); while streaming (`final=False`) a
partial end tag is held back, so each part only grows."""

from __future__ import annotations

from jaxserve.server.openai.reasoning.base import ReasoningParser
from jaxserve.server.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from jaxserve.server.openai.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r} (--reasoning-parser); choose from "
                         f"{', '.join(REASONING_PARSERS)}") from None


__all__ = ["REASONING_PARSERS", "get_reasoning_parser", "ReasoningParser"]
