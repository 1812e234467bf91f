"""The one timing rule the kernel benchmarks share."""

from __future__ import annotations

import statistics
import time

import jax


def timed(fn, args, iters: int) -> float:
    """Median seconds per call of a jitted fn (compiled and warmed by a first call)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
