"""Structured output after reasoning: where a request's output stands relative to its
`<think>...</think>` block, so that its grammar shapes only the answer after it (vLLM's
`structured_outputs_config.reasoning_parser` with `is_reasoning_end`).

Host side, no jax. `EngineArgs.reasoning_parser` (the server's `--reasoning-parser`) names the
markers; the engine gives every constrained request a `ReasoningGate` in one of three phases:
- MAYBE (qwen3, nothing generated yet): the model may open its reasoning; the first token is
  either the grammar's or the start marker (Qwen3's `<think>` is one token). Only for a start
  marker of one token: the first token of a longer one (`<` of `<`,`think`,`>`) cannot be told
  from ordinary text (`<tool_call>`), so with such a tokenizer qwen3 starts at ENDED unless
  the prompt opened the reasoning;
- REASONING: no constraint; each token's bytes are searched for the end marker, so a marker split
  over several tokens (any tokenization) ends it at the token that completes it;
- ENDED: the grammar applies; it has seen none of the reasoning tokens.
Bytes after the end marker inside the token that completes it (`>\\n\\n` when the marker is
several tokens) belong to the answer but not to the grammar (whitespace in practice).

The start phase comes from the prompt: when the prompt ends with the end marker (plus
whitespace; Qwen3's `enable_thinking=False` template writes `<think>\\n\\n</think>\\n\\n`) the
reasoning is over before the output starts; when it ends with the start marker (DeepSeek-R1's
template), the output starts inside it; otherwise deepseek_r1 starts inside it (its model omits
the start tag) and qwen3 at MAYBE (or ENDED, above). A request cut by max_tokens inside its reasoning simply ends
there (finish_reason "length"; the grammar never started).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class ReasoningMarkers:
    start: str = "<think>"
    end: str = "</think>"
    # True: output without the start marker is reasoning anyway (the template wrote the marker)
    implicit_start: bool = False


# Keyed by config.REASONING_PARSERS (the names of the server's reasoning parsers).
REASONING_MARKERS: dict[str, ReasoningMarkers] = {
    "deepseek_r1": ReasoningMarkers(implicit_start=True),
    "qwen3": ReasoningMarkers(implicit_start=False),
}


class Phase(enum.Enum):
    MAYBE = "maybe"
    REASONING = "reasoning"
    ENDED = "ended"


class Verdict(enum.Enum):
    GATE = "gate"          # the token belongs to the reasoning (or is its start marker)
    GRAMMAR = "grammar"    # the reasoning is over (or never began): the grammar takes the token


class ReasoningSpec:
    """The engine's markers as tokens and bytes. `start_ids`: the tokenizer's tokenization of
    the start marker; `token_bytes(ids) -> bytes`."""

    def __init__(self, markers: ReasoningMarkers, start_ids: Sequence[int],
                 token_bytes: Callable[[list[int]], bytes]):
        if not start_ids:
            raise ValueError(f"the reasoning start marker {markers.start!r} has no tokens")
        self.markers = markers
        self.start_ids = tuple(int(t) for t in start_ids)
        self.start = markers.start.encode()
        self.end = markers.end.encode()
        self.decode = token_bytes

    # Prompt tokens read to find a marker at the prompt's end (the marker and trailing space).
    PROMPT_TAIL_TOKENS = 64

    def gate_for_prompt(self, prompt_token_ids: Sequence[int]) -> ReasoningGate:
        tail = self.decode(list(prompt_token_ids[-self.PROMPT_TAIL_TOKENS:]))
        s, e = tail.rfind(self.start), tail.rfind(self.end)
        if e >= 0 and e > s and not tail[e + len(self.end):].strip():
            return ReasoningGate(self, Phase.ENDED)
        if s >= 0 and s > e and not tail[s + len(self.start):].strip():
            return ReasoningGate(self, Phase.REASONING)
        if self.markers.implicit_start:
            return ReasoningGate(self, Phase.REASONING)
        return ReasoningGate(self, Phase.MAYBE if self.start_token is not None else Phase.ENDED)

    @property
    def start_token(self) -> int | None:
        """The start marker's token when it is one token (what MAYBE allows besides the
        grammar), else None."""
        return self.start_ids[0] if len(self.start_ids) == 1 else None


class ReasoningGate:
    """One request's phase (see the module docstring); `advance(token)` moves it and says whose
    token it was."""

    __slots__ = ("spec", "phase", "tail")

    def __init__(self, spec: ReasoningSpec, phase: Phase, tail: bytes = b""):
        self.spec = spec
        self.phase = phase
        self.tail = tail               # the last len(end) - 1 reasoning bytes (REASONING)

    @property
    def ended(self) -> bool:
        return self.phase is Phase.ENDED

    def copy(self) -> ReasoningGate:
        return ReasoningGate(self.spec, self.phase, self.tail)

    def advance(self, token_id: int) -> Verdict:
        spec, phase = self.spec, self.phase
        if phase is Phase.ENDED:
            return Verdict.GRAMMAR
        if phase is Phase.MAYBE:
            if token_id == spec.start_token:
                self.phase = Phase.REASONING
                return Verdict.GATE
            self.phase = Phase.ENDED           # no reasoning: the answer starts here
            return Verdict.GRAMMAR
        data = self.tail + spec.decode([token_id])
        if spec.end in data:
            self.phase, self.tail = Phase.ENDED, b""
        else:
            self.tail = data[max(0, len(data) - (len(spec.end) - 1)):]
        return Verdict.GATE
