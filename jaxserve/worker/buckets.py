"""The step programs' token buckets: the padded token counts a step runs at (worker/model_runner.py
compiles one program per bucket and variant)."""

from __future__ import annotations

LINEAR_ABOVE = 512      # past this many tokens, buckets step by this many (not by doubling)


def token_buckets(max_tokens: int, smallest: int = 16, few_rows: bool = False) -> list[int]:
    """1 and 2 (batch-1 and batch-2 decode: no work for padding tokens through the layers, the
    attention rows and the sampler; with `few_rows` also 4 and 8), then powers of two from
    `smallest` up to `LINEAR_ABOVE` tokens, then steps of `LINEAR_ABOVE` up to max_tokens: a step
    of 4,100 tokens runs at 4,608, not 8,192 (padding at most 1/2 of a step up to 512 tokens, 11%
    past 4,096; doubling padded up to 2x at every size). (The 1-token step writes the KV cache
    with a second, dropped index: XLA:CPU copies the whole pool for a one-element scatter, 3 s a
    step: attention/kv_cache.py's `write`.)
    Speculative decoding keeps them all: a lone request's draft then costs the 2-token step over
    the 1-token one, which `Proposer.fit` weighs (measured step times) like any larger bucket.
    few_rows: the steps' matmuls cost in proportion to their rows, as the fused CPU kernel's do
    (`Int4Weight.fused_max_rows`: it multiplies every row, where XLA's tiles or a GPU read the
    weights once for any few rows): steps of 3-8 tokens (decode at batch 3-8, a lone request
    verifying 2-7 drafts) run at 4 or 8 tokens, not 16 (at 8 rows 2.5-3.5x faster on an AVX2
    CPU, benchmarks/RESULTS.md)."""
    few = (1, 2, 4, 8) if few_rows else (1, 2)
    buckets, b = [t for t in few if t < max_tokens], smallest
    while b < max_tokens:
        buckets.append(b)
        b = b * 2 if b < LINEAR_ABOVE else b + LINEAR_ABOVE
    return buckets + [max_tokens]


def pow2_at_least(n: int, smallest: int = 16) -> int:
    b = smallest
    while b < n:
        b *= 2
    return b


# KV width buckets (runners whose attention loops have static trip counts: the reference path on
# a GPU): block-table widths a step program is compiled for, each a quarter of the next, from
# max_model_len down to no fewer than this many tokens, at most KV_WIDTHS of them.
KV_WIDTH_MIN_TOKENS = 512
KV_WIDTH_STEP = 4
KV_WIDTHS = 4


def kv_widths(max_blocks: int, block_size: int) -> tuple[int, ...]:
    """Block-table widths (in blocks), ascending, the last `max_blocks`: a step runs at the
    smallest that holds every scheduled sequence's blocks, so attention whose loops run over the
    table's whole width reads at most ~KV_WIDTH_STEP x the longest context, not max_model_len
    (max_model_len 8,192: 512, 2,048 and 8,192 tokens; 131,072: 2,048 up to 131,072)."""
    widths, w = [max_blocks], max_blocks
    while len(widths) < KV_WIDTHS:
        w = -(-w // KV_WIDTH_STEP)
        if w * block_size < KV_WIDTH_MIN_TOKENS or w == widths[-1]:
            break
        widths.append(w)
    return tuple(sorted(widths))
