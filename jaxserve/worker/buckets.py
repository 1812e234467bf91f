"""The step programs' token buckets: the padded token counts a step runs at (worker/model_runner.py
compiles one program per bucket and variant)."""

from __future__ import annotations

LINEAR_ABOVE = 512      # past this many tokens, buckets step by this many (not by doubling)


def token_buckets(max_tokens: int, smallest: int = 16, one_token: bool = True) -> list[int]:
    """1 and 2 (batch-1 and batch-2 decode: no work for padding tokens through the layers, the
    attention rows and the sampler), then powers of two from `smallest` up to `LINEAR_ABOVE`
    tokens, then steps of `LINEAR_ABOVE` up to max_tokens: a step of 4,100 tokens runs at 4,608,
    not 8,192 (padding at most 1/2 of a step up to 512 tokens, 11% past 4,096; doubling padded up
    to 2x at every size). (The 1-token step writes the KV cache with a second, dropped index:
    XLA:CPU copies the whole pool for a one-element scatter, 3 s a step: attention/kv_cache.py's
    `write`.)
    one_token=False (speculative decoding) leaves out 1: a lone request's decode step then has
    room for one draft at no extra cost (`Proposer.fit`'s free room), as before the 1-token
    bucket existed."""
    buckets, b = [t for t in ((1, 2) if one_token else (2,)) if t < max_tokens], smallest
    while b < max_tokens:
        buckets.append(b)
        b = b * 2 if b < LINEAR_ABOVE else b + LINEAR_ABOVE
    return buckets + [max_tokens]


def pow2_at_least(n: int, smallest: int = 16) -> int:
    b = smallest
    while b < n:
        b *= 2
    return b
