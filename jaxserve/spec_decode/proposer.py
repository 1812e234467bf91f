"""One interface over the proposers, and the per-request opt-out."""

from __future__ import annotations

import math
from dataclasses import dataclass

from jaxserve.config import SpeculativeConfig
from jaxserve.spec_decode.ngram import propose_ngram
from jaxserve.spec_decode.suffix import SuffixProposer


@dataclass
class _Track:
    """A request's recent acceptance, learnt from its own tokens: the drafts proposed last time
    are compared with the tokens that came after them."""
    drafts: list[int]
    at: int                      # len(tokens) when the drafts were proposed
    expected: float              # moving average of accepted drafts per verification
    paused: int = 0              # calls left without drafts
    pause_len: int = 4


class Proposer:
    """propose(request_id, tokens) -> draft ids (at most num_speculative_tokens);
    finish(request_id, output ids) when a request leaves."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._suffix = (SuffixProposer(config.num_speculative_tokens, config.suffix_max_depth,
                                       config.suffix_min_count, config.suffix_cache_requests)
                        if config.method == "suffix" else None)
        self._tracks: dict[str, _Track] = {}
        # Method "draft_model": the drafts the draft model proposed in the last step, by request
        # (the runner computes them; the engine hands them over before proposing).
        self.model_drafts: dict[str, list[int]] = {}

    def enabled_for(self, num_prompt_tokens: int, batch_size: int) -> bool:
        """Speculation pays when decode is bound by weight reads: small batches, prompts that
        are not so long that attention dominates."""
        c = self.config
        if c.disable_by_batch_size is not None and batch_size >= c.disable_by_batch_size:
            return False
        return c.max_prompt_len is None or num_prompt_tokens <= c.max_prompt_len

    def propose(self, request_id: str, tokens: list[int]) -> list[int]:
        """Drafts for the tokens after `tokens`. Adaptive opt-out: a request whose drafts keep
        being rejected (fewer than `min_expected_accepted` accepted per verification, moving
        average) pauses speculation for a while (doubling pauses), and draft length follows the
        expected acceptance, so open-ended text pays little for verification."""
        c = self.config
        k = c.num_speculative_tokens
        tr = self._tracks.get(request_id)
        if tr is None:
            # A new request starts at the growth threshold: one rejected draft stops it from
            # growing the step's bucket, a few accepted ones earn full-length drafts.
            tr = self._tracks[request_id] = _Track([], len(tokens), min(float(k),
                                                                        self.GROW_MIN_EXPECTED))
        elif tr.drafts:
            new = tokens[tr.at:]
            n = 0
            while n < min(len(new), len(tr.drafts)) and new[n] == tr.drafts[n]:
                n += 1
            tr.expected = 0.5 * tr.expected + 0.5 * n
            tr.drafts = []
            if tr.expected < c.min_expected_accepted:
                tr.paused, tr.pause_len = tr.pause_len, min(64, tr.pause_len * 2)
        if self._suffix is not None:       # the trie must see every token, paused or not
            drafts = self._suffix.propose(request_id, tokens)
        elif tr.paused:
            drafts = []
        elif c.method == "draft_model":
            drafts = list(self.model_drafts.get(request_id, ()))[:k]
        else:
            drafts = propose_ngram(tokens, k, c.prompt_lookup_min, c.prompt_lookup_max)
        if tr.paused:
            tr.paused -= 1
            if not tr.paused:               # try again, with the benefit of the doubt
                tr.expected = max(tr.expected, 2 * c.min_expected_accepted)
            return []
        if tr.expected >= c.min_expected_accepted and c.min_expected_accepted > 0:
            drafts = drafts[:max(1, min(k, math.ceil(tr.expected) + 1))]
        tr.drafts, tr.at = list(drafts), len(tokens)
        return drafts

    def draft_len(self, request_id: str) -> int:
        """At most how many drafts the next `propose` for the request can use, judged before
        its step (0 while paused; one more than the current trim, as acceptance may grow): a
        draft model computes only that many."""
        c, tr = self.config, self._tracks.get(request_id)
        k = c.num_speculative_tokens
        if tr is None or c.min_expected_accepted <= 0:
            return k
        if tr.paused:
            return 0
        return max(1, min(k, math.ceil(tr.expected) + 2))

    # Expected accepted drafts per verification above which a request's drafts may push the
    # step into a larger (more costly) token bucket: doubling a step's tokens must buy tokens.
    GROW_MIN_EXPECTED = 2.0

    def fit(self, proposals: dict[str, list[int]], free: int) -> dict[str, list[int]]:
        """Trim drafts to what pays: `free` draft tokens cost nothing (the step's token bucket
        pads to that many anyway); they go to the requests most likely to accept. Beyond them
        only requests expecting >= GROW_MIN_EXPECTED accepted drafts keep theirs."""
        order = sorted(proposals, key=lambda r: -self.expected(r))
        out = {}
        for rid in order:
            d = proposals[rid]
            if self.expected(rid) >= self.GROW_MIN_EXPECTED:
                out[rid] = d
            else:
                out[rid] = d[:max(0, free)]
            free -= len(out[rid])
        return out

    def expected(self, request_id: str) -> float:
        tr = self._tracks.get(request_id)
        return tr.expected if tr is not None else min(float(self.config.num_speculative_tokens),
                                                      self.GROW_MIN_EXPECTED)

    def retain(self, live_ids) -> None:
        """Forget requests that are not in `live_ids` (a container of request ids)."""
        for rid in [r for r in self._tracks if r not in live_ids]:
            self.finish(rid)

    def finish(self, request_id: str, output_tokens: list[int] | None = None) -> None:
        self._tracks.pop(request_id, None)
        if self._suffix is not None:
            self._suffix.finish(request_id, output_tokens)


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    return Proposer(config) if config is not None else None
