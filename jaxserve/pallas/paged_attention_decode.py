"""Decode-only paged attention with split-K over long contexts (flash-decoding).

Same contract as `ragged_paged_attention` (jaxserve/pallas/paged_attention.py), restricted to
steps where every real sequence has q_len == 1 (or 0): the engine knows this on the host and
can pick this entry for pure decode steps. Token cu_q_lens[s] is sequence s's query.

Why a second kernel: in a decode step the ragged kernel has one program per (kv head, sequence),
so batch 1-8 with a 32k context keeps a handful of SMs busy streaming the whole context alone.
Here the grid is `(K, S, num_splits)`: program (h, s, j) streams the j-th slice of sequence s's
KV chunks (the slice boundaries come from that sequence's kv_len, so short sequences just idle
in their upper splits) and writes its unnormalised partial (m [R], l [R], acc [R, D]) in f32.
A small jnp combine merges the splits:

    m* = max_j m_j,  w_j = exp(m_j - m*),  out = sum_j w_j acc_j / sum_j w_j l_j

R = max(16, Gp) rows: the G query heads of one kv head (padded to a power of two Gp, and to 16
because Triton's dot wants M >= 16); the extra rows are zero queries, free in a step that is
bound by reading K/V. The inner loop (`kv_loop`) is the ragged kernel's, so masks, sliding
window (chunks before the window are skipped), soft cap, fp8/int8 dequantisation and the dot
precision (HIGHEST for f32 inputs, so a GPU does not round them to TF32) are shared.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.pallas.common import searchsorted
from jaxserve.pallas.paged_attention import (
    DEFAULT_BLOCK_SIZES,
    _is_concrete,
    default_interpret,
    kv_loop,
    scale_operands,
    split_refs,
    triton_params,
    validate_inputs,
    validate_metadata,
    window_operand,
)

# Aim for this many programs in flight (H100: 132 SMs, a few programs each) when choosing splits.
TARGET_PROGRAMS = 512
MAX_SPLITS = 64


def default_num_splits(num_kv_heads: int, num_seqs: int, max_chunks: int) -> int:
    """Enough splits to fill the GPU, never more than there are KV chunks (a power of two)."""
    want = pl.cdiv(TARGET_PROGRAMS, max(1, num_kv_heads * num_seqs))
    return int(max(1, min(pl.next_power_of_2(want), MAX_SPLITS, max_chunks)))


def _decode_kernel(q_lens_ref, kv_lens_ref, bt_ref, q_ref, k_ref, v_ref, *rest, sm_scale,
                   block_size, kv_block, num_splits, sliding_window, soft_cap, quantized,
                   layer_window):
    # q_ref [R, D]; k_ref/v_ref [N*B, K, D]; ks_ref/vs_ref [N*B, K]; window_ref [1] int32;
    # outputs: acc_ref [R, D] f32, m_ref [R] f32, l_ref [R] f32 (this split's partials)
    ks_ref, vs_ref, window_ref, (acc_ref, m_ref, l_ref) = split_refs(rest, quantized, layer_window)
    if layer_window:
        sliding_window = window_ref[0]
    kh, seq, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    R, D = q_ref.shape
    C = kv_block
    kv_len = kv_lens_ref[seq]
    active = q_lens_ref[seq] > 0
    pos = kv_len - 1                                              # the query's position
    c_first = jnp.int32(0)
    if sliding_window is not None:
        c_first = lax.div(jnp.maximum(pos - sliding_window + 1, 0), jnp.int32(C))
    c_end = jnp.where(active, lax.div(kv_len + C - 1, jnp.int32(C)), c_first)
    per_split = lax.div(c_end - c_first + num_splits - 1, jnp.int32(num_splits))
    c_lo = jnp.minimum(c_first + split * per_split, c_end)
    c_hi = jnp.minimum(c_lo + per_split, c_end)
    row_pos = jnp.full((R, C), pos, jnp.int32)
    row_ok = jnp.full((R, C), True)
    m, l, acc = kv_loop(q_ref[...], seq, kh, row_pos, row_ok, c_lo, c_hi, bt_ref, k_ref, v_ref,
                        ks_ref, vs_ref, kv_block=C, block_size=block_size, sm_scale=sm_scale,
                        sliding_window=sliding_window, soft_cap=soft_cap)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _decode_impl(q, k_cache, v_cache, meta, k_scale, v_scale, *, sm_scale, sliding_window,
                 soft_cap, kv_tokens, num_splits, interpret):
    T, H, D = q.shape
    N, B, K, _ = k_cache.shape
    S, M = meta.block_tables.shape
    G = H // K
    gp = pl.next_power_of_2(G)
    R = max(16, gp)
    C = max(pl.next_power_of_2(kv_tokens), B)
    if num_splits is None:
        num_splits = default_num_splits(K, S, pl.cdiv(M * B, C))
    cu = meta.cu_q_lens.astype(jnp.int32)
    real = jnp.arange(S) < meta.num_seqs.reshape(-1)[0]
    q_lens = jnp.where(real, cu[1:] - cu[:-1], 0).astype(jnp.int32)    # 0 or 1
    tok = jnp.clip(cu[:-1], 0, T - 1)                                  # [S] each query's token
    qs = q[tok].reshape(S, K, G, D)
    qs = jnp.where((q_lens > 0)[:, None, None, None], qs, 0)
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, R - G), (0, 0))).transpose(1, 0, 2, 3)  # [K, S, R, D]

    quantized = k_scale is not None
    whole = pl.BlockSpec()
    operands = [q_lens, meta.kv_lens.astype(jnp.int32), meta.block_tables.astype(jnp.int32), qs,
                k_cache.reshape(N * B, K, D), v_cache.reshape(N * B, K, D)]
    in_specs = [whole] * 3 + [pl.BlockSpec((None, None, R, D), lambda h, s, j: (h, s, 0, 0)),
                              whole, whole]
    if quantized:
        operands += scale_operands(k_scale, v_scale)
        in_specs += [whole, whole]
    window = window_operand(meta)
    operands += window
    in_specs += [whole] * len(window)
    kernel = functools.partial(
        _decode_kernel, sm_scale=float(sm_scale), block_size=B, kv_block=C,
        num_splits=num_splits, sliding_window=sliding_window, soft_cap=soft_cap,
        quantized=quantized, layer_window=bool(window))
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(K, S, num_splits),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, R, D), lambda h, s, j: (h, s, j, 0, 0)),
                   pl.BlockSpec((None, None, None, R), lambda h, s, j: (h, s, j, 0)),
                   pl.BlockSpec((None, None, None, R), lambda h, s, j: (h, s, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((K, S, num_splits, R, D), jnp.float32),
                   jax.ShapeDtypeStruct((K, S, num_splits, R), jnp.float32),
                   jax.ShapeDtypeStruct((K, S, num_splits, R), jnp.float32)],
        interpret=interpret,
        name="paged_attention_decode_split_k",
        compiler_params=triton_params(),
    )(*operands)
    out = combine_splits(acc, m, l)[:, :, :G]                          # [K, S, G, D]
    out = out.transpose(1, 0, 2, 3).reshape(S, H, D)
    # scatter back to token order; tokens that are not some real sequence's query get zeros
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.clip(searchsorted(cu[1:], t, side="right"), 0, S - 1)
    is_query = (t < cu[-1]) & real[seq] & (cu[seq] == t) & (q_lens[seq] > 0)
    return jnp.where(is_query[:, None, None], out[seq], 0).astype(q.dtype)


def combine_splits(acc, m, l):
    """Merge split-K partials: acc [..., P, R, D], m/l [..., P, R] -> [..., R, D] f32."""
    m_max = jnp.max(m, axis=-2, keepdims=True)
    w = jnp.exp(m - m_max)                                             # empty splits: l = 0
    l_tot = jnp.sum(w * l, axis=-2)
    o = jnp.sum(w[..., None] * acc, axis=-3)
    return o / jnp.where(l_tot == 0.0, 1.0, l_tot)[..., None]


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "kv_tokens", "num_splits", "interpret"))
def _decode_jit(q, k_cache, v_cache, meta, k_scale, v_scale, **static):
    return _decode_impl(q, k_cache, v_cache, meta, k_scale, v_scale, **static)


def ragged_paged_attention_decode(q, k_cache, v_cache, meta: Any, *, sm_scale: float,
                                  sliding_window: int | None = None,
                                  soft_cap: float | None = None, k_scale=None, v_scale=None,
                                  interpret: bool | None = None, num_splits: int | None = None,
                                  kv_tokens: int | None = None):
    """Split-K decode attention; `ragged_paged_attention`'s contract with every q_len <= 1.

    num_splits=None picks enough splits to fill the GPU (`default_num_splits`).
    """
    validate_inputs(q, k_cache, v_cache, meta, sm_scale=sm_scale, sliding_window=sliding_window,
                    soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale)
    if num_splits is not None and not (isinstance(num_splits, int) and num_splits >= 1):
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    concrete = all(_is_concrete(a) for a in (meta.cu_q_lens, meta.kv_lens, meta.block_tables,
                                             meta.num_seqs))
    if concrete:
        validate_metadata(meta, q.shape[0], k_cache.shape[0], k_cache.shape[1])
        q_lens = np.diff(np.asarray(meta.cu_q_lens))[: int(np.asarray(meta.num_seqs).reshape(-1)[0])]
        if np.any(q_lens > 1):
            raise ValueError(f"decode path needs every q_len <= 1, got max {int(q_lens.max())}; "
                             "use ragged_paged_attention for prefill chunks")
    if interpret is None:
        interpret = default_interpret()
    if kv_tokens is None:
        kv_tokens = DEFAULT_BLOCK_SIZES[q.shape[-1]].kv_tokens
    return _decode_jit(q, k_cache, v_cache, meta, k_scale, v_scale, sm_scale=float(sm_scale),
                       sliding_window=None if sliding_window is None else int(sliding_window),
                       soft_cap=None if soft_cap is None else float(soft_cap),
                       kv_tokens=int(kv_tokens), num_splits=num_splits, interpret=bool(interpret))
