"""Ragged paged attention for Hopper, written for Mosaic GPU (`plgpu.kernel`, jax >= 0.11).

Same contract as `ragged_paged_attention` (jaxserve/pallas/paged_attention.py): q [T, H, D],
paged caches [N, B, K, D], metadata `block_tables [S, M]`, `kv_lens [S]`, `cu_q_lens [S+1]`,
`num_seqs [1]`; one call for a mixed batch of decode rows and prefill chunks; causal inside a
chunk; GQA of any ratio; padding tokens get zeros. Oracle: `ref_ragged_paged_attention`.

Supported (anything else raises ValueError naming the field):
  q bf16 or f32; a bf16 cache, or an fp8 (e4m3, e5m2) / int8 cache with per-token-head f32
  scales [N, B, K]; head_dim 64/128/256 (f32 q: 64/128, 256 does not fit shared memory);
  GQA ratio G <= 64; block_size B a multiple of 8 dividing the KV chunk (64, 128, 192 or 256
  tokens); sliding window (static, or per layer in the metadata); soft cap.
  NOT yet: f16 q, f16 or f32 caches. Hopper's wgmma reads 32-bit operands as tf32 and only
  K-major, so an f32 V would need restaging in SMEM and a bf16 high/low split in-kernel.
f32 q: the wrapper splits q into bf16 high + low parts (q = hi + lo to ~16 mantissa bits), the
kernel splits P the same way, and writes its output as bf16 high + low: QK and PV are two bf16
wgmma's each with f32 accumulation, near-f32 accuracy at twice the tensor-core work, which a
memory-bound decode step does not notice.

Partitioning. Grid `(K, NT, P)`: program (h, i, p) owns kv head h, query tile i and KV split p.
A query tile (jaxserve/pallas/ragged_tiles.py) is up to bq tokens of ONE sequence times the G
query heads of kv head h (padded to Gp), R = bq * Gp = 64 rows -- one wgmma M tile: the G heads
that share a kv head are packed into the tile's rows, so a prefill tile is full and a decode
tile has Gp of its 64 rows live (G=4: 4 rows). Several decode sequences are NOT packed into one
tile: their keys differ, so one S = Q K^T wgmma cannot serve rows of two sequences, and packing
them would read each sequence's pages into the shared tile anyway (the same bytes) while
multiplying every row by every sequence's keys. The padding costs tensor-core work and
registers, not bandwidth: 64 rows x 2 flops per K/V element read is 64 flop/byte (bf16) where an
H100 is compute-bound only past ~295, and the row-wise softmax is ~4 SM clocks per key against
~35 clocks for the key's 512 bytes at its share of HBM bandwidth (D=128).
The tile's visible KV chunks [c_first, c_end) (from kv_len, the tile's causal end and the
window; computed by the wrapper) are cut into P equal slices, one per program (flash-decoding).

Inside a program, two warpgroups (`num_threads=2`) share the SMEM buffers and talk through
mbarriers, like jax's own attention_mgpu.py:
  memory warpgroup (1): `setmaxnreg` down to PRODUCER_REGISTERS; copies the tile's metadata row
    (sequence, first position, query count, chunk range, window: 8 int32, computed by the
    wrapper) into SMEM for both warpgroups; then for each chunk of its split: brings the
    sequence's page ids into SMEM a window at a time (one TMA of `idx_window` ids from the
    block table, padded by the wrapper so every window is in bounds and 16-byte aligned), waits
    until the compute warpgroup has released the slot (`k_free`/`v_free`, from the `slots`-th
    chunk on), and issues the chunk's page copies (TMA has no gather: each page's [B, D] slab of
    kv head h is its own copy, all arriving on the slot's `k_full`/`v_full` barrier; fp8/int8
    caches bring their scales on the same barriers). It runs `slots` chunks ahead.
  compute warpgroup (0): `setmaxnreg` up to CONSUMER_REGISTERS; copies its Q tile in, then per
    chunk: waits `k_full`, S = Q K^T (wgmma, f32 accumulator), releases K (`k_free`), online
    softmax in registers in the WGMMA layout (soft cap, causal and window masks), waits
    `v_full`, O += P V with P straight from registers into the accumulator carried across
    chunks (`pl.run_state(plgpu.ACC.init(acc))`: no fresh accumulator, no add), releases V.
    At the end it normalises (o = acc / l, lse = m + log l) and writes ONLY the tile's useful
    rows (nq * Gp of 64) in bf16, with a ladder of power-of-two TMA stores (jax's
    ragged_dot_mgpu.py trick: TMA boxes are static), and the 64-row f32 lse.
Splits are merged by a small jnp step (`merge_splits`: exp(lse - max) weights); one split is
used as written.

Interpret mode (the off-GPU test oracle) runs the same math with differences the interpreter
forces (jax 0.11.2): it reads wgmma operands only from SMEM and has no `pl.run_state`, so P goes
through an SMEM buffer and PV into a fresh accumulator added in registers (`in_place=False`);
and it runs each warpgroup as its own XLA CPU computation whose blocking barrier callbacks hold
XLA CPU pool threads, which deadlocks on a 2-core machine, so by default one warpgroup issues
the copies one chunk ahead and computes (`warp_specialized=False`, the same copy and compute
code). The warp-specialised form is interpreted by a test on machines with >= 8 cores; the
lowering tests cover the compiled form (in place, warp-specialised).

fp8/int8 caches: the raw chunk lands in SMEM at its storage width (half the bytes of bf16), is
widened exactly to bf16 into a compute-only SMEM buffer (wgmma reads 8-bit operands only
K-major and only against 8-bit operands), after which the slot is released; the scales are
folded in f32 like the Triton kernel does: `q.(k*s_k) = (q.k)*s_k` scales score columns,
`p@(v*s_v) = (p*s_v)@v` scales P's columns. The scales are passed transposed to [K, N, B] so
each page's B scales of one kv head are contiguous for TMA.

Block sizes, shared memory per program and programs per SM: jaxserve/pallas/
paged_attention_mgpu_sizes.py (`DEFAULT_BLOCK_SIZES`, `smem_bytes`, `ctas_per_sm`), with the
model of bytes one call moves (`bytes_moved`). At head_dim 128 a program takes ~98 KiB (was
193 KiB): two programs per SM by shared memory.

The cache write is not fused (same reasons as the Triton kernel's docstring).

Status: checked in Mosaic GPU interpret mode against the reference (with its race detector) and
lowered for CUDA on CPU (layouts, the shared-memory limit); never compiled past MLIR or timed
on an H100 (tests/test_paged_attention_mgpu.py's `gpu` tests and benchmarks/gpu_suite.sh do),
so `auto` never picks it (jaxserve/pallas/measured.py).
"""
from __future__ import annotations

import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.pallas.common import target_platform
from jaxserve.pallas.paged_attention import (
    MASK_VALUE,
    QUANTIZED_KV_DTYPES,
    _is_concrete,
    validate_inputs,
    validate_metadata,
)
from jaxserve.pallas.paged_attention_mgpu_sizes import (  # noqa: F401 (re-exported)
    CONSUMER_REGISTERS,
    DEFAULT_BLOCK_SIZES,
    MAX_SPLITS,
    PRODUCER_REGISTERS,
    ROWS,
    SMEM_PER_BLOCK,
    TARGET_PROGRAMS,
    MgpuBlockSizes,
    bytes_moved,
    ctas_per_sm,
    default_num_splits,
    idx_window,
    smem_bytes,
)
from jaxserve.pallas.ragged_tiles import gather_q_tiles, plan_tiles, scatter_tiles

try:  # Mosaic GPU's Pallas API as used here is jax >= 0.11 (plgpu.kernel + GPU interpret mode)
    from jax.experimental.pallas import mosaic_gpu as plgpu
    MGPU_AVAILABLE = hasattr(plgpu, "InterpretGPUParams") and hasattr(plgpu, "kernel")
except ImportError:  # pragma: no cover - depends on the installed jax
    plgpu = None
    MGPU_AVAILABLE = False

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
SMEM_BYTES = SMEM_PER_BLOCK      # kept name: the per-block limit
F32_Q_KV_TOKENS = 64             # f32 q: chunks of at most 64 tokens (two Q and out parts)
NO_WINDOW = 1 << 30              # the metadata row's window when none applies
META_COLS = 8                    # seq, p0, nq, c_first, c_end, window, 0, 0 (32 bytes: one TMA)


def q_parts(dtype) -> int:
    """bf16 parts q (and P, and the output) are split into for wgmma: f32 is high + low."""
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


def _split_range(c_first, c_end, split, num_splits):
    """This split's chunks [c_lo, c_hi) of the tile's [c_first, c_end)."""
    per = lax.div(c_end - c_first + num_splits - 1, jnp.int32(num_splits))
    c_lo = jnp.minimum(c_first + split * per, c_end)
    return c_lo, jnp.minimum(c_lo + per, c_end)


def _chunk_issuer(bt_ref, k_ref, v_ref, scale_refs, idx_smem, k_smem, v_smem, scale_smem,
                  idx_bar, k_full, v_full, k_free, v_free, *, seq, c_lo, ppc, block_size, slots,
                  wait_free):
    """`issue(c)`: bring chunk c's page ids into SMEM when it opens a window (or is the split's
    first), wait until its slot is released (`wait_free`: from the `slots`-th chunk on), and
    issue its page copies (and scale copies) onto the slot's full barriers."""
    kh = lax.axis_index("kv_head")
    N = k_ref.shape[0]
    W = idx_smem.shape[0]
    B = block_size

    def issue(c):
        first = c * ppc                               # the chunk's first page in the table row
        base = lax.div(first, jnp.int32(W)) * W       # chunks never straddle windows

        @pl.when((c == c_lo) | (first == base))
        def _():
            plgpu.copy_gmem_to_smem(bt_ref.at[seq, pl.ds(base, W)], idx_smem, idx_bar)
            plgpu.barrier_wait(idx_bar)

        step = c - c_lo
        slot = lax.rem(step, jnp.int32(slots))
        pages = [jnp.clip(idx_smem[first - base + j], 0, N - 1) for j in range(ppc)]
        for src, dst, full, free, scales in ((k_ref, k_smem, k_full, k_free, 0),
                                             (v_ref, v_smem, v_full, v_free, 1)):
            if wait_free:
                @pl.when(step >= slots)
                def _(free=free):
                    plgpu.barrier_wait(free.at[slot])     # the slot's previous chunk is consumed

            for j, page in enumerate(pages):
                rows = pl.ds(j * B, B)
                plgpu.copy_gmem_to_smem(src.at[page, :, kh, :], dst.at[slot, rows], full.at[slot])
                if scale_refs:
                    plgpu.copy_gmem_to_smem(scale_refs[scales].at[kh, page],
                                            scale_smem[scales].at[slot, rows], full.at[slot])
    return issue


def _consumer(meta_smem, q_ref, o_out, lse_out, q_smem, k_smem, v_smem, o_smem, lse_smem,
              scale_smem, widened, p_smem, q_bar, k_full, v_full, k_free, v_free, *, seq_ok,
              p0, nq, window, c_lo, c_hi, gp, sm_scale, soft_cap, windowed, slots, in_place,
              issue=None):
    """Compute warpgroup: QK, online softmax, PV per chunk; normalised useful rows out.
    `issue` (single-warpgroup form only): this warpgroup also issues the copies, one chunk
    ahead, and releases nothing (no other warpgroup waits)."""
    del meta_smem, seq_ok
    release = plgpu.barrier_arrive if issue is None else (lambda _: None)
    kh, i, split = lax.axis_index("kv_head"), lax.axis_index("tile"), lax.axis_index("split")
    Qs, R, D = q_smem.shape
    C = k_smem.shape[1]
    cdt = q_smem.dtype
    quantized = widened is not None

    for h in range(Qs):                 # one copy per part: TMA strides at most 5 dimensions
        plgpu.copy_gmem_to_smem(q_ref.at[kh, i, h], q_smem.at[h], q_bar)
    plgpu.barrier_wait(q_bar)

    layout = plgpu.Layout.WGMMA
    row = plgpu.broadcasted_iota(jnp.int32, (R, C), 0, layout=layout)
    col = plgpu.broadcasted_iota(jnp.int32, (R, C), 1, layout=layout)
    row_tok = lax.div(row, jnp.int32(gp))                   # token index of each row in the tile
    row_pos = p0 + row_tok
    row_ok = row_tok < nq

    def body(c, carry):
        acc, m, l = carry
        slot = lax.rem(c - c_lo, jnp.int32(slots))
        if issue is not None:               # single warpgroup: the next chunk's copies first
            pl.when(c + 1 < c_hi)(lambda: issue(c + 1))
        plgpu.barrier_wait(k_full.at[slot])
        k_op = k_smem.at[slot]
        if quantized:                       # fp8/int8 -> compute dtype is exact; scales later
            widened[0][...] = _widen(k_smem.at[slot][...], cdt)
            k_cols = _columns(scale_smem[0].at[slot])
            plgpu.commit_smem()
            release(k_free.at[slot])                         # the raw slot is free again
            k_op = widened[0]

        def qk(acc_ref):
            for h in range(Qs):             # f32 q: q_hi.k + q_lo.k, f32 accumulation
                plgpu.wgmma(acc_ref, q_smem.at[h], k_op.T)
            return acc_ref[...]
        s = pl.run_scoped(qk, plgpu.ACC((R, C), jnp.float32))                 # [R, C] f32
        if not quantized:
            release(k_free.at[slot])                         # the wgmma has read K
        else:                               # q.(k * s_k) = (q.k) * s_k: scale score columns
            s = s * lax.broadcast_in_dim(k_cols, (R, C), [1])
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kpos = c * C + col
        mask = row_ok & (kpos <= row_pos)                   # row_pos < kv_len on real rows
        if windowed:
            mask = mask & (kpos > row_pos - window)
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(m_new, (R, C), [0])), 0.0)
        l = alpha * l + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, (R, D), [0])
        plgpu.barrier_wait(v_full.at[slot])
        v_op = v_smem.at[slot]
        if quantized:                       # p @ (v * s_v) = (p * s_v) @ v: scale P columns
            widened[1][...] = _widen(v_smem.at[slot][...], cdt)
            p = p * lax.broadcast_in_dim(_columns(scale_smem[1].at[slot]), (R, C), [1])
            plgpu.commit_smem()
            release(v_free.at[slot])
            v_op = widened[1]
        p_hi = p.astype(cdt)
        p_parts = [p_hi] + ([(p - p_hi.astype(jnp.float32)).astype(cdt)] if Qs == 2 else [])

        if in_place:                        # P from registers into the carried accumulator
            def pv(acc_ref):
                for part in p_parts:
                    plgpu.wgmma(acc_ref, part, v_op)
            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        else:                               # interpreter: P via SMEM, fresh accumulator
            for h, part in enumerate(p_parts):
                p_smem[h] = part
            plgpu.commit_smem()

            def pv(acc_ref):
                for h in range(Qs):
                    plgpu.wgmma(acc_ref, p_smem.at[h], v_op)
                return acc_ref[...]
            acc = acc + pl.run_scoped(pv, plgpu.ACC((R, D), jnp.float32))
        if not quantized:
            release(v_free.at[slot])                         # the wgmma has read V
        return acc, m_new, l

    if issue is not None:
        pl.when(c_lo < c_hi)(lambda: issue(c_lo))
    reduced = layout.reduce(1)
    init = (plgpu.layout_cast(jnp.zeros((R, D), jnp.float32), layout),
            plgpu.layout_cast(jnp.full((R,), MASK_VALUE, jnp.float32), reduced),
            plgpu.layout_cast(jnp.zeros((R,), jnp.float32), reduced))
    acc, m, l = lax.fori_loop(c_lo, c_hi, body, init)

    seen = l > 0.0                          # rows with no visible key in this split: o = 0
    l_safe = jnp.where(seen, l, 1.0)
    o = acc / lax.broadcast_in_dim(l_safe, (R, D), [0])
    lse_smem[...] = jnp.where(seen, m + jnp.log(l_safe), MASK_VALUE)
    o_hi = o.astype(o_smem.dtype)
    o_smem[0] = o_hi
    if Qs == 2:
        o_smem[1] = (o - o_hi.astype(jnp.float32)).astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(lse_smem, lse_out.at[kh, i, split])
    # Only the useful rows nq * Gp leave, through a ladder of power-of-two TMA boxes (their sizes
    # must be static): 64, 32, ..., 1 rows, each taken when its bit is set in the row count.
    useful = nq * gp
    start, size = 0, R
    while size:
        @pl.when(useful & size != 0)
        def _(start=start, size=size):
            for h in range(Qs):
                plgpu.copy_smem_to_gmem(o_smem.at[h, pl.ds(start, size)],
                                        o_out.at[kh, i, split, h, pl.ds(start, size)])
        start = start + (useful & size)
        size //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _attention_kernel(tile_meta_ref, bt_ref, q_ref, k_ref, v_ref, *refs, sm_scale, block_size,
                      gp, num_splits, soft_cap, windowed, slots, quantized, in_place,
                      warp_specialized):
    # GMEM: tile_meta_ref [NT, 8] int32; bt_ref [S, M'] (padded); q_ref [K, NT, Qs, R, D];
    #       k_ref/v_ref [N, B, K, D]; ks_ref/vs_ref [K, N, B] f32 (quantized only);
    #       o_out [K, NT, P, Qs, R, D] bf16; lse_out [K, NT, P, R] f32.
    refs = list(refs)
    scale_refs = (refs.pop(0), refs.pop(0)) if quantized else ()
    o_out, lse_out, q_smem, k_smem, v_smem, o_smem, lse_smem, meta_smem, idx_smem = refs[:9]
    meta_bar, q_bar, idx_bar, k_full, v_full, k_free, v_free = refs[9:16]
    extra = refs[16:]
    scale_smem = widened = p_smem = None
    if quantized:
        ks_smem, vs_smem, k_cmp, v_cmp, *extra = extra
        scale_smem, widened = (ks_smem, vs_smem), (k_cmp, v_cmp)
    if not in_place:
        p_smem, = extra
    C = k_smem.shape[1]
    ppc = C // block_size
    copies = functools.partial(
        _chunk_issuer, bt_ref, k_ref, v_ref, scale_refs, idx_smem, k_smem, v_smem, scale_smem,
        idx_bar, k_full, v_full, k_free, v_free, ppc=ppc, block_size=block_size, slots=slots)
    wg = lax.axis_index("wg") if warp_specialized else 0

    @pl.when(wg == (1 if warp_specialized else 0))
    def _():                        # the memory warpgroup brings the tile's metadata row in
        plgpu.copy_gmem_to_smem(tile_meta_ref.at[lax.axis_index("tile")], meta_smem, meta_bar)

    plgpu.barrier_wait(meta_bar)    # both warpgroups read it
    seq, p0, nq = meta_smem[0], meta_smem[1], meta_smem[2]
    c_lo, c_hi = _split_range(meta_smem[3], meta_smem[4], lax.axis_index("split"), num_splits)
    consume = functools.partial(
        _consumer, meta_smem, q_ref, o_out, lse_out, q_smem, k_smem, v_smem, o_smem, lse_smem,
        scale_smem, widened, p_smem, q_bar, k_full, v_full, k_free, v_free, seq_ok=None, p0=p0,
        nq=nq, window=meta_smem[5], c_lo=c_lo, c_hi=c_hi, gp=gp, sm_scale=sm_scale,
        soft_cap=soft_cap, windowed=windowed, slots=slots, in_place=in_place)
    if not warp_specialized:        # one warpgroup issues one chunk ahead and computes
        consume(issue=copies(seq=seq, c_lo=c_lo, wait_free=False))
        return

    @pl.when(wg == 0)
    def _():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        consume()

    @pl.when(wg == 1)
    def _():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        pl.loop(c_lo, c_hi)(copies(seq=seq, c_lo=c_lo, wait_free=True))


def _interpret_params(interpret):
    """True -> default GPU interpret mode; an InterpretGPUParams (e.g. detect_races=True) as
    given; False -> compiled."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


def tile_metadata(plan, meta, kv_chunk: int, sliding_window: int | None):
    """[NT, 8] int32 per tile: sequence, position of its first query, real query count, its
    visible chunks [c_first, c_end) (kv_len, causal end, window) and the window (NO_WINDOW:
    none). Computed once per call by XLA; the kernel copies its row into SMEM."""
    kv_len = meta.kv_lens.astype(jnp.int32)[plan.tile_seq]
    p0 = kv_len - plan.q_lens[plan.tile_seq] + plan.tile_qstart
    nq = plan.tile_nq
    hi = jnp.minimum(kv_len, p0 + nq)                       # one past the last visible key
    window = getattr(meta, "sliding_window", None)
    if window is not None:                                  # this layer's (traced) window
        window = window.reshape(-1)[0].astype(jnp.int32)
    elif sliding_window is not None:
        window = jnp.int32(sliding_window)
    if window is None:
        c_first = jnp.zeros_like(p0)
        window = jnp.int32(NO_WINDOW)
    else:                                                   # chunks wholly left of the window
        c_first = jnp.maximum(p0 - window + 1, 0) // kv_chunk
    c_end = jnp.where(nq > 0, (hi + kv_chunk - 1) // kv_chunk, c_first)
    zero = jnp.zeros_like(p0)
    cols = (plan.tile_seq, p0, nq, c_first, c_end, jnp.broadcast_to(window, p0.shape), zero, zero)
    return jnp.stack(cols, axis=1).astype(jnp.int32)


def padded_block_tables(block_tables, pages_per_chunk: int):
    """Block table columns padded with page 0 to a whole number of `idx_window`s past the last
    chunk any tile can reach, so every early copy of a window is in bounds (padded ids are
    masked keys)."""
    M = block_tables.shape[1]
    W = idx_window(pages_per_chunk)
    padded = W * -(-(M + pages_per_chunk) // W)
    return jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded - M)))


def _call_kernel(q_tiles, tile_meta, block_tables, k_cache, v_cache, k_scale, v_scale, *, gp,
                 sm_scale, soft_cap, windowed, kv_chunk, num_splits, slots, interpret,
                 ws_interpret=False):
    """Run the grid; returns normalised partials o [K, NT, P, Qs, R, D] bf16 (only useful rows
    written) and lse [K, NT, P, R] f32."""
    K, nt, Qs, R, D = q_tiles.shape
    B = k_cache.shape[1]
    cdt = q_tiles.dtype
    kvdt = k_cache.dtype
    quantized = k_scale is not None
    in_place = not interpret
    # Interpret mode runs each warpgroup as its own XLA CPU computation whose blocking barrier
    # callbacks hold a thread of XLA's CPU pool: on a 2-core machine the two warpgroups (and the
    # grid loop's own callback) exhaust it and deadlock (seen, jax 0.11.2). So the interpreter
    # runs the single-warpgroup form unless asked (`warp_specialized=True`, machines with more
    # cores); compiled kernels are always warp-specialised.
    warp_specialized = not interpret or ws_interpret
    P = num_splits
    ppc = kv_chunk // B
    bt = padded_block_tables(block_tables, ppc)
    kernel = functools.partial(
        _attention_kernel, sm_scale=sm_scale, block_size=B, gp=gp, num_splits=P,
        soft_cap=soft_cap, windowed=windowed, slots=slots, quantized=quantized,
        in_place=in_place, warp_specialized=warp_specialized)
    arrivals = ppc * (2 if quantized else 1)                # one per page copy (+ its scales)
    scratch = [
        plgpu.SMEM((Qs, R, D), cdt, transforms=_smem_transforms(cdt, D)),
        plgpu.SMEM((slots, kv_chunk, D), kvdt, transforms=_smem_transforms(kvdt, D)),
        plgpu.SMEM((slots, kv_chunk, D), kvdt, transforms=_smem_transforms(kvdt, D)),
        plgpu.SMEM((Qs, R, D), cdt),        # no tiling: the row ladder slices any row count
        plgpu.SMEM((R,), jnp.float32),
        plgpu.SMEM((8,), jnp.int32),
        plgpu.SMEM((idx_window(ppc),), jnp.int32),
        plgpu.Barrier(num_arrivals=1),                       # meta
        plgpu.Barrier(num_arrivals=Qs),                      # q
        plgpu.Barrier(num_arrivals=1),                       # page-id window
        plgpu.Barrier(num_arrivals=arrivals, num_barriers=slots),    # k_full
        plgpu.Barrier(num_arrivals=arrivals, num_barriers=slots),    # v_full
        plgpu.Barrier(num_arrivals=1, num_barriers=slots),           # k_free (compute wg)
        plgpu.Barrier(num_arrivals=1, num_barriers=slots),           # v_free
    ]
    operands = [tile_meta, bt, q_tiles, k_cache, v_cache]
    if quantized:
        # [K, N, B]: a page's B scales of one kv head contiguous, as a TMA copy needs
        operands += [k_scale.transpose(2, 0, 1), v_scale.transpose(2, 0, 1)]
        scratch += [plgpu.SMEM((slots, kv_chunk), jnp.float32),
                    plgpu.SMEM((slots, kv_chunk), jnp.float32),
                    plgpu.SMEM((kv_chunk, D), cdt, transforms=_smem_transforms(cdt, D)),
                    plgpu.SMEM((kv_chunk, D), cdt, transforms=_smem_transforms(cdt, D))]
    if not in_place:
        scratch.append(plgpu.SMEM((Qs, R, kv_chunk), cdt, transforms=_smem_transforms(cdt, kv_chunk)))
    out_type = (jax.ShapeDtypeStruct((K, nt, P, Qs, R, D), cdt),
                jax.ShapeDtypeStruct((K, nt, P, R), jnp.float32))
    call = plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch, grid=(K, nt, P),
        grid_names=("kv_head", "tile", "split"),
        **(dict(num_threads=2, thread_name="wg") if warp_specialized else {}),
        compiler_params=plgpu.CompilerParams(),
        interpret=_interpret_params(interpret))
    return call(*operands)


def merge_splits(o, lse):
    """Normalised split outputs o [..., P, Qs, R, D] (bf16 parts) and lse [..., P, R] ->
    [..., R, D] f32: weights exp(lse - max); a split with no visible key has lse MASK_VALUE and
    o 0. Rows no program wrote (past a tile's useful rows) hold garbage; `scatter_tiles` never
    reads them and nothing here mixes rows."""
    o = o.astype(jnp.float32).sum(axis=-3)                  # bf16 high + low -> f32
    if o.shape[-3] == 1:
        return o[..., 0, :, :]
    w = jnp.exp(lse - jnp.max(lse, axis=-2, keepdims=True))
    return jnp.sum(w[..., None] * o, axis=-3) / jnp.sum(w, axis=-2)[..., None]


# ----------------------------------------------------------------------------------------------
# Validation (the Triton kernel's checks plus what this kernel does not support yet)
# ----------------------------------------------------------------------------------------------
def _static_problem(q_dtype, kv_dtype, num_q_heads: int, num_kv_heads: int, head_dim: int,
                    block_size: int, kv_chunk: int, slots: int = 2) -> str | None:
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
    if not (isinstance(slots, numbers.Integral) and slots >= 2):
        return f"slots must be an int >= 2 (chunks in flight), got {slots!r}"
    need = smem_bytes(ROWS, D, kv_chunk, quantized=kv_dt in QUANTIZED_KV_DTYPES, q_parts=q_parts(q_dtype),
                      slots=slots, block_size=B)
    if need > SMEM_BYTES:
        return (f"kv_tokens={kv_chunk} with head_dim {D} and q {q_dtype} needs {need} bytes of shared memory, "
                f"over the {SMEM_BYTES} a Hopper block has")
    return None


def validate_mgpu(q, k_cache, v_cache, *, kv_chunk: int, num_splits: int, slots: int = 2) -> None:
    """Limits of this kernel beyond the shared contract; raises ValueError naming the field."""
    if not MGPU_AVAILABLE:
        raise ValueError(f"ragged_paged_attention_mgpu needs jax >= 0.11 (Mosaic GPU "
                         f"plgpu.kernel with GPU interpret mode); this is jax {jax.__version__}")
    _, H, D = q.shape
    B, K = k_cache.shape[1:3]
    problem = _static_problem(q.dtype, k_cache.dtype, H, K, D, B, kv_chunk, slots)
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
                           _kv_chunk(q_dtype, block_size, DEFAULT_BLOCK_SIZES[head_dim]),
                           DEFAULT_BLOCK_SIZES[head_dim].slots)


# ----------------------------------------------------------------------------------------------
# Default block sizes and the public entry
# ----------------------------------------------------------------------------------------------
def _kv_chunk(q_dtype, block_size: int, bs: MgpuBlockSizes, tuned: bool = True) -> int:
    """KV tokens per pipelined chunk: the table's (at most F32_Q_KV_TOKENS for f32 q: two Q
    and output parts), at least one page."""
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
                                             "kv_chunk", "bq", "gp", "num_splits", "slots",
                                             "interpret", "ws_interpret"))
def _mgpu_jit(q, k_cache, v_cache, meta, k_scale, v_scale, *, sm_scale, sliding_window, soft_cap,
              kv_chunk, bq, gp, num_splits, interpret, slots=2, ws_interpret=False):
    T, H, _ = q.shape
    K = k_cache.shape[2]
    plan = plan_tiles(meta, T, bq, gp)
    q_tiles = gather_q_tiles(q, meta, plan, K)                          # [K, NT, R, D]
    if q.dtype == jnp.float32:      # bf16 high + low parts: ~16 mantissa bits through wgmma
        hi = q_tiles.astype(jnp.bfloat16)
        q_tiles = jnp.stack([hi, (q_tiles - hi.astype(jnp.float32)).astype(jnp.bfloat16)], 2)
    else:
        q_tiles = q_tiles[:, :, None]                                   # [K, NT, Qs, R, D]
    tile_meta = tile_metadata(plan, meta, kv_chunk, sliding_window)
    windowed = sliding_window is not None or getattr(meta, "sliding_window", None) is not None
    o, lse = _call_kernel(q_tiles, tile_meta, meta.block_tables, k_cache, v_cache, k_scale,
                          v_scale, gp=gp, sm_scale=sm_scale, soft_cap=soft_cap, windowed=windowed,
                          kv_chunk=kv_chunk, num_splits=num_splits, slots=slots,
                          interpret=interpret, ws_interpret=ws_interpret)
    out = merge_splits(o, lse)                                          # [K, NT, R, D] f32
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
    slots = (block_sizes or DEFAULT_BLOCK_SIZES[q.shape[2]]).slots
    validate_mgpu(q, k_cache, v_cache, kv_chunk=kv_chunk, num_splits=splits, slots=slots)
    if all(_is_concrete(a) for a in (meta.cu_q_lens, meta.kv_lens, meta.block_tables,
                                     meta.num_seqs)):
        validate_metadata(meta, q.shape[0], k_cache.shape[0], k_cache.shape[1])
    if interpret is None:
        interpret = target_platform() != "gpu"
    return _mgpu_jit(q, k_cache, v_cache, meta, k_scale, v_scale, sm_scale=float(sm_scale),
                     sliding_window=None if sliding_window is None else int(sliding_window),
                     soft_cap=None if soft_cap is None else float(soft_cap), kv_chunk=kv_chunk,
                     bq=bq, gp=gp, num_splits=splits, slots=slots,
                     interpret=interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                     else bool(interpret))
