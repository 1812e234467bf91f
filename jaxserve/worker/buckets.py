"""The step programs' token buckets: the padded token counts a step runs at (worker/model_runner.py
compiles one program per bucket and variant)."""

from __future__ import annotations


def token_buckets(max_tokens: int, smallest: int = 16, one_token: bool = True) -> list[int]:
    """1 and 2 (batch-1 and batch-2 decode: no work for padding tokens through the layers, the
    attention rows and the sampler), then powers of two from `smallest` up to max_tokens. (The
    1-token step writes the KV cache with a second, dropped index: XLA:CPU copies the whole pool
    for a one-element scatter, 3 s a step: attention/kv_cache.py's `write`.)
    one_token=False (speculative decoding) leaves out 1: a lone request's decode step then has
    room for one draft at no extra cost (`Proposer.fit`'s free room), as before the 1-token
    bucket existed."""
    buckets, b = [t for t in ((1, 2) if one_token else (2,)) if t < max_tokens], smallest
    while b < max_tokens:
        buckets.append(b)
        b *= 2
    return buckets + [max_tokens]


def pow2_at_least(n: int, smallest: int = 16) -> int:
    b = smallest
    while b < n:
        b *= 2
    return b
