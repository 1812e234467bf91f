"""N-gram prompt lookup (vLLM's `ngram` method): find the longest suffix of the token sequence,
between `min_n` and `max_n` tokens long, that occurred earlier in the sequence, and propose the
`k` tokens that followed its most recent earlier occurrence."""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens, k: int, min_n: int, max_n: int) -> list[int]:
    """tokens: prompt + output ids. Returns up to k proposed ids ([] when no n-gram matches)."""
    t = np.asarray(tokens, np.int64)
    L = len(t)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = t[L - n:]
        # Windows of length n that start before the suffix itself: [L - n, n] view.
        windows = np.lib.stride_tricks.sliding_window_view(t[:L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n           # most recent match: the freshest context
            return t[start:start + k].tolist()
    return []
