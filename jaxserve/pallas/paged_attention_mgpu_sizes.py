"""Sizes of the Mosaic GPU paged attention kernel: its block-size table, the shared memory one
program takes, how many programs share an SM, and a model of the bytes one call moves.

Pure Python (no jax), so the backend selection, the benchmarks and the tests can all ask it.
The kernel is jaxserve/pallas/paged_attention_mgpu.py; its docstring says what each buffer is.

Hopper (H100/H200) limits used here: 228 KiB of shared memory per SM, of which one block may
take 227 KiB, and 1 KiB of each resident block is reserved by the hardware; 64 K registers per
SM. wgmma's M is 64: a program owns ROWS = 64 query rows.
"""
from __future__ import annotations

import dataclasses
import math

ROWS = 64                        # wgmma M: query rows per program
SMEM_PER_BLOCK = 227 * 1024      # the most one block may opt in to
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_BLOCK = 1024   # taken by the hardware for each resident block
REGISTERS_PER_SM = 64 * 1024
IDX_WINDOW_MIN = 128             # page ids one early copy brings into shared memory
BARRIER_AND_SLACK = 1024         # barriers, alignment padding between buffers


@dataclasses.dataclass(frozen=True)
class MgpuBlockSizes:
    """kv_tokens: KV tokens per pipelined chunk (a multiple of the page size and of 64).
    num_splits: KV splits per query tile (None: enough to fill the GPU, `default_num_splits`).
    slots: chunks in flight between the memory warpgroup and the compute warpgroup."""
    kv_tokens: int
    num_splits: int | None = None
    slots: int = 2


# head_dim -> block sizes. Chosen so a bf16 or fp8 cache leaves room for two programs per SM
# where that is possible (`smem_bytes` / `ctas_per_sm`, bf16 q, 16-token pages; checked by
# tests/test_paged_attention_mgpu.py::test_block_table_fits_two_programs_per_sm):
#   D=64   C=128, 2 slots:  bf16 cache 82 KiB, fp8 84 KiB   -> 2 programs per SM
#   D=128  C=64,  2 slots:  bf16 cache 98 KiB, fp8 99 KiB   -> 2 programs per SM (was 193 KiB, 1)
#   D=256  not shipped: compiled for an H100 (`jaxserve compile --kernels`, 2026-11-27) its compute
#          warpgroup spills registers at 216 per thread (12 bytes with a bf16 cache, 1100 with fp8);
#          and it took 194-195 KiB, one program per SM (Q alone is 32 KiB and one 64-token K+V
#          chunk 64 KiB; chunks below 64 tokens fail Mosaic GPU's layout inference). The Triton
#          kernel serves head_dim 256; explicit block sizes still reach this kernel (tests).
# Shared memory is not the only limit: ptxas gives the kernel 216 registers per thread at launch
# (the setmaxnreg ceiling below), 55,296 per 256-thread program, so one program fits an SM's 64 K
# registers whatever the shared memory allows, until the launch is capped at 128 (compile report).
# 2 slots: with two programs per SM each keeps ~one 32 KiB chunk in flight while it computes on
# the other, 64 KiB per SM, about 2.5x what Little's law asks at H100 latency (3.35 TB/s x ~1 us
# / 132 SMs = 25 KiB). f32 q (the accuracy path, C <= 64) doubles Q and the output: D=64 66 KiB,
# D=128 130 KiB (one program per SM), D=256 does not fit.
# Untimed: no GPU has run this kernel yet (benchmarks/gpu_suite.sh does).
DEFAULT_BLOCK_SIZES = {
    64: MgpuBlockSizes(kv_tokens=128),
    128: MgpuBlockSizes(kv_tokens=64),
}
TARGET_PROGRAMS = 264            # two programs per H100 SM (132 SMs)
MAX_SPLITS = 32
# setmaxnreg split of a program's registers (two warpgroups, 256 threads): at two programs per
# SM each has 32 K registers = 128 per thread at launch; the memory warpgroup gives back down to
# 40 and the compute warpgroup takes (256 - 40) = 216 (multiples of 8).
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 216


def q_parts(dtype_name: str) -> int:
    """bf16 parts q (and P, and the output) are split into for wgmma: f32 is high + low."""
    return 2 if str(dtype_name) == "float32" else 1


def idx_window(pages_per_chunk: int) -> int:
    """Page ids per early copy into shared memory: a multiple of the pages in a chunk (a chunk
    never straddles two windows) and of 4 (16-byte TMA rows), at least IDX_WINDOW_MIN."""
    step = math.lcm(pages_per_chunk, 4)
    return step * -(-IDX_WINDOW_MIN // step)


def smem_bytes(rows: int, head_dim: int, kv_chunk: int, *, quantized: bool = False,
               q_parts: int = 1, slots: int = 2, block_size: int = 16,
               interpret: bool = False) -> int:
    """Shared memory one program allocates (compiled kernel; `interpret=True` adds the P buffer
    the interpreter needs, see the kernel docstring):
      Q [parts, R, D] bf16; K and V [slots, C, D] at the cache's width (1 byte fp8/int8, else
      bf16); quantised only: the chunk widened to bf16 (K and V [C, D]) and f32 scales [slots, C]
      for K and V; out [parts, R, D] bf16; lse [R] f32; tile metadata 8 int32; page ids
      [idx_window] int32; barriers and alignment."""
    kv_width = 1 if quantized else 2
    total = q_parts * rows * head_dim * 2
    total += 2 * slots * kv_chunk * head_dim * kv_width
    if quantized:
        total += 2 * kv_chunk * head_dim * 2 + 2 * slots * kv_chunk * 4
    total += q_parts * rows * head_dim * 2 + rows * 4 + 8 * 4
    total += idx_window(max(1, kv_chunk // block_size)) * 4
    if interpret:
        total += q_parts * rows * kv_chunk * 2
    return total + BARRIER_AND_SLACK


def ctas_per_sm(smem: int) -> int:
    """Programs one SM holds by shared memory alone (registers: see CONSUMER_REGISTERS)."""
    return SMEM_PER_SM // (smem + SMEM_RESERVED_PER_BLOCK)


def default_num_splits(num_kv_heads: int, num_tiles: int, max_chunks: int) -> int:
    """Enough KV splits to fill the GPU, never more than the longest context has chunks."""
    want = -(-TARGET_PROGRAMS // max(1, num_kv_heads * num_tiles))
    return int(max(1, min(1 << (want - 1).bit_length(), MAX_SPLITS, max_chunks)))


@dataclasses.dataclass(frozen=True)
class BytesMoved:
    """Device-memory traffic of one call, by what moves it (bytes)."""
    kv: int             # K and V pages read by the kernel
    kv_scales: int      # per-token-head f32 scales of an fp8/int8 cache (and their transpose)
    q: int              # query tiles: the gather (read q, write tiles) and the kernel's read
    page_ids: int       # block-table windows read by the kernel, plus the padded copy
    out: int            # partial outputs and lse written, read back by the merge, final output
    total: int

    @property
    def kv_fraction(self) -> float:
        return self.kv / self.total if self.total else 0.0


def bytes_moved(q_lens, kv_lens, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                block_size: int, kv_dtype_bytes: int = 2, q_dtype_bytes: int = 2,
                num_pages: int | None = None, max_pages_per_seq: int | None = None,
                block_sizes: MgpuBlockSizes | None = None, sliding_window: int | None = None
                ) -> BytesMoved:
    """Model of the bytes one `ragged_paged_attention_mgpu` call moves, for concrete lengths.

    Follows the kernel's plan: tiles of bq = ROWS // Gp tokens of one sequence; each tile reads
    the whole chunks [c_first, c_end) its queries can see (causal end, window), every chunk's
    pages of one kv head, once per tile (a prefill chunk of several tiles rereads its prefix);
    splits cut that range and only write the useful rows (nq * Gp of 64) in bf16 plus a 64-row
    f32 lse. kv_dtype_bytes 1 is an fp8/int8 cache (with f32 scales). Everything is per call,
    so for a model multiply by its layers.
    """
    H, K, D, B = num_q_heads, num_kv_heads, head_dim, block_size
    G = H // K
    gp = 1 << (G - 1).bit_length()
    bq = ROWS // gp
    bs = block_sizes or DEFAULT_BLOCK_SIZES[D]
    C = max(bs.kv_tokens, B)
    parts = 2 if q_dtype_bytes == 4 else 1
    M = max_pages_per_seq or max(1, -(-max(kv_lens) // B))
    tiles = []                                    # (nq, c_first, c_end) per real tile
    for q_len, kv_len in zip(q_lens, kv_lens):
        for start in range(0, q_len, bq):
            nq = min(bq, q_len - start)
            p0 = kv_len - q_len + start
            c_first = 0 if sliding_window is None else max(p0 - sliding_window + 1, 0) // C
            tiles.append((nq, c_first, -(-min(kv_len, p0 + nq) // C)))
    nt = max(1, min(sum(q_lens), -(-sum(q_lens) // bq) + len(q_lens)))
    max_chunks = -(-(M * B) // C)
    splits = bs.num_splits or default_num_splits(K, nt, max_chunks)
    chunks = sum(c_end - c_first for _, c_first, c_end in tiles)
    kv = chunks * C * D * K * 2 * kv_dtype_bytes
    scales = chunks * C * K * 2 * 4 if kv_dtype_bytes == 1 else 0
    if scales:                                    # the wrapper's [N, B, K] -> [K, N, B] transpose
        scales += 2 * 2 * (num_pages or M * len(q_lens)) * B * K * 4
    T = sum(q_lens)
    q = T * H * D * q_dtype_bytes + 2 * K * nt * parts * ROWS * D * 2
    window = idx_window(max(1, C // B))
    padded_m = window * -(-(M + C // B) // window)
    page_ids = chunks and sum(-(-(c_end - c_first) * (C // B) // window) + 1
                              for _, c_first, c_end in tiles) * window * 4 * K
    page_ids += len(q_lens) * (M + padded_m) * 4
    useful_rows = sum(nq for nq, _, _ in tiles) * gp
    partial = K * splits * (useful_rows * parts * D * 2) + K * nt * splits * ROWS * 4
    out = partial + (partial if splits > 1 else 0) + T * H * D * q_dtype_bytes
    total = kv + scales + q + page_ids + out
    return BytesMoved(kv=kv, kv_scales=scales, q=q, page_ids=page_ids, out=out, total=total)
