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

This module plans the tiles, checks the inputs and merges the splits; the device program (the
two warpgroups' code, the kernel body and the `plgpu.kernel` call) is
jaxserve/pallas/paged_attention_mgpu_kernel.py.

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

from jaxserve.pallas.common import target_platform
from jaxserve.pallas.paged_attention import (  # noqa: F401 (MASK_VALUE re-exported)
    MASK_VALUE,
    QUANTIZED_KV_DTYPES,
    _is_concrete,
    validate_inputs,
    validate_metadata,
)
from jaxserve.pallas.paged_attention_mgpu_kernel import (  # noqa: F401 (plgpu re-exported)
    MGPU_AVAILABLE,
    call_kernel,
    padded_block_tables,
    plgpu,
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

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
SMEM_BYTES = SMEM_PER_BLOCK      # kept name: the per-block limit
F32_Q_KV_TOKENS = 64             # f32 q: chunks of at most 64 tokens (two Q and out parts)
NO_WINDOW = 1 << 30              # the metadata row's window when none applies
META_COLS = 8                    # seq, p0, nq, c_first, c_end, window, 0, 0 (32 bytes: one TMA)


def q_parts(dtype) -> int:
    """bf16 parts q (and P, and the output) are split into for wgmma: f32 is high + low."""
    return 2 if jnp.dtype(dtype) == jnp.float32 else 1


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
    o, lse = call_kernel(q_tiles, tile_meta, meta.block_tables, k_cache, v_cache, k_scale,
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
