"""One interface over the proposers, and the per-request opt-out."""

from __future__ import annotations

from jaxserve.config import SpeculativeConfig
from jaxserve.spec_decode.ngram import propose_ngram
from jaxserve.spec_decode.suffix import SuffixProposer


class Proposer:
    """propose(request_id, tokens) -> draft ids (at most num_speculative_tokens);
    finish(request_id, output ids) when a request leaves."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._suffix = (SuffixProposer(config.num_speculative_tokens, config.suffix_max_depth,
                                       config.suffix_min_count, config.suffix_cache_requests)
                        if config.method == "suffix" else None)

    def enabled_for(self, num_prompt_tokens: int, batch_size: int) -> bool:
        """Speculation pays when decode is bound by weight reads: small batches, prompts that
        are not so long that attention dominates."""
        c = self.config
        if c.disable_by_batch_size is not None and batch_size >= c.disable_by_batch_size:
            return False
        return c.max_prompt_len is None or num_prompt_tokens <= c.max_prompt_len

    def propose(self, request_id: str, tokens: list[int]) -> list[int]:
        c = self.config
        if self._suffix is not None:
            return self._suffix.propose(request_id, tokens)
        return propose_ngram(tokens, c.num_speculative_tokens, c.prompt_lookup_min,
                             c.prompt_lookup_max)

    def retain(self, live_ids) -> None:
        """Forget requests that are not in `live_ids` (a container of request ids)."""
        if self._suffix is not None:
            for rid in [r for r in self._suffix.tries if r not in live_ids]:
                self._suffix.finish(rid)

    def finish(self, request_id: str, output_tokens: list[int] | None = None) -> None:
        if self._suffix is not None:
            self._suffix.finish(request_id, output_tokens)


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    return Proposer(config) if config is not None else None
