"""Structured output on the host: compiled grammars (cached), one matcher per request, and the
per-step token bitmask of the constrained rows.

Host side, no jax. The engine owns one `StructuredOutputManager`:
- `compile(params)` builds (or finds in an LRU cache keyed by the spec) a matcher in its initial
  state; it raises ValueError naming the field for an invalid spec. Thread-safe: the async
  server calls it in a thread pool before queueing the request, so the event loop never waits
  on a compile and the engine's own call is a cache hit.
- `new_request(sampling_params)` -> `StructuredRequest`, a deep copy of the cached matcher; the
  scheduler keeps it on the `Request` (`request.structured`), feeds it every sampled token and
  finishes the request ("stop") when the grammar can take nothing more. Preemption keeps it:
  recomputed tokens are never sampled again, so they are never fed twice.
- `bitmask(requests, drafts)` fills `[n, ceil(V / 32)]` int32 for the step's constrained
  sampling rows, one row per verified position (speculative decoding: now and after each draft),
  with llguidance's batched, GIL-free fill (bit j of word w set: token 32 * w + j is allowed).
  The model's EOS ids are the llguidance tokenizer's EOS tokens, so EOS is allowed exactly where
  the grammar is complete.
- With a reasoning parser each request also has a `ReasoningGate` (`reasoning.py`): the grammar
  neither masks nor advances until the output has closed its reasoning.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
from jaxserve.structured_output.grammar import COMPACT_JSON_WHITESPACE, cache_key, compile_matcher
from jaxserve.structured_output.reasoning import (
    REASONING_MARKERS,
    Phase,
    ReasoningGate,
    ReasoningMarkers,
    ReasoningSpec,
    Verdict,
)

logger = logging.getLogger(__name__)


class StructuredRequest:
    """One request's grammar state: an llguidance matcher that has consumed its outputs (those
    after its reasoning, when the engine has a reasoning parser: `gate`)."""

    def __init__(self, matcher: llguidance.LLMatcher, gate: ReasoningGate | None = None):
        self.matcher = matcher
        self.gate = gate
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (matcher now in its error state) if the grammar
        does not allow it. Reasoning tokens are not the grammar's: always True."""
        if self.gate is not None and not self.gate.ended:
            if self.gate.advance(token_id) is Verdict.GATE:
                return True
        ok = self.matcher.consume_token(token_id)
        self.num_accepted += ok
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` tokens the grammar accepted."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens; {self.num_accepted} were "
                             "accepted")
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: "
                               f"{self.matcher.get_error()}")
        self.num_accepted -= num_tokens

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of `token_ids` (e.g. draft tokens) are allowed in a row from here, the
        reasoning gate included; the state does not change."""
        token_ids = list(token_ids)
        if self.gate is not None and self.gate.phase is Phase.MAYBE:
            return 0    # the grammar's first token or the start marker: not worth drafting
        g = self.reasoning_rows(token_ids)
        if g > len(token_ids):
            return len(token_ids)
        rest = token_ids[g:]
        return g + (self.matcher.validate_tokens(rest) if rest else 0)

    def reasoning_rows(self, token_ids: list[int]) -> int:
        """Of the positions now and after each of `token_ids` (drafts), how many come first
        inside the reasoning (so the first that many tokens are reasoning, the one completing
        the end marker included); 0 when the grammar applies now. No state changes."""
        gate = self.gate
        if gate is None or gate.ended:
            return 0
        if gate.phase is Phase.MAYBE:
            if token_ids:
                raise ValueError("no drafts before a request's first token (reasoning MAYBE)")
            return 0
        gate = gate.copy()
        for i, t in enumerate(token_ids):
            gate.advance(t)
            if gate.ended:
                return i + 1
        return len(token_ids) + 1

    @property
    def constrains(self) -> bool:
        """Whether the next token is restricted at all (False inside the reasoning)."""
        return self.gate is None or self.gate.phase is not Phase.REASONING

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and can take no further token (only EOS)."""
        if self.gate is not None and not self.gate.ended:
            return False
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


@dataclasses.dataclass
class CompileStats:
    compiles: int = 0
    cache_hits: int = 0


class StructuredOutputManager:
    """See the module docstring. `tokenizer`: the engine's `Tokenizer`; `vocab_size`: the
    model's logits width; `eos_token_ids`: the model's EOS ids; `reasoning_parser`: a name of
    `reasoning.REASONING_MARKERS` or a `ReasoningMarkers` (grammars then apply after the
    reasoning), or None. `whitespace_pattern`, `disable_any_whitespace`: the engine's JSON
    whitespace rule (`--structured-outputs-config`; None: COMPACT_JSON_WHITESPACE) for requests
    that set none."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = 256,
                 reasoning_parser: str | ReasoningMarkers | None = None, *,
                 whitespace_pattern: str | None = None, disable_any_whitespace: bool = False):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.cache_size = cache_size
        if isinstance(reasoning_parser, str) and reasoning_parser not in REASONING_MARKERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_MARKERS)}, "
                             f"got {reasoning_parser!r}")
        self.reasoning_parser = reasoning_parser
        self.default_whitespace = None if disable_any_whitespace \
            else whitespace_pattern or COMPACT_JSON_WHITESPACE
        self._reasoning: ReasoningSpec | None = None
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._cache: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.stats = CompileStats()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (built once, ~0.3 s): vocabulary as wide as the
        logits (ids past the tokenizer's own vocabulary are never allowed)."""
        with self._lock:
            if self._ll_tokenizer is None:
                n_vocab = max(self.vocab_size, self._tokenizer.vocab_size)
                try:
                    self._ll_tokenizer = llguidance.LLTokenizer(
                        self._tokenizer.backend.to_str(), n_vocab=n_vocab,
                        eos_token=self.eos_token_ids or None)
                except ValueError as e:
                    raise ValueError(f"structured_outputs needs a byte-level BPE or SentencePiece "
                                     f"tokenizer; llguidance cannot read this one: {e}") from None
            return self._ll_tokenizer

    @property
    def reasoning(self) -> ReasoningSpec | None:
        """The reasoning markers as this tokenizer writes them (None: no reasoning parser)."""
        if self.reasoning_parser is None:
            return None
        if self._reasoning is None:
            markers = REASONING_MARKERS.get(self.reasoning_parser, self.reasoning_parser)
            ll = self.ll_tokenizer
            self._reasoning = ReasoningSpec(
                markers, self._tokenizer.encode(markers.start, add_special_tokens=False),
                ll.decode_bytes)
        return self._reasoning
    @property
    def mask_words(self) -> int:
        return (self.ll_tokenizer.vocab_size + 31) // 32

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The initial-state matcher of a spec, from the cache or compiled now (ValueError naming
        the field when the spec is invalid). Do not advance the returned matcher: copy it."""
        key = cache_key(params)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return template
        template = compile_matcher(params, self.ll_tokenizer, self.default_whitespace)
        with self._lock:
            self._cache[key] = template
            self.stats.compiles += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return template

    def new_request(self, sampling_params: SamplingParams,
                    prompt_token_ids: list[int] = ()) -> StructuredRequest | None:
        """A fresh grammar state for one (child) request, or None when it is unconstrained.
        With a reasoning parser the prompt's end says whether the output starts inside the
        reasoning."""
        spec = sampling_params.structured_outputs
        if spec is None:
            return None
        reasoning = self.reasoning
        gate = reasoning.gate_for_prompt(prompt_token_ids) if reasoning is not None else None
        return StructuredRequest(self.compile(spec).deep_copy(), gate)

    def bitmask(self, requests: list[StructuredRequest],
                drafts: list[list[int]] | None = None) -> np.ndarray:
        """[sum(1 + len(d)), mask_words] int32: per request (rows in that order) the tokens it
        may sample now and after each of its draft tokens in turn (speculative decoding;
        `drafts` None: one row each). Rows inside a reasoning are all ones, the rest are the
        grammar's (one batched, GIL-free llguidance fill; the drafts are walked without
        changing any state), plus the start marker on a qwen3-style request's first row.
        Drafts must be valid (`StructuredRequest.validate_tokens`)."""
        drafts = [list(d) for d in drafts] if drafts is not None else [[]] * len(requests)
        sizes = [1 + len(d) for d in drafts]
        mask = np.full((sum(sizes), self.mask_words), -1, np.int32)
        entries, marker_bits, start = [], [], 0
        for req, d, n in zip(requests, drafts, sizes):
            g = req.reasoning_rows(d)       # rows [0, g) are reasoning: all ones
            if g < n:
                mask[start + g:start + n] = 0
                entries.append((req.matcher, start + g, d[g:]))
                if req.gate is not None and req.gate.phase is Phase.MAYBE:
                    marker_bits.append((start, req.gate.spec.start_token))
            start += n
        if entries:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            # (llguidance refuses an empty draft list: rows without drafts take the plain fill)
            plain = [e[:2] for e in entries if not e[2]]
            if plain:
                fill_next_token_bitmask_par(self._executor, plain, mask)
            if len(plain) < len(entries):
                fill_next_token_bitmask_par_with_draft_tokens(
                    self._executor, [e for e in entries if e[2]], mask)
        bits = mask.view(np.uint32)
        for row, token in marker_bits:
            bits[row, token >> 5] |= np.uint32(1 << (token & 31))
        return mask
