"""Compiling a program ahead of time, and saying whether JAX's persistent compilation cache
answered it (the start-up log's "loaded from the compilation cache" vs "compiled").

JAX reports a persistent-cache hit as the monitoring event `/jax/compilation_cache/cache_hits`,
recorded in the thread that compiles; timing cannot tell a fast compile from a slow load. The
listener lives only for one compile and counts its own thread's events, so concurrent compiles
in other threads (another engine, a draft model) are not attributed to this one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import jax

CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

# XLA options of the programs that run the layer scan on a GPU. The scan holds each weight as one
# [layers, ...] stack and slices layer i out of it; a Triton GEMM fusion cannot read a dynamic
# slice, so XLA copied every layer's weights out of the stack before its GEMM (3x the weight
# bytes a decode step must read: 2.65x the step's minimum HBM bytes at batch 1, Llama-3.1-8B,
# in the compile report). Dynamic-slice fusion lets a cuBLAS GEMM read layer i in place at its
# offset, and it applies to cuBLAS calls only, so the dots take cuBLAS (vLLM's GEMMs too). Not
# for FP8 weights: XLA's cuBLAS FP8 GEMM takes per-tensor scales only, so without Triton their
# codes were converted to f32 every layer (7.7x the minimum); Triton GEMMs read them as e4m3.
CUBLAS_IN_PLACE = {"xla_gpu_enable_dynamic_slice_fusion": True, "xla_gpu_enable_triton_gemm": False}
# XLA's dot merger concatenates GEMMs that share an input (wq, wk, wv) into one over a new
# [E, 6144] weight: a copy of those weights every layer. Off (threshold 0 MB).
NO_DOT_MERGER = {"xla_gpu_dot_merger_threshold_mb": 0}


def step_compiler_options(devices, weights=None) -> dict | None:
    """The XLA options of a step program over `weights` compiled for `devices` (None: XLA's
    defaults: every platform but the GPU)."""
    if next(iter(devices)).platform != "gpu":
        return None
    fp8 = any("float8" in str(getattr(x, "dtype", "")) for x in jax.tree_util.tree_leaves(weights))
    return {**NO_DOT_MERGER, **({} if fp8 else CUBLAS_IN_PLACE)}


def compile_noting_cache_hit(compile_fn: Callable[[], jax.stages.Compiled]
                             ) -> tuple[jax.stages.Compiled, bool]:
    """(compile_fn(), whether the persistent compilation cache supplied the program)."""
    me = threading.get_ident()
    hits = []

    def listener(event: str, **_kwargs) -> None:
        if event == CACHE_HIT_EVENT and threading.get_ident() == me:
            hits.append(event)

    jax.monitoring.register_event_listener(listener)
    try:
        exe = compile_fn()
    finally:
        try:
            jax.monitoring.unregister_event_listener(listener)
        except (AssertionError, ValueError):    # someone cleared jax's listeners meanwhile
            pass
    return exe, bool(hits)


def how_obtained(from_cache: bool | str) -> str:
    """from_cache: True (JAX's persistent cache), a program store's kind ("compiled directory",
    "program cache": jaxserve.aot.store) or False."""
    if isinstance(from_cache, str):
        return f"loaded from the {from_cache}"
    return "loaded from the compilation cache" if from_cache else "compiled"
