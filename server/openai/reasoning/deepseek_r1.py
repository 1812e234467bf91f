"""`deepseek_r1`: DeepSeek-R1 and its distills. Their chat template ends the prompt with
`<think>\\n`, so the output usually starts inside the reasoning: everything up to `</think>` is
reasoning (a leading `<think>`, when generated, is dropped); an output with no `</think>` (cut by
max_tokens) is all reasoning."""

from __future__ import annotations

from jaxserve.server.openai.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    implicit_start = True
