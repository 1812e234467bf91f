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
