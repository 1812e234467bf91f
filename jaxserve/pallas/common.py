"""Helpers the kernels and the jnp reference path share. Kernels read the attention metadata by
attribute (`slot_mapping`, `block_tables`, `kv_lens`, `cu_q_lens`, `num_seqs`), so nothing here
imports the engine's attention package."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A layer's window when it has none (global attention in a model whose other layers slide): far
# past any context, so `j > pos - window` holds for every key and no branch is needed.
NO_WINDOW = 1 << 30


def target_platform() -> str:
    """The platform a program being traced is compiled for: the abstract mesh's device where one
    is set (a program lowered for a compile-only H100 from a CPU host, `jaxserve.aot`), else this
    process's default backend. Kernels choose their compiled or interpreted form from this, at
    trace time, never from the host alone (jax >= 0.11; older jax has no abstract device)."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    device = getattr(get(), "abstract_device", None) if get is not None else None
    return device.platform if device is not None else jax.default_backend()


def searchsorted(sorted_array, values, side: str = "left"):
    """`jnp.searchsorted`, in the form for the compile target: on a GPU by comparing every pair
    (one fusion: the default binary search is a `while` loop of ~log2(n) tiny kernels, run by
    every layer that plans its tiles: 576 launches a step for Llama-3.1-8B), elsewhere by the
    default binary search (the CPU's cheaper form at prefill sizes)."""
    method = "compare_all" if target_platform() == "gpu" else "scan"
    return jnp.searchsorted(sorted_array, values, side=side, method=method)


def layer_window(meta, sliding_window):
    """The window attention applies: the call's static `sliding_window` (int or None), or this
    layer's traced one from `meta.sliding_window` [1] (models whose layers differ: Gemma 2/3).
    Raises ValueError when both are given."""
    dynamic = getattr(meta, "sliding_window", None)
    if dynamic is None:
        return sliding_window
    if sliding_window is not None:
        raise ValueError("sliding_window: give the static argument or meta.sliding_window, not both")
    return dynamic.reshape(-1)[0]


def token_layout(meta, num_tokens: int):
    """Per token: its sequence [T], its absolute position [T], whether it is real [T]."""
    cu = meta.cu_q_lens
    S = meta.kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(searchsorted(cu[1:], t, side="right"), 0, S - 1).astype(jnp.int32)
    q_lens = cu[1:] - cu[:-1]
    pos = meta.kv_lens[seq] - q_lens[seq] + (t - cu[seq])
    return seq, pos, t < cu[-1]


def pad_to(x, axis: int, multiple: int):
    """`x` zero-padded at the end of `axis` to a multiple of `multiple` (kernel tiles)."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad)
