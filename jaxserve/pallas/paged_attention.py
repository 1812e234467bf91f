"""Ragged paged attention: one Pallas kernel for mixed decode + chunked-prefill batches.

What it computes (one layer; the contract of docs/internals.md):

    out[t, h] = softmax_j( soft_cap(sm_scale * q[t, h] . K[s, j, h // G]) ) @ V[s, j, h // G]

for every real token t of sequence s, over the cache positions j it may see:
`j <= pos(t)` (causal; this covers the cached prefix and the earlier tokens of the same chunk)
and `j > pos(t) - sliding_window` when a window is set, where
`pos(t) = kv_lens[s] - q_len[s] + (t - cu_q_lens[s])`. K/V come from the paged cache
`[N, B, K, D]` through `block_tables[s]`; fp8/int8 caches carry per-token-head f32 scales
`[N, B, K]` (jaxserve/kv_quant.py). Padding tokens (t >= cu_q_lens[-1]) get zeros.

Grid: `(K, NT)` -- one program per (kv head, query tile). A query tile is up to `bq` consecutive
tokens of ONE sequence, so a decode row is one tile and a prefill chunk of 100 tokens is
ceil(100 / bq) tiles; `NT = min(T, ceil(T / bq) + S)` bounds the tile count statically. The
tile -> (sequence, first query) table is computed in jnp by the wrapper (a cumsum), and q is
gathered into tiles of `R = bq * Gp` rows (row = token * Gp + head), so all G query heads that
share a kv head are one matmul operand and K/V pages are read once per tile, not once per query
head (GQA/MQA of any ratio; G is padded to a power of two Gp). Each program walks its sequence's
KV in chunks of `C = pages_per_block * B` tokens with a `fori_loop` whose bounds come from
kv_len, the tile's causal end and the sliding window -- chunks wholly outside the window or after
the tile's last query are never read. Inside a chunk the page ids are gathered from the block
table, K/V rows are gathered by slot, scores and the online softmax (m, l, acc) are f32.
Dequantisation is folded into the matmuls: `q.(k*s_k) = (q.k)*s_k` scales score columns and
`p@(v*s_v) = (p*s_v)@v` scales probability columns, so fp8/int8 K/V are only widened (exactly)
to the compute dtype and the [C, D] tiles are never multiplied.

The cache write is NOT fused. jaxserve/attention/kv_cache.py scatters the step's new K/V (and scales)
with `slot_mapping` before attention, as the internals rule "every layer writes its new K/V
before any attention reads it" requires. Reasons: (1) a prefill chunk must read its own new
tokens, and inside one fused kernel the programs of other tiles/heads would race with the
writers (Pallas has no grid-wide barrier on GPU); (2) the kernel stays read-only on the cache,
so no `input_output_aliases`/donation plumbing through pallas_call; (3) the scatter touches only
T*K*D elements, negligible next to the attention reads, and XLA fuses the quantisation into it.

Metadata is NOT scalar-prefetched through `PrefetchScalarGridSpec`: the Triton backend (the GPU
lowering of generic Pallas) rejects scalar prefetch ("scalar prefetch not implemented in the
Triton backend"). The int32 tables are passed as ordinary whole-array operands and read as
scalars / gathered vectors from global memory, which is what scalar prefetch amounts to on GPU.
Everything in the kernel keeps to what Triton lowering supports: power-of-two tensor sizes
(R, C, D), 2-D dots with M, N >= 16 on GPU, dynamic-bound fori_loop, gathers through integer
index vectors, no scratch buffers. The Triton backend is pinned with `triton_params()`; left to
itself jax may choose Mosaic GPU, which tries to stage the whole cache in shared memory. The test
suite cross-lowers both kernels for CUDA on CPU (Pallas -> Triton IR); `pytest -m gpu` compiles
and checks them on a GPU (tests/test_gpu.py). f32 inputs run their dots at HIGHEST precision
(IEEE f32 in Triton) so the f32 path matches the oracle to 2e-5; bf16/f16 dots are untouched.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxserve.pallas.common import layer_window, searchsorted, target_platform, token_layout

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
QUANTIZED_KV_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2), jnp.dtype(jnp.int8))
COMPUTE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ----------------------------------------------------------------------------------------------
# Reference (the kernel's oracle)
# ----------------------------------------------------------------------------------------------
def ref_ragged_paged_attention(q, k_cache, v_cache, meta, *, sm_scale, sliding_window=None,
                               soft_cap=None, k_scale=None, v_scale=None):
    """Plain jnp ragged paged attention: each token gathers its sequence's whole context.

    Memory is O(T * M * B * K * D) -- an oracle for tests and small CPU runs, not a fast path.
    """
    T, H, D = q.shape
    N, B, K, _ = k_cache.shape
    G = H // K
    M = meta.block_tables.shape[1]
    sliding_window = layer_window(meta, sliding_window)
    seq, pos, valid = token_layout(meta, T)
    j = jnp.arange(M * B, dtype=jnp.int32)                              # context positions
    pages = meta.block_tables[seq][:, j // B]                          # [T, M*B]
    offs = jnp.broadcast_to(j % B, pages.shape)
    k = k_cache[pages, offs].astype(jnp.float32)                       # [T, M*B, K, D]
    v = v_cache[pages, offs].astype(jnp.float32)
    if k_scale is not None:
        k = k * k_scale[pages, offs][..., None]
        v = v * v_scale[pages, offs][..., None]
    qf = q.astype(jnp.float32).reshape(T, K, G, D)
    s = jnp.einsum("tkgd,tjkd->tkgj", qf, k, precision=lax.Precision.HIGHEST) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    mask = (j[None, :] <= pos[:, None]) & (j[None, :] < meta.kv_lens[seq][:, None])
    if sliding_window is not None:
        mask &= j[None, :] > pos[:, None] - sliding_window
    mask &= valid[:, None]
    mask = mask[:, None, None, :]                                      # [T, 1, 1, M*B]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("tkgj,tjkd->tkgd", p, v, precision=lax.Precision.HIGHEST)
    o = o / jnp.where(l > 0, l, 1.0)
    return o.reshape(T, H, D).astype(q.dtype)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------
def dot_precision(dtype):
    """Precision for the kernels' dots on `dtype` operands: HIGHEST for f32, default otherwise."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def kv_loop(q, seq, kh, row_pos, row_ok, c_lo, c_hi, bt_ref, k_ref, v_ref, ks_ref, vs_ref, *,
            kv_block, block_size, sm_scale, sliding_window, soft_cap):
    """Online softmax of q [R, D] over cache chunks [c_lo, c_hi) of sequence `seq`, kv head kh.

    row_pos/row_ok [R, C]: each row's query position and whether the row is real. Returns the
    unnormalised (m [R], l [R], acc [R, D]) in f32. Shared by the ragged and decode kernels.
    """
    R, D = q.shape
    C = kv_block
    cdt = q.dtype
    max_pages = bt_ref.shape[1]
    # f32 operands: full f32 (Triton's IEEE dot). Left at the default, GPUs run f32 dots as TF32
    # (10-bit mantissa; 6e-4 off the oracle on an H100). bf16/f16 keep the default fast path.
    prec = dot_precision(cdt)

    def body(c, carry):
        m, l, acc = carry
        kpos = c * C + lax.broadcasted_iota(jnp.int32, (C,), 0)         # [C] cache positions
        page_idx = jnp.minimum(lax.div(kpos, jnp.int32(block_size)), max_pages - 1)
        pages = bt_ref[seq, page_idx]                                    # [C] block ids
        slots = pages * block_size + lax.rem(kpos, jnp.int32(block_size))
        k = k_ref[slots, kh, :].astype(cdt)                              # [C, D], exact widening
        v = v_ref[slots, kh, :].astype(cdt)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32)          # [R, C]
        if ks_ref is not None:
            s = s * ks_ref[slots, kh][None, :]                           # dequantise K columns
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kp = kpos[None, :]
        mask = row_ok & (kp <= row_pos)          # row_pos < kv_len for real rows
        if sliding_window is not None:
            mask = mask & (kp > row_pos - sliding_window)
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        l = alpha * l + jnp.sum(p, axis=1)
        if vs_ref is not None:
            p = p * vs_ref[slots, kh][None, :]                           # dequantise V rows
        pv = lax.dot_general(p.astype(cdt), v, (((1,), (0,)), ((), ())), precision=prec,
                             preferred_element_type=jnp.float32)         # [R, D]
        return m_new, l, alpha[:, None] * acc + pv

    init = (jnp.full((R,), MASK_VALUE, jnp.float32), jnp.zeros((R,), jnp.float32),
            jnp.zeros((R, D), jnp.float32))
    return lax.fori_loop(c_lo, c_hi, body, init)


def _ragged_kernel(tile_seq_ref, tile_qstart_ref, tile_nq_ref, q_lens_ref, kv_lens_ref, bt_ref,
                   q_ref, k_ref, v_ref, *rest, sm_scale, block_size, kv_block, gp,
                   sliding_window, soft_cap, quantized, layer_window):
    # q_ref [R, D] (this tile, this kv head); k_ref/v_ref [N*B, K, D] (whole cache, flat slots);
    # ks_ref/vs_ref [N*B, K] f32; window_ref [1] int32 (layer_window); o_ref [R, D].
    ks_ref, vs_ref, window_ref, o_ref = split_refs(rest, quantized, layer_window)
    if layer_window:
        sliding_window = window_ref[0]
    kh = pl.program_id(0)
    i = pl.program_id(1)
    seq = tile_seq_ref[i]
    nq = tile_nq_ref[i]                                  # real queries in this tile (0: idle tile)
    kv_len = kv_lens_ref[seq]
    p0 = kv_len - q_lens_ref[seq] + tile_qstart_ref[i]  # position of the tile's first query
    R, D = q_ref.shape
    C = kv_block

    row_tok = lax.div(lax.broadcasted_iota(jnp.int32, (R, C), 0), jnp.int32(gp))   # [R, C]
    row_pos = p0 + row_tok
    row_ok = row_tok < nq

    hi = jnp.minimum(kv_len, p0 + nq)                    # one past the last key any row sees
    c_lo = jnp.int32(0)
    if sliding_window is not None:                       # skip chunks wholly left of the window
        c_lo = lax.div(jnp.maximum(p0 - sliding_window + 1, 0), jnp.int32(C))
    c_hi = jnp.where(nq > 0, lax.div(hi + C - 1, jnp.int32(C)), c_lo)
    _, l, acc = kv_loop(q_ref[...], seq, kh, row_pos, row_ok, c_lo, c_hi, bt_ref, k_ref, v_ref,
                        ks_ref, vs_ref, kv_block=C, block_size=block_size, sm_scale=sm_scale,
                        sliding_window=sliding_window, soft_cap=soft_cap)
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)


def split_refs(rest, quantized: bool, layer_window: bool):
    """The optional trailing refs of the kernels: (k scales, v scales) when quantized, this
    layer's window when `layer_window`, then the outputs (one ref, or the tuple of them)."""
    rest = list(rest)
    ks_ref, vs_ref = (rest.pop(0), rest.pop(0)) if quantized else (None, None)
    window_ref = rest.pop(0) if layer_window else None
    return ks_ref, vs_ref, window_ref, rest[0] if len(rest) == 1 else tuple(rest)


def window_operand(meta) -> list:
    """This layer's window [1] int32 as a kernel operand (meta.sliding_window), or none."""
    w = getattr(meta, "sliding_window", None)
    return [] if w is None else [w.reshape(1).astype(jnp.int32)]


def _plan_tiles(meta, num_tokens: int, bq: int):
    """Split every sequence's new tokens into tiles of <= bq tokens.

    Returns per-tile (seq, first query index within the sequence, real query count) [NT] and
    per-sequence first tile [S]. Tiles past the real ones have count 0 (the kernel idles).
    """
    S = meta.kv_lens.shape[0]
    cu = meta.cu_q_lens.astype(jnp.int32)
    q_lens = jnp.where(jnp.arange(S) < meta.num_seqs.reshape(-1)[0], cu[1:] - cu[:-1], 0)
    tiles = (q_lens + bq - 1) // bq                                     # [S]
    tile_end = jnp.cumsum(tiles)
    tile_base = tile_end - tiles
    nt = min(num_tokens, pl.cdiv(num_tokens, bq) + S)
    it = jnp.arange(nt, dtype=jnp.int32)
    tile_seq = jnp.minimum(searchsorted(tile_end, it, side="right"), S - 1).astype(jnp.int32)
    qstart = (it - tile_base[tile_seq]) * bq
    nq = jnp.clip(q_lens[tile_seq] - qstart, 0, bq).astype(jnp.int32)
    return tile_seq, qstart.astype(jnp.int32), nq, tile_base, q_lens, nt


def scale_operands(k_scale, v_scale) -> list:
    """fp8/int8 scales [N, B, K] as the kernels read them: f32 rows per slot, [N * B, K]."""
    N, B, K = k_scale.shape
    return [k_scale.reshape(N * B, K).astype(jnp.float32),
            v_scale.reshape(N * B, K).astype(jnp.float32)]


def _ragged_impl(q, k_cache, v_cache, meta, k_scale, v_scale, *, sm_scale, sliding_window,
                 soft_cap, rows, kv_tokens, interpret):
    T, H, D = q.shape
    N, B, K, _ = k_cache.shape
    G = H // K
    gp = pl.next_power_of_2(G)
    bq = max(1, rows // gp)
    R = bq * gp
    C = max(pl.next_power_of_2(kv_tokens), B)    # whole pages per chunk when B is a power of 2
    tile_seq, qstart, nq, tile_base, q_lens, nt = _plan_tiles(meta, T, bq)
    cu = meta.cu_q_lens.astype(jnp.int32)

    # gather q into tiles: [K, NT, R, D], row = token_in_tile * Gp + head_in_group
    qg = q.reshape(T, K, G, D)
    if gp != G:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - G), (0, 0)))
    tq = jnp.arange(bq, dtype=jnp.int32)
    tok = cu[tile_seq][:, None] + qstart[:, None] + tq[None, :]        # [NT, bq]
    tok_ok = tq[None, :] < nq[:, None]
    q_tiles = jnp.where(tok_ok[:, :, None, None, None], qg[jnp.clip(tok, 0, T - 1)], 0)
    q_tiles = q_tiles.transpose(2, 0, 1, 3, 4).reshape(K, nt, R, D)

    quantized = k_scale is not None
    operands = [tile_seq, qstart, nq, q_lens.astype(jnp.int32), meta.kv_lens.astype(jnp.int32),
                meta.block_tables.astype(jnp.int32), q_tiles,
                k_cache.reshape(N * B, K, D), v_cache.reshape(N * B, K, D)]
    whole = pl.BlockSpec()  # whole array, read through explicit indices inside the kernel
    in_specs = [whole] * 6 + [pl.BlockSpec((None, None, R, D), lambda h, i: (h, i, 0, 0)),
                              whole, whole]
    if quantized:
        operands += scale_operands(k_scale, v_scale)
        in_specs += [whole, whole]
    window = window_operand(meta)
    operands += window
    in_specs += [whole] * len(window)
    kernel = functools.partial(
        _ragged_kernel, sm_scale=float(sm_scale), block_size=B, kv_block=C, gp=gp,
        sliding_window=sliding_window, soft_cap=None if soft_cap is None else float(soft_cap),
        quantized=quantized, layer_window=bool(window))
    out_tiles = pl.pallas_call(
        kernel,
        grid=(K, nt),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, R, D), lambda h, i: (h, i, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((K, nt, R, D), q.dtype),
        interpret=interpret,
        name="ragged_paged_attention",
        compiler_params=triton_params(),
    )(*operands)

    # scatter back: token t -> (tile, row) of its sequence
    seq, _, valid = token_layout(meta, T)
    local = jnp.arange(T, dtype=jnp.int32) - cu[seq]
    tile = jnp.clip(tile_base[seq] + local // bq, 0, nt - 1)
    out = out_tiles.reshape(K, nt, bq, gp, D)[:, tile, local % bq]     # [K, T, Gp, D]
    out = out[:, :, :G].transpose(1, 0, 2, 3).reshape(T, H, D)
    return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------
def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def validate_inputs(q, k_cache, v_cache, meta, *, sm_scale, sliding_window=None, soft_cap=None,
                    k_scale=None, v_scale=None) -> None:
    """Static checks (shapes, dtypes, options); raises ValueError naming the field."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, D], got shape {q.shape}")
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache must be [N, B, K, D], got shape {k_cache.shape}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache {v_cache.shape} {v_cache.dtype} must match k_cache "
                         f"{k_cache.shape} {k_cache.dtype}")
    T, H, D = q.shape
    N, B, K, Dk = k_cache.shape
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {D}")
    if Dk != D:
        raise ValueError(f"k_cache head_dim {Dk} != q head_dim {D}")
    if K == 0 or H % K:
        raise ValueError(f"num query heads H={H} must be a multiple of kv heads K={K}")
    if jnp.dtype(q.dtype) not in COMPUTE_DTYPES:
        raise ValueError(f"q dtype must be float32/bfloat16/float16, got {q.dtype}")
    cache_dt = jnp.dtype(k_cache.dtype)
    if cache_dt in QUANTIZED_KV_DTYPES:
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is None:
                raise ValueError(f"{name} is required for a {cache_dt} KV cache")
            if sc.shape != (N, B, K):
                raise ValueError(f"{name} must be [N, B, K]={(N, B, K)}, got {sc.shape}")
            if jnp.dtype(sc.dtype) != jnp.float32:
                raise ValueError(f"{name} must be float32, got {sc.dtype}")
    elif cache_dt in COMPUTE_DTYPES:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale given for an unquantised {cache_dt} KV cache")
    else:
        raise ValueError(f"KV cache dtype {cache_dt} not supported")
    bt, kv_lens, cu, ns = meta.block_tables, meta.kv_lens, meta.cu_q_lens, meta.num_seqs
    if bt.ndim != 2:
        raise ValueError(f"block_tables must be [S, M], got shape {bt.shape}")
    S = bt.shape[0]
    if kv_lens.shape != (S,):
        raise ValueError(f"kv_lens must be [S]={(S,)}, got {kv_lens.shape}")
    if cu.shape != (S + 1,):
        raise ValueError(f"cu_q_lens must be [S + 1]={(S + 1,)}, got {cu.shape}")
    if ns.size != 1:
        raise ValueError(f"num_seqs must have one element, got shape {ns.shape}")
    for name, a in (("block_tables", bt), ("kv_lens", kv_lens), ("cu_q_lens", cu),
                    ("num_seqs", ns)):
        if jnp.dtype(a.dtype) != jnp.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")
    if not (isinstance(sm_scale, numbers.Real) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive Python float, got {sm_scale!r}")
    if sliding_window is not None and not (isinstance(sliding_window, numbers.Integral)
                                           and sliding_window > 0):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
    layer_sw = getattr(meta, "sliding_window", None)
    if layer_sw is not None:
        if sliding_window is not None:
            raise ValueError("sliding_window: give the static argument or meta.sliding_window, not both")
        if layer_sw.size != 1 or jnp.dtype(layer_sw.dtype) != jnp.int32:
            raise ValueError(f"meta.sliding_window must be one int32, got {layer_sw.dtype}{list(layer_sw.shape)}")
    if soft_cap is not None and not (isinstance(soft_cap, numbers.Real) and soft_cap > 0):
        raise ValueError(f"soft_cap must be None or a positive float, got {soft_cap!r}")


def validate_metadata(meta, num_tokens: int, num_blocks: int, block_size: int) -> None:
    """Dynamic checks on concrete metadata (needs a device->host copy; skipped under jit)."""
    cu = np.asarray(meta.cu_q_lens)
    kv_lens = np.asarray(meta.kv_lens)
    bt = np.asarray(meta.block_tables)
    ns = int(np.asarray(meta.num_seqs).reshape(-1)[0])
    S, M = bt.shape
    if not 0 <= ns <= S:
        raise ValueError(f"num_seqs must be in [0, {S}], got {ns}")
    if cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_q_lens must start at 0 and be non-decreasing, got {cu.tolist()}")
    if cu[-1] > num_tokens:
        raise ValueError(f"cu_q_lens[-1]={cu[-1]} exceeds the number of tokens T={num_tokens}")
    q_lens = np.diff(cu)[:ns]
    if np.any(q_lens > kv_lens[:ns]):
        raise ValueError("every sequence needs q_len <= kv_len (kv_lens includes the new tokens)")
    if np.any(kv_lens < 0) or np.any(kv_lens > M * block_size):
        raise ValueError(f"kv_lens must be in [0, M*B={M * block_size}], got {kv_lens.tolist()}")
    used = (np.arange(M)[None, :] * block_size < kv_lens[:, None]) & (np.arange(S) < ns)[:, None]
    if np.any(used & ((bt < 0) | (bt >= num_blocks))):
        raise ValueError(f"block_tables entries in use must be in [0, N={num_blocks})")


# ----------------------------------------------------------------------------------------------
# Default block sizes and the public entry
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """q rows per program (= query tokens * padded G) and KV tokens per inner-loop chunk."""
    q_rows: int
    kv_tokens: int


# head_dim -> block sizes. Powers of two (Triton); R*D and C*D tiles sized for ~100 KB of
# registers/SMEM per program on Hopper. Untuned: GPU figures pending (benchmarks/RESULTS.md).
DEFAULT_BLOCK_SIZES = {
    64: BlockSizes(q_rows=64, kv_tokens=64),
    128: BlockSizes(q_rows=64, kv_tokens=64),
    256: BlockSizes(q_rows=32, kv_tokens=32),
}


def triton_params(num_warps: int = 4, num_stages: int = 2):
    """Pin the Triton GPU backend: with no compiler params jax may pick Mosaic GPU
    (`jax_pallas_use_mosaic_gpu`), which stages every whole-array operand in shared memory."""
    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def default_interpret() -> bool:
    """Pallas runs compiled for a GPU target; everywhere else only the interpreter works."""
    return target_platform() != "gpu"


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "rows",
                                             "kv_tokens", "interpret"))
def _ragged_jit(q, k_cache, v_cache, meta, k_scale, v_scale, *, sm_scale, sliding_window,
                soft_cap, rows, kv_tokens, interpret):
    return _ragged_impl(q, k_cache, v_cache, meta, k_scale, v_scale, sm_scale=sm_scale,
                        sliding_window=sliding_window, soft_cap=soft_cap, rows=rows,
                        kv_tokens=kv_tokens, interpret=interpret)


def ragged_paged_attention(q, k_cache, v_cache, meta: Any, *, sm_scale: float,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           k_scale=None, v_scale=None, interpret: bool | None = None,
                           block_sizes: BlockSizes | None = None):
    """Ragged paged attention, Pallas kernel. q [T, H, D], caches [N, B, K, D] -> [T, H, D].

    `meta` is any object with int32 `block_tables [S, M]`, `kv_lens [S]`, `cu_q_lens [S+1]`,
    `num_seqs [1]` (jaxserve.attention.AttentionMetadata). `interpret=None` runs the Pallas
    interpreter off GPU. Static arguments are validated always; metadata values are validated
    when they are concrete (eager calls), not under an enclosing jit.
    """
    validate_inputs(q, k_cache, v_cache, meta, sm_scale=sm_scale, sliding_window=sliding_window,
                    soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale)
    if all(_is_concrete(a) for a in (meta.cu_q_lens, meta.kv_lens, meta.block_tables,
                                     meta.num_seqs)):
        validate_metadata(meta, q.shape[0], k_cache.shape[0], k_cache.shape[1])
    bs = block_sizes or DEFAULT_BLOCK_SIZES[q.shape[-1]]
    if interpret is None:
        interpret = default_interpret()
    return _ragged_jit(q, k_cache, v_cache, meta, k_scale, v_scale, sm_scale=float(sm_scale),
                       sliding_window=None if sliding_window is None else int(sliding_window),
                       soft_cap=None if soft_cap is None else float(soft_cap),
                       rows=bs.q_rows, kv_tokens=bs.kv_tokens, interpret=bool(interpret))
