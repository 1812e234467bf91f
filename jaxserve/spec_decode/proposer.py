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
    are compared with the tokens that came after them. Kept per draft, not per verification: a
    draft is judged when every draft before it was accepted, so a request verifying one draft a
    step (a lone request's free room) that gets it accepted each time shows a rate near 1, and
    earns longer drafts, where a count of accepted drafts per verification would stay at 1."""
    drafts: list[int]
    at: int                      # len(tokens) when the drafts were proposed
    accepted: float              # decayed count of drafts accepted ...
    judged: float                # ... of drafts judged (the accepted ones and the first rejected)
    paused: int = 0              # calls left without drafts
    pause_len: int = 4

    @property
    def rate(self) -> float:
        return self.accepted / self.judged

    def expected(self, k: int) -> float:
        """Expected accepted drafts per verification of k drafts: a + a^2 + ... + a^k."""
        a = self.rate
        return float(k) if a >= 1 else a * (1 - a ** k) / (1 - a)


class Proposer:
    """propose(request_id, tokens) -> draft ids (at most num_speculative_tokens);
    finish(request_id, output ids) when a request leaves."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._suffix = (SuffixProposer(config.num_speculative_tokens, config.suffix_max_depth,
                                       config.suffix_min_count, config.suffix_cache_requests)
                        if config.method == "suffix" else None)
        self._tracks: dict[str, _Track] = {}
        # Methods "draft_model" and "eagle3": the drafts the draft model proposed in the last step, by request
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
            # A new request starts cautious: short drafts, and its drafts are worth too little
            # to grow a full step's bucket until it has shown that they get accepted (its record
            # is kept from the drafts proposed, whether or not `fit` let them run).
            tr = self._tracks[request_id] = _Track([], len(tokens), *self.PRIOR)
        elif tr.drafts:
            new = tokens[tr.at:]
            judged = min(len(new), len(tr.drafts))
            n = 0
            while n < judged and new[n] == tr.drafts[n]:
                n += 1
            tr.accepted = self.DECAY * tr.accepted + n
            tr.judged = self.DECAY * tr.judged + n + (n < judged)
            tr.drafts = []
            if tr.expected(k) < c.min_expected_accepted:
                tr.paused, tr.pause_len = tr.pause_len, min(64, tr.pause_len * 2)
        if self._suffix is not None:       # the trie must see every token, paused or not
            drafts = self._suffix.propose(request_id, tokens)
        elif tr.paused:
            drafts = []
        elif c.method in SpeculativeConfig.MODEL_METHODS:
            drafts = list(self.model_drafts.get(request_id, ()))[:k]
        else:
            drafts = propose_ngram(tokens, k, c.prompt_lookup_min, c.prompt_lookup_max)
        if tr.paused:
            tr.paused -= 1
            if not tr.paused:               # try again, with the benefit of the doubt
                tr.accepted, tr.judged = self.PRIOR
            return []
        expected = tr.expected(k)
        if expected >= c.min_expected_accepted and c.min_expected_accepted > 0:
            drafts = drafts[:max(1, min(k, math.ceil(expected) + 1))]
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
        return max(1, min(k, math.ceil(tr.expected(k)) + 2))

    # A new request's record before it has one: (accepted, judged) drafts, a rate of 1/2, as if
    # it had had two verifications; and how much of the record each verification keeps.
    PRIOR = (1.0, 2.0)
    DECAY = 0.7
    # Drafts may push a step into a larger token bucket only when the expected tokens per second
    # of that step beat the step without them by this factor (measurement noise, optimism).
    GROWTH_MARGIN = 1.1

    def fit(self, proposals: dict[str, list[int]], free: int, cost=None,
            tokens: int = 1) -> dict[str, list[int]]:
        """Trim drafts to what pays. `free` draft tokens cost nothing (the step's token bucket
        pads to that many anyway); they go to the drafts most likely to be accepted. Beyond them
        a draft token is kept only when the step's expected tokens per second say so:
        `cost(n)` is the measured (or interpolated) seconds of the step with n draft tokens
        (None: unknown, nothing beyond the free room), `tokens` what it emits without drafts.
        The j-th draft (from 0) of a request is worth a ** (j + 1) tokens, a its per-draft
        acceptance (`rate`); the kept drafts maximise (tokens + worth) / cost, and must beat the free-room
        step by GROWTH_MARGIN."""
        rate = {rid: self.rate(rid) for rid in proposals}
        worth = sorted(((rate[rid] ** (j + 1), j, rid)
                        for rid, d in proposals.items() for j in range(len(d))),
                       key=lambda c: (-c[0], c[1]))
        keep = min(free, len(worth))
        gain = sum(w for w, _, _ in worth[:keep])
        base = cost(keep) if cost is not None and keep < len(worth) else None
        if base is not None:
            best = (tokens + gain) / base * self.GROWTH_MARGIN
            for n in range(keep + 1, len(worth) + 1):
                gain += worth[n - 1][0]
                t = cost(n)
                if t is None:
                    break
                if (tokens + gain) / t > best:
                    best, keep = (tokens + gain) / t, n
        counts = dict.fromkeys(proposals, 0)
        for _, _, rid in worth[:keep]:
            counts[rid] += 1
        return {rid: d[:counts[rid]] for rid, d in proposals.items()}

    def rate(self, request_id: str) -> float:
        """The request's per-draft acceptance (the prior's before it has a record)."""
        tr = self._tracks.get(request_id)
        return tr.rate if tr is not None else self.PRIOR[0] / self.PRIOR[1]

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
