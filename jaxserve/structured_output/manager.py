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
- `bitmask(rows)` fills `[n, ceil(V / 32)]` int32 for the step's constrained sampling rows with
  llguidance's batched, GIL-free fill (bit j of word w set: token 32 * w + j is allowed). The
  model's EOS ids are the llguidance tokenizer's EOS tokens, so EOS is allowed exactly where the
  grammar is complete.
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
from jaxserve.structured_output.grammar import cache_key, compile_matcher

logger = logging.getLogger(__name__)


class StructuredRequest:
    """One request's grammar state: an llguidance matcher that has consumed its outputs."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (matcher now in its error state) if the grammar
        does not allow it."""
        ok = self.matcher.consume_token(token_id)
        self.num_accepted += ok
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative tokens)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens; {self.num_accepted} were "
                             "accepted")
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: "
                               f"{self.matcher.get_error()}")
        self.num_accepted -= num_tokens

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of `token_ids` (e.g. draft tokens) the grammar accepts in a row from here;
        the state does not change."""
        return self.matcher.validate_tokens(token_ids)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and can take no further token (only EOS)."""
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
    model's logits width; `eos_token_ids`: the model's EOS ids."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = 256):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.cache_size = cache_size
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
        template = compile_matcher(params, self.ll_tokenizer)
        with self._lock:
            self._cache[key] = template
            self.stats.compiles += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return template

    def new_request(self, sampling_params: SamplingParams) -> StructuredRequest | None:
        """A fresh grammar state for one (child) request, or None when it is unconstrained."""
        spec = sampling_params.structured_outputs
        if spec is None:
            return None
        return StructuredRequest(self.compile(spec).deep_copy())

    def bitmask(self, requests: list[StructuredRequest]) -> np.ndarray:
        """[len(requests), mask_words] int32: the tokens each request may sample next."""
        mask = np.zeros((len(requests), self.mask_words), np.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        fill_next_token_bitmask_par(self._executor,
                                    [(r.matcher, i) for i, r in enumerate(requests)], mask)
        return mask

    def bitmask_with_drafts(self, requests: list[StructuredRequest],
                            drafts: list[list[int]]) -> np.ndarray:
        """For speculative decoding: [sum(1 + len(d)), mask_words] int32, per request the
        allowed tokens now and after each of its draft tokens in turn (rows in that order; the
        rows after a draft token the grammar refuses are all zero). No state changes."""
        rows = [1 + len(d) for d in drafts]
        mask = np.zeros((sum(rows), self.mask_words), np.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        starts = np.cumsum([0] + rows[:-1]).tolist()
        fill_next_token_bitmask_par_with_draft_tokens(
            self._executor, [(r.matcher, s, list(d)) for r, s, d in zip(requests, starts, drafts)],
            mask)
        return mask
