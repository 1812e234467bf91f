"""Verification of draft tokens (speculative decoding) for point-mass drafts (n-gram, suffix).

Each draft position and the bonus position of a row is sampled by the ordinary sampler
(`sampler.sample`) with the request's own settings and the noise of its output position. A draft
d is accepted iff the target's sample equals d; the first mismatch emits the target's sample
(the correction token) and ends the row; a fully accepted row also emits the bonus sample.

Why this is exact rejection sampling: the target's sample t ~ p, so P(accept d) = p(d) = the
rule min(1, p(d) / q(d)) for a one-hot q; given a rejection, t ~ p restricted to tokens != d and
renormalised = max(p - q, 0) normalised. Greedy rows accept iff argmax == d. Because the noise
is keyed by (seed, output position), the emitted tokens are the very tokens decoding without
speculation would sample: a seeded request gives the same text either way.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def emitted_mask(token_ids, draft_ids, group_start):
    """token_ids [R] sampled per row; draft_ids [R]: the draft each row's sample verifies (-1 on
    a row's bonus position and on padding); group_start [R]: the row of the same request's first
    sampling row. Returns [R] bool: the row's sample is emitted (every earlier row of its request
    sampled its draft)."""
    miss = (token_ids != draft_ids).astype(jnp.int32)
    before = jnp.cumsum(miss) - miss                  # mismatches in rows [0, r)
    return before - before[group_start] == 0


def accept(sampled: np.ndarray, drafts: list[int]) -> int:
    """Host side: how many of `drafts` the samples [len(drafts) + 1] accept; the emitted tokens
    are sampled[:accept + 1]."""
    for j, d in enumerate(drafts):
        if int(sampled[j]) != d:
            return j
    return len(drafts)
