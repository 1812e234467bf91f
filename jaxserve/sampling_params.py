"""`SamplingParams`: how to sample one request's tokens, with vLLM's fields, defaults and messages.

Host side, no jax. Validation happens once in `__post_init__` and raises `ValueError` naming the
field and its allowed range, so every entry point (LLM, server, batch) reports the same text.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are treated as greedy (vLLM's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-5


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0   # every output carries all text/tokens so far
    DELTA = 1        # every output carries only what is new since the last one
    FINAL_ONLY = 2   # one output, when the request finishes


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's `StructuredOutputsParams`): exactly one of `json` (a
    JSON schema, dict or JSON text), `regex`, `choice` (a list of strings), `grammar` (Lark or
    EBNF text), `json_object` (any JSON object) or `structural_tag` (vLLM's JSON text) is set.

    `unbounded_json_numbers` (jaxserve's; vLLM has none): by default the JSON integers and
    numbers a schema leaves unbounded, and those of free JSON values, are bounded so that a
    sampled number cannot run to max_tokens: integers to int64 (from -2**63 + 1024), numbers to
    |x| <= 1e18 with at most 10 digits after the point and no exponent
    (`structured_output/json_numbers.py`); a schema's own minimum/maximum/multipleOf are kept.
    True lifts these bounds (any JSON number literal, as in vLLM). From the server:
    `"structured_outputs": {"json": SCHEMA, "unbounded_json_numbers": true}`.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    unbounded_json_numbers: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(self.KINDS)}; got {given or 'none'}.")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) \
                    or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, "
                                 f"got {self.choice!r}.")
            self.choice = list(self.choice)
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got "
                                 f"{type(value).__name__}.")
        if not isinstance(self.unbounded_json_numbers, bool):
            raise ValueError("structured_outputs.unbounded_json_numbers must be a bool, got "
                             f"{self.unbounded_json_numbers!r}.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or JSON text), "
                             f"got {type(self.json).__name__}.")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """Sampling parameters for text generation (vLLM's `SamplingParams`).

    `top_k` of -1 is accepted and normalised to 0 (disabled). `stop` is normalised to a list of
    strings, `stop_token_ids` to a list of ints, `logit_bias` keys to ints (clamped to [-100, 100]
    as OpenAI does). With `temperature < 1e-5` sampling is greedy and top_p/top_k/min_p are reset.

    The engine calls `update_from_tokenizer(eos_token_ids)` once per request; after that
    `all_stop_token_ids` is the set of token ids that end generation (EOS unless `ignore_eos`,
    plus `stop_token_ids`), which the sampler masks until `min_tokens` outputs exist.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Derived, not constructor arguments.
    output_text_buffer_length: int = field(default=0, init=False)
    _eos_token_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False)

    def __post_init__(self) -> None:
        if self.best_of is not None and isinstance(self.best_of, int) and isinstance(self.n, int) \
                and self.best_of < self.n:
            raise ValueError(f"best_of must be greater than or equal to n, got n={self.n} and "
                             f"best_of={self.best_of}.")
        if self.seed == -1:
            self.seed = None
        if self.top_k == -1:
            self.top_k = 0
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        ids = self.stop_token_ids or []
        if not isinstance(ids, (list, tuple)) \
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}.")
        self.stop_token_ids = [int(t) for t in ids]
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must map token ids (int or numeric str) to floats, "
                                 f"got {self.logit_bias!r}.")
            try:
                bias = {int(tok): float(value) for tok, value in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError("logit_bias must map token ids (int or numeric str) to floats, "
                                 f"got {self.logit_bias!r}.") from None
            bad = next((t for t, v in bias.items() if t < 0 or not math.isfinite(v)), None)
            if bad is not None:
                raise ValueError(f"logit_bias must map non-negative token ids to finite numbers, "
                                 f"got {bad}: {bias[bad]}.")
            self.logit_bias = {tok: min(100.0, max(-100.0, v)) for tok, v in bias.items()}
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None \
                and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict, got "
                             f"{type(self.structured_outputs).__name__}.")
        if isinstance(self.output_kind, int):
            self.output_kind = RequestOutputKind(self.output_kind)
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the filters are meaningless, reset them so the sampler can skip them.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")
        # The detokenizer holds back this many characters in DELTA mode so a stop string that
        # arrives split across tokens is never streamed out before it is recognised.
        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1
        self._eos_token_ids = frozenset()

    def _verify_args(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {type(value).__name__}.")
        for name in ("max_tokens", "logprobs", "prompt_logprobs", "seed", "best_of"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an int or None, got {type(value).__name__}.")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}.")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits ([-2**63, 2**64)), got {self.seed}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got "
                             f"{self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got "
                             f"{self.repetition_penalty}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got "
                             f"{self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to "
                             f"max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if any(not isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True. "
                             "Set detokenize=True to use stop.")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}.")
        if self.best_of is not None and self.best_of != self.n \
                and self.output_kind == RequestOutputKind.DELTA:
            raise ValueError("best_of must equal n to use output_kind=DELTA")

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """Build from kwargs where None means "use the default" (the server's request bodies)."""
        keep_none = {"best_of", "seed", "stop", "stop_token_ids", "max_tokens", "logprobs",
                     "prompt_logprobs", "logit_bias", "extra_args", "structured_outputs"}
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k in keep_none})

    # --- derived properties -------------------------------------------------------------------

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    def update_from_tokenizer(self, eos_token_ids: int | Iterable[int] | None) -> None:
        """Record the model's EOS token id(s); call once when the request enters the engine."""
        if eos_token_ids is None:
            ids: Iterable[int] = ()
        elif isinstance(eos_token_ids, int):
            ids = (eos_token_ids,)
        else:
            ids = eos_token_ids
        self._eos_token_ids = frozenset(int(t) for t in ids)

    def update_from_generation_config(self, generation_config: dict[str, Any],
                                      model_eos_token_id: int | None = None) -> None:
        """vLLM's spelling: the EOS ids are the model's plus generation_config's."""
        ids = set(self._eos_token_ids)
        if model_eos_token_id is not None:
            ids.add(int(model_eos_token_id))
        extra = generation_config.get("eos_token_id")
        if extra is not None:
            ids.update([extra] if isinstance(extra, int) else extra)
        self._eos_token_ids = frozenset(ids)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The EOS ids given by `update_from_tokenizer` (stop generation unless ignore_eos)."""
        return self._eos_token_ids

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """Every token id that ends generation: EOS (unless ignore_eos) and stop_token_ids."""
        eos = frozenset() if self.ignore_eos else self._eos_token_ids
        return eos | frozenset(self.stop_token_ids)

    def clone(self) -> SamplingParams:
        """A deep copy (n > 1 children and per-request updates must not share lists/dicts)."""
        return copy.deepcopy(self)

    def replace(self, **changes: Any) -> SamplingParams:
        """A validated copy with some fields changed; keeps the recorded EOS ids."""
        new = dataclasses.replace(self, **changes)
        new._eos_token_ids = self._eos_token_ids
        return new
