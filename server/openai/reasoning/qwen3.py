"""`qwen3`: Qwen3 (and QwQ-style) models write `<think>...</think>` themselves; an output that
does not start with `<think>` (thinking disabled with `enable_thinking: false`, or a model that
never thinks) is all content. An unfinished `<think>` block (cut by max_tokens) is reasoning, the
same streamed and not."""

from __future__ import annotations

from jaxserve.server.openai.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
