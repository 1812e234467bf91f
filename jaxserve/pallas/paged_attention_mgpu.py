"""Ragged paged attention for Hopper, written for Mosaic GPU (`plgpu.kernel`, jax >= 0.11).

Same contract as `ragged_paged_attention` (jaxserve/pallas/paged_attention.py): q [T, H, D],
paged caches [N, B, K, D], metadata `block_tables [S, M]`, `kv_lens [S]`, `cu_q_lens [S+1]`,
`num_seqs [1]`; one call for a mixed batch of decode rows and prefill chunks; causal inside a
chunk; GQA of any ratio; padding tokens get zeros. Oracle: `ref_ragged_paged_attention`.

Supported (anything else raises ValueError naming the field):
  q bf16 or f32; a bf16 cache, or an fp8 (e4m3, e5m2) / int8 cache with per-token-head f32
  scales [N, B, K]; head_dim 64/128/256 (f32 q: 64/128, 256 does not fit shared memory);
  GQA ratio G <= 64; block_size B a multiple of 8 dividing the KV chunk (64, 128, 192 or 256
  tokens); sliding window; soft cap.
  NOT yet: f16 q, f16 or f32 caches. Hopper's wgmma reads 32-bit operands as tf32 and only
  K-major, so an f32 V would need restaging in SMEM and a bf16 high/low split in-kernel.
f32 q: the wrapper splits q into bf16 high + low parts (q = hi + lo to ~16 mantissa bits) and
the kernel splits P the same way, so QK and PV are two bf16 wgmma's each with f32 accumulation:
near-f32 accuracy (max error ~1e-5 on unit-variance data) at twice the tensor-core work, which
a memory-bound decode step does not notice.

Partitioning. Grid `(K, NT, P)`: program (h, i, p) owns kv head h, query tile i and KV split p.
A query tile (jaxserve/pallas/ragged_tiles.py) is up to bq tokens of ONE sequence times the G
query heads of kv head h (padded to Gp), R = bq * Gp = 64 rows -- one wgmma M tile -- so a
decode row fills the tensor-core tile with its G heads (and prefill tokens fill the rest).
The tile's visible KV chunks [c_first, c_end) (from kv_len, the tile's causal end and the
window) are cut into P equal slices; each program writes its unnormalised f32 partials
(acc [R, D], m [R], l [R]) and a jnp combine merges them (flash-decoding). Short sequences'
upper splits are empty and idle.

Inside a program: Q [R, D] is copied GMEM->SMEM once; the KV loop walks chunks of C tokens
(C / B pages). Hopper's TMA has no gather, so every page's [B, D] slab of kv head h is its own
`copy_gmem_to_smem` into the chunk's SMEM slot; all C / B copies arrive on one barrier per slot
(num_arrivals = C / B). Two slots double-buffer: chunk c + 1's copies are issued before chunk c
is computed. S = Q K^T and O += P V are wgmma's with f32 accumulators; the online softmax
(m, l, alpha) runs in registers in the WGMMA layout. Page ids and lengths are scalar loads from
GMEM. Page ids past the table or out of range are clamped: those keys are masked anyway.

fp8/int8 caches: the raw chunk lands in SMEM at its storage width (half the bytes of bf16), is
widened exactly to bf16 into a second SMEM buffer (wgmma reads 8-bit operands only K-major and
only against 8-bit operands), and the scales are folded in f32 like the Triton kernel does:
`q.(k*s_k) = (q.k)*s_k` scales score columns, `p@(v*s_v) = (p*s_v)@v` scales P's columns. The
scales are passed transposed to [K, N, B] so each page's B scales of one kv head are contiguous
for TMA (one XLA transpose of 1/D of the cache's elements per call).

The cache write is not fused (same reasons as the Triton kernel's docstring).

Status: checked in Mosaic GPU interpret mode against the reference (with its race detector) and
lowered for CUDA on CPU (layouts, the 227 KiB shared-memory limit); not yet compiled or timed on
an H100 (tests/test_paged_attention_mgpu.py's `gpu` tests do that). Known costs left for tuning:
one warpgroup both issues the TMA copies and computes (no producer warpgroup), P makes an SMEM
round trip before P @ V, and the block sizes are untuned.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.pallas.paged_attention import (
    MASK_VALUE,
    QUANTIZED_KV_DTYPES,
    _is_concrete,
    validate_inputs,
    validate_metadata,
    window_operand,
)
from jaxserve.pallas.paged_attention_decode import combine_splits
from jaxserve.pallas.ragged_tiles import gather_q_tiles, plan_tiles, scatter_tiles

try:  # Mosaic GPU's Pallas API as used here is jax >= 0.11 (plgpu.kernel + GPU interpret mode)
    from jax.experimental.pallas import mosaic_gpu as plgpu
    MGPU_AVAILABLE = hasattr(plgpu, "InterpretGPUParams") and hasattr(plgpu, "kernel")
except ImportError:  # pragma: no cover - depends on the installed jax
    plgpu = None
    MGPU_AVAILABLE = False

ROWS = 64                        # wgmma M: query rows per program
OUT_COLS = 128                   # f32 output staged through SMEM this many columns at a time
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def q_parts(dtype) -> int:
    """bf16 parts q (and P) are split into for wgmma: f32 is bf16 high + bf16 low."""
    return 2 if jnp.dtype(dtype) == jnp.float32 else 1


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------
def _smem_transforms(dtype, minor: int):
    """Tiling + swizzle for an SMEM tile whose minor dimension has `minor` elements."""
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _columns(scale_ref):
    """A chunk's per-token scales [C] in the layout that broadcasts over score columns."""
    return plgpu.load(scale_ref, layout=plgpu.Layout.WGMMA.reduce(0))


def _widen(x, dtype):
    """fp8/int8 -> the compute dtype, exactly. Hopper converts fp8 only to f16 in hardware, so
    fp8 goes through f32 (every fp8 and int8 value is exact in f32 and in bf16)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    return x.astype(dtype)


def _attention_kernel(tile_seq_ref, tile_qstart_ref, tile_nq_ref, q_lens_ref, kv_lens_ref,
                      bt_ref, q_ref, k_ref, v_ref, *refs, sm_scale, block_size, kv_chunk, gp,
                      num_splits, sliding_window, soft_cap, quantized, layer_window):
    # GMEM: q_ref [K, NT, Qs, R, D] (Qs = 2 for f32 q: bf16 high and low parts);
    #       k_ref/v_ref [N, B, K, D] (cache dtype); bt_ref [S, M];
    #       ks_ref/vs_ref [K, N, B] f32 (quantized only); window_ref [1] int32 (layer_window only);
    #       acc_out [K, NT, P, R, D] f32; m_out/l_out [K, NT, P, R] f32.
    # SMEM: q_smem [Qs, R, D]; k_smem/v_smem [2, C, D] (cache dtype); p_smem [Qs, R, C];
    #       o_smem [R, min(D, 128)] f32; ml_smem [2, R] f32; quantized only: k_cmp/v_cmp [C, D]
    #       (the chunk widened to the compute dtype), ks_smem/vs_smem [2, C] f32.
    window_ref = None
    if layer_window:        # this layer's window follows the inputs (and the scales)
        refs = list(refs)
        window_ref = refs.pop(2 if quantized else 0)
    if quantized:
        (ks_ref, vs_ref, acc_out, m_out, l_out, q_smem, k_smem, v_smem, p_smem, o_smem, ml_smem,
         q_bar, k_bar, v_bar, k_cmp, v_cmp, ks_smem, vs_smem) = refs
    else:
        (acc_out, m_out, l_out, q_smem, k_smem, v_smem, p_smem, o_smem, ml_smem,
         q_bar, k_bar, v_bar) = refs
    kh, i, split = lax.axis_index("kv_head"), lax.axis_index("tile"), lax.axis_index("split")
    Qs, R, D = q_smem.shape
    C, B = kv_chunk, block_size
    ppc = C // B                                            # pages per chunk
    N, M = k_ref.shape[0], bt_ref.shape[1]
    cdt = q_smem.dtype

    seq = tile_seq_ref[i]
    nq = tile_nq_ref[i]                                     # real queries in this tile
    kv_len = kv_lens_ref[seq]
    p0 = kv_len - q_lens_ref[seq] + tile_qstart_ref[i]      # position of the tile's first query
    hi = jnp.minimum(kv_len, p0 + nq)                       # one past the last visible key
    if window_ref is not None:
        sliding_window = window_ref[0]
    c_first = jnp.int32(0)
    if sliding_window is not None:                          # chunks wholly left of the window
        c_first = lax.div(jnp.maximum(p0 - sliding_window + 1, 0), jnp.int32(C))
    c_end = jnp.where(nq > 0, lax.div(hi + C - 1, jnp.int32(C)), c_first)
    per = lax.div(c_end - c_first + num_splits - 1, jnp.int32(num_splits))
    c_lo = jnp.minimum(c_first + split * per, c_end)
    c_hi = jnp.minimum(c_lo + per, c_end)

    for h in range(Qs):                 # one copy per part: TMA strides at most 5 dimensions
        plgpu.copy_gmem_to_smem(q_ref.at[kh, i, h], q_smem.at[h], q_bar)

    def fetch(c, slot):
        """Issue the page copies of chunk c into `slot`; each page arrives on the slot barrier."""
        for j in range(ppc):
            page_idx = jnp.minimum(c * ppc + j, M - 1)
            page = jnp.clip(bt_ref[seq, page_idx], 0, N - 1)
            dst = pl.ds(j * B, B)
            plgpu.copy_gmem_to_smem(k_ref.at[page, :, kh, :], k_smem.at[slot, dst],
                                    k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[page, :, kh, :], v_smem.at[slot, dst],
                                    v_bar.at[slot])
            if quantized:
                plgpu.copy_gmem_to_smem(ks_ref.at[kh, page], ks_smem.at[slot, dst],
                                        k_bar.at[slot])
                plgpu.copy_gmem_to_smem(vs_ref.at[kh, page], vs_smem.at[slot, dst],
                                        v_bar.at[slot])

    @pl.when(c_lo < c_hi)
    def _():
        fetch(c_lo, 0)

    plgpu.barrier_wait(q_bar)
    layout = plgpu.Layout.WGMMA
    row = plgpu.broadcasted_iota(jnp.int32, (R, C), 0, layout=layout)
    col = plgpu.broadcasted_iota(jnp.int32, (R, C), 1, layout=layout)
    row_tok = lax.div(row, jnp.int32(gp))                   # token index of each row in the tile
    row_pos = p0 + row_tok
    row_ok = row_tok < nq

    def body(c, carry):
        acc, m, l = carry
        slot = lax.rem(c - c_lo, jnp.int32(2))

        @pl.when(c + 1 < c_hi)
        def _():                                            # prefetch the next chunk
            fetch(c + 1, 1 - slot)

        plgpu.barrier_wait(k_bar.at[slot])
        k_op = k_smem.at[slot]
        if quantized:                       # fp8/int8 -> compute dtype is exact; scales later
            k_cmp[...] = _widen(k_smem.at[slot][...], cdt)
            plgpu.commit_smem()
            k_op = k_cmp

        def qk(acc_ref):
            for h in range(Qs):             # f32 q: q_hi.k + q_lo.k, f32 accumulation
                plgpu.wgmma(acc_ref, q_smem.at[h], k_op.T)
            return acc_ref[...]
        s = pl.run_scoped(qk, plgpu.ACC((R, C), jnp.float32))                 # [R, C] f32
        if quantized:                       # q.(k * s_k) = (q.k) * s_k: scale score columns
            s = s * lax.broadcast_in_dim(_columns(ks_smem.at[slot]), (R, C), [1])
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kpos = c * C + col
        mask = row_ok & (kpos <= row_pos)                   # row_pos < kv_len on real rows
        if sliding_window is not None:
            mask = mask & (kpos > row_pos - sliding_window)
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(m_new, (R, C), [0])), 0.0)
        l = alpha * l + p.sum(axis=1)
        plgpu.barrier_wait(v_bar.at[slot])
        v_op = v_smem.at[slot]
        if quantized:                       # p @ (v * s_v) = (p * s_v) @ v: scale P columns
            v_cmp[...] = _widen(v_smem.at[slot][...], cdt)
            p = p * lax.broadcast_in_dim(_columns(vs_smem.at[slot]), (R, C), [1])
            v_op = v_cmp

        # P goes through SMEM and P V into a fresh accumulator added in registers: GPU interpret
        # mode reads wgmma operands only from SMEM and has no pl.run_state (pre-initialised
        # ACC). Both cost an [R, C] store and an [R, D] add, small next to the KV reads.
        p_hi = p.astype(cdt)
        p_smem[0] = p_hi
        if Qs == 2:                         # f32 q: P as bf16 high + low parts too
            p_smem[1] = (p - p_hi.astype(jnp.float32)).astype(cdt)
        plgpu.commit_smem()

        def pv(acc_ref):
            for h in range(Qs):
                plgpu.wgmma(acc_ref, p_smem.at[h], v_op)
            return acc_ref[...]
        pv_out = pl.run_scoped(pv, plgpu.ACC((R, D), jnp.float32))           # [R, D] f32
        acc = acc * lax.broadcast_in_dim(alpha, (R, D), [0]) + pv_out
        return acc, m_new, l

    reduced = layout.reduce(1)
    init = (plgpu.layout_cast(jnp.zeros((R, D), jnp.float32), layout),
            plgpu.layout_cast(jnp.full((R,), MASK_VALUE, jnp.float32), reduced),
            plgpu.layout_cast(jnp.zeros((R,), jnp.float32), reduced))
    acc, m, l = lax.fori_loop(c_lo, c_hi, body, init)

    ml_smem[0] = m
    ml_smem[1] = l
    # acc leaves through o_smem [R, OC] in column parts: a whole f32 [64, 256] buffer would not
    # fit beside D=256's KV slots.
    OC = o_smem.shape[1]
    for part in range(D // OC):
        if part:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # o_smem free again
        o_smem[...] = acc if OC == D else acc[:, part * OC:(part + 1) * OC]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, acc_out.at[kh, i, split, :, pl.ds(part * OC, OC)])
    plgpu.copy_smem_to_gmem(ml_smem.at[0], m_out.at[kh, i, split])
    plgpu.copy_smem_to_gmem(ml_smem.at[1], l_out.at[kh, i, split])
    plgpu.wait_smem_to_gmem(0)


def _interpret_params(interpret):
    """True -> default GPU interpret mode; an InterpretGPUParams (e.g. detect_races=True) as
    given; False -> compiled."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


def _call_kernel(q_tiles, plan, meta, k_cache, v_cache, k_scale, v_scale, *, sm_scale,
                 sliding_window, soft_cap, kv_chunk, num_splits, interpret):
    """Run the grid; returns f32 partials acc [K, NT, P, R, D], m / l [K, NT, P, R]."""
    K, nt, Qs, R, D = q_tiles.shape
    B = k_cache.shape[1]
    cdt = q_tiles.dtype
    kvdt = k_cache.dtype
    quantized = k_scale is not None
    P = num_splits
    kernel = functools.partial(
        _attention_kernel, sm_scale=sm_scale, block_size=B, kv_chunk=kv_chunk, gp=plan.gp,
        num_splits=P, sliding_window=sliding_window, soft_cap=soft_cap, quantized=quantized)
    arrivals = (kv_chunk // B) * (2 if quantized else 1)     # one per page copy (+ its scales)
    scratch = [
        plgpu.SMEM((Qs, R, D), cdt, transforms=_smem_transforms(cdt, D)),
        plgpu.SMEM((2, kv_chunk, D), kvdt, transforms=_smem_transforms(kvdt, D)),
        plgpu.SMEM((2, kv_chunk, D), kvdt, transforms=_smem_transforms(kvdt, D)),
        plgpu.SMEM((Qs, R, kv_chunk), cdt, transforms=_smem_transforms(cdt, kv_chunk)),
        plgpu.SMEM((R, min(D, OUT_COLS)), jnp.float32,
                   transforms=_smem_transforms(jnp.float32, min(D, OUT_COLS))),
        plgpu.SMEM((2, R), jnp.float32),
        plgpu.Barrier(num_arrivals=Qs),
        plgpu.Barrier(num_arrivals=arrivals, num_barriers=2),
        plgpu.Barrier(num_arrivals=arrivals, num_barriers=2),
    ]
    operands = [plan.tile_seq, plan.tile_qstart, plan.tile_nq, plan.q_lens,
                meta.kv_lens.astype(jnp.int32), meta.block_tables.astype(jnp.int32), q_tiles,
                k_cache, v_cache]
    if quantized:
        scratch += [plgpu.SMEM((kv_chunk, D), cdt, transforms=_smem_transforms(cdt, D)),
                    plgpu.SMEM((kv_chunk, D), cdt, transforms=_smem_transforms(cdt, D)),
                    plgpu.SMEM((2, kv_chunk), jnp.float32),
                    plgpu.SMEM((2, kv_chunk), jnp.float32)]
        # [K, N, B]: a page's B scales of one kv head contiguous, as a TMA copy needs
        operands += [k_scale.transpose(2, 0, 1), v_scale.transpose(2, 0, 1)]
    window = window_operand(meta)
    operands += window
    kernel = functools.partial(kernel, layer_window=bool(window))
    out_type = (jax.ShapeDtypeStruct((K, nt, P, R, D), jnp.float32),
                jax.ShapeDtypeStruct((K, nt, P, R), jnp.float32),
                jax.ShapeDtypeStruct((K, nt, P, R), jnp.float32))
    call = plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch, grid=(K, nt, P),
        grid_names=("kv_head", "tile", "split"),
        compiler_params=plgpu.CompilerParams(),
        interpret=_interpret_params(interpret))
    return call(*operands)


# ----------------------------------------------------------------------------------------------
# Validation (the Triton kernel's checks plus what this kernel does not support yet)
# ----------------------------------------------------------------------------------------------
SMEM_BYTES = 227 * 1024          # H100 opt-in shared memory per block


def smem_bytes(rows: int, head_dim: int, kv_chunk: int, *, quantized: bool = False,
               q_parts: int = 1) -> int:
    """Shared memory one program allocates: Q (q_parts bf16 parts), two K and two V chunk slots
    (1-byte fp8/int8 when quantized, else bf16), P (q_parts parts), f32 O, m, l; quantised
    caches also hold the widened bf16 K/V chunk and two slots of K/V scales."""
    kv = 4 * kv_chunk * head_dim * (1 if quantized else 2)
    widened = 2 * kv_chunk * head_dim * 2 + 4 * kv_chunk * 4 if quantized else 0
    return (q_parts * rows * head_dim * 2 + kv + widened + q_parts * rows * kv_chunk * 2
            + rows * min(head_dim, OUT_COLS) * 4 + 2 * rows * 4 + 1024)


def _static_problem(q_dtype, kv_dtype, num_q_heads: int, num_kv_heads: int, head_dim: int,
                    block_size: int, kv_chunk: int) -> str | None:
    """Why this kernel cannot run these shapes and dtypes (None: it can)."""
    q_dtype, kv_dt = jnp.dtype(q_dtype), jnp.dtype(kv_dtype)
    if q_dtype not in SUPPORTED_DTYPES:
        return f"q dtype {q_dtype} not supported by the Mosaic GPU kernel yet (supported: bfloat16, float32)"
    if kv_dt != jnp.dtype(jnp.bfloat16) and kv_dt not in QUANTIZED_KV_DTYPES:
        return (f"KV cache dtype {kv_dt} not supported by the Mosaic GPU kernel yet (supported: bfloat16, "
                f"or fp8/int8 with scales)")
    H, K, D, B = num_q_heads, num_kv_heads, head_dim, block_size
    if H // K > ROWS:
        return f"GQA ratio H/K={H // K} exceeds {ROWS} (one wgmma tile of rows)"
    if B % 8:
        return f"block_size (k_cache.shape[1]) must be a multiple of 8, got {B}"
    if kv_chunk % B or kv_chunk % 64 or not 64 <= kv_chunk <= 256:
        # 64: narrower score tiles fail Mosaic GPU's layout inference (found by lowering C=32)
        return f"kv_tokens={kv_chunk} must be a multiple of block_size {B} and of 64, in [64, 256]"
    need = smem_bytes(ROWS, D, kv_chunk, quantized=kv_dt in QUANTIZED_KV_DTYPES, q_parts=q_parts(q_dtype))
    if need > SMEM_BYTES:
        return (f"kv_tokens={kv_chunk} with head_dim {D} and q {q_dtype} needs {need} bytes of shared memory, "
                f"over the {SMEM_BYTES} a Hopper block has")
    return None


def validate_mgpu(q, k_cache, v_cache, *, kv_chunk: int, num_splits: int) -> None:
    """Limits of this kernel beyond the shared contract; raises ValueError naming the field."""
    if not MGPU_AVAILABLE:
        raise ValueError(f"ragged_paged_attention_mgpu needs jax >= 0.11 (Mosaic GPU "
                         f"plgpu.kernel with GPU interpret mode); this is jax {jax.__version__}")
    _, H, D = q.shape
    B, K = k_cache.shape[1:3]
    problem = _static_problem(q.dtype, k_cache.dtype, H, K, D, B, kv_chunk)
    if problem:
        raise ValueError(problem)
    if not (isinstance(num_splits, numbers.Integral) and num_splits >= 1):
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")


def unsupported_reason(q_dtype, kv_dtype, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                       block_size: int) -> str | None:
    """Why the kernel with its default block sizes cannot serve a model of these shapes and
    dtypes, or None when it can (the static half of `validate_mgpu`; no jax version check).
    Backend selection asks this before any array exists."""
    if head_dim not in DEFAULT_BLOCK_SIZES:
        return f"head_dim {head_dim} not supported by the Mosaic GPU kernel (supported: " \
               f"{', '.join(map(str, DEFAULT_BLOCK_SIZES))})"
    return _static_problem(q_dtype, kv_dtype, num_q_heads, num_kv_heads, head_dim, block_size,
                           _kv_chunk(q_dtype, block_size, DEFAULT_BLOCK_SIZES[head_dim]))


# ----------------------------------------------------------------------------------------------
# Default block sizes and the public entry
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MgpuBlockSizes:
    """KV tokens per pipelined chunk (a multiple of the page size) and KV splits per query tile
    (None: enough to fill the GPU, see `default_num_splits`)."""
    kv_tokens: int
    num_splits: int | None = None


# head_dim -> block sizes; bf16 SMEM at R = 64 (`smem_bytes`): D=64, C=128 105 KiB; D=128,
# C=128 193 KiB; D=256, C=64 201 KiB (C=128 would not fit).
# Untuned: no H100 numbers for this kernel yet.
DEFAULT_BLOCK_SIZES = {
    64: MgpuBlockSizes(kv_tokens=128),
    128: MgpuBlockSizes(kv_tokens=128),
    256: MgpuBlockSizes(kv_tokens=64),
}
F32_Q_KV_TOKENS = 64             # f32 q: D=128 146 KiB with a bf16 cache (D=256 does not fit)
TARGET_PROGRAMS = 264            # two programs per H100 SM (132 SMs)
MAX_SPLITS = 32


def default_num_splits(num_kv_heads: int, num_tiles: int, max_chunks: int) -> int:
    """Enough KV splits to fill the GPU, never more than the longest context has chunks."""
    want = -(-TARGET_PROGRAMS // max(1, num_kv_heads * num_tiles))
    return int(max(1, min(1 << (want - 1).bit_length(), MAX_SPLITS, max_chunks)))


def _kv_chunk(q_dtype, block_size: int, bs: MgpuBlockSizes, tuned: bool = True) -> int:
    """KV tokens per pipelined chunk: the table's (smaller for f32 q: two Q and P parts), at
    least one page."""
    kv_tokens = bs.kv_tokens
    if tuned and q_parts(q_dtype) == 2:
        kv_tokens = min(kv_tokens, F32_Q_KV_TOKENS)
    return max(kv_tokens, block_size)


def _plan(q, k_cache, meta, block_sizes):
    T, H, D = q.shape
    B, K = k_cache.shape[1:3]
    if block_sizes is None and D not in DEFAULT_BLOCK_SIZES:
        raise ValueError(f"head_dim {D} not supported by the Mosaic GPU kernel (supported: "
                         f"{', '.join(map(str, DEFAULT_BLOCK_SIZES))})")
    bs = block_sizes or DEFAULT_BLOCK_SIZES[D]
    kv_chunk = _kv_chunk(q.dtype, B, bs, tuned=block_sizes is None)
    gp = 1 << (H // K - 1).bit_length()
    bq = ROWS // gp
    nt = max(1, min(T, -(-T // bq) + meta.kv_lens.shape[0]))
    max_chunks = -(-(meta.block_tables.shape[1] * B) // kv_chunk)
    splits = bs.num_splits or default_num_splits(K, nt, max_chunks)
    return kv_chunk, bq, gp, splits


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "kv_chunk", "bq", "gp", "num_splits", "interpret"))
def _mgpu_jit(q, k_cache, v_cache, meta, k_scale, v_scale, *, sm_scale, sliding_window, soft_cap,
              kv_chunk, bq, gp, num_splits, interpret):
    T, H, _ = q.shape
    K = k_cache.shape[2]
    plan = plan_tiles(meta, T, bq, gp)
    q_tiles = gather_q_tiles(q, meta, plan, K)                          # [K, NT, R, D]
    if q.dtype == jnp.float32:      # bf16 high + low parts: ~16 mantissa bits through wgmma
        hi = q_tiles.astype(jnp.bfloat16)
        q_tiles = jnp.stack([hi, (q_tiles - hi.astype(jnp.float32)).astype(jnp.bfloat16)], 2)
    else:
        q_tiles = q_tiles[:, :, None]                                   # [K, NT, Qs, R, D]
    acc, m, l = _call_kernel(q_tiles, plan, meta, k_cache, v_cache, k_scale, v_scale,
                             sm_scale=sm_scale,
                             sliding_window=sliding_window, soft_cap=soft_cap, kv_chunk=kv_chunk,
                             num_splits=num_splits, interpret=interpret)
    out = combine_splits(acc, m, l)                                     # [K, NT, R, D] f32
    return scatter_tiles(out, meta, plan, T, H, q.dtype)


def ragged_paged_attention_mgpu(q, k_cache, v_cache, meta: Any, *, sm_scale: float,
                                sliding_window: int | None = None, soft_cap: float | None = None,
                                k_scale=None, v_scale=None, interpret: Any = None,
                                block_sizes: MgpuBlockSizes | None = None):
    """Ragged paged attention, Mosaic GPU kernel: `ragged_paged_attention`'s contract.

    q [T, H, D], caches [N, B, K, D] -> [T, H, D]. `interpret=None` runs Mosaic GPU's interpreter
    off GPU; `interpret` may also be a `plgpu.InterpretGPUParams` (e.g. race detection). Static
    arguments are always validated; metadata values when they are concrete.
    Raises ValueError for inputs outside the module docstring's "Supported" list.
    """
    validate_inputs(q, k_cache, v_cache, meta, sm_scale=sm_scale, sliding_window=sliding_window,
                    soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale)
    kv_chunk, bq, gp, splits = _plan(q, k_cache, meta, block_sizes)
    validate_mgpu(q, k_cache, v_cache, kv_chunk=kv_chunk, num_splits=splits)
    if all(_is_concrete(a) for a in (meta.cu_q_lens, meta.kv_lens, meta.block_tables,
                                     meta.num_seqs)):
        validate_metadata(meta, q.shape[0], k_cache.shape[0], k_cache.shape[1])
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _mgpu_jit(q, k_cache, v_cache, meta, k_scale, v_scale, sm_scale=float(sm_scale),
                     sliding_window=None if sliding_window is None else int(sliding_window),
                     soft_cap=None if soft_cap is None else float(soft_cap), kv_chunk=kv_chunk,
                     bq=bq, gp=gp, num_splits=splits,
                     interpret=interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                     else bool(interpret))
