"""A W4A16 matmul for Hopper: Mosaic GPU kernel (Marlin's idea on wgmma), its weight layout, its reference.

    y [M, N] = x [M, K] @ dequant(w)     dequant(w)[k, n] = (code[k, n] - zero[k // g, n]) * scale[k // g, n]

The operands are swapped (each program computes a tile of y^T = W^T x^T): wgmma's M is 64 rows per
warpgroup and its N 8..256, so the weight's output columns take the 64-row side and the few tokens
of a decode step the narrow one (16 rows at M <= 16, not 64 rows of padding). The weight is
therefore kept K-major, one re-layout at load
(`Int4KernelWeight`, built by `kernel_layout` from the loader's `Int4Weight`, `jaxserve.layers.int4`):

  codes: int4 [N, K], the stored code minus 8 (signed: Mosaic GPU's int4 -> bf16 register upcast is
         for signed int4), the same 0.5 byte per weight as the packed int32 words;
  scale: [K / g, N] in the compute dtype (bf16 or f16);
  bias:  [K / g, N] = (8 - zero) * scale, or None for symmetric weights (zero 8), so that
         dequant = code' * scale + bias, one FMA per weight in registers.

Kernel (`int4_matmul_mgpu`, jax >= 0.11, entered through `plgpu.kernel`): grid (N / 64, M tiles),
one warpgroup per program. Per K step of `tk = clip(g, 64, 128)` rows (one group, or two of 32,
each group's scale and bias row applied to its own columns) a TMA copy brings the code tile
[64, tk], the activation tile [tm, tk] and the scale (and bias) rows [64] into one of S
shared-memory slots; the next S - 1 steps' copies fly while this one multiplies. The codes are
loaded into registers in the WGMMA_UPCAST_4X layout, upcast to bf16, relaid to the WGMMA layout,
scaled (FMA with the scale and bias rows broadcast along K), staged in shared memory and
multiplied by `wgmma(acc [64, tm] f32, w_smem_bf16, x_smem^T)`; the step's slot is refilled once
its wgmma is done. Why staged, not the register operand wgmma allows (Machete's way): the GPU
interpreter runs wgmma from shared memory only, and the parity gate should run the path that
ships; the staging costs 2 * 64 * tk bytes of SMEM traffic per step, not HBM. The f32 accumulator
y^T [64, tm] is cast to the compute dtype and stored transposed (the WGMMA_TRANSPOSED register
layout) into a [tm, 64] tile of y, so y is written once, in place, with no transpose after.

Bytes moved per call (HBM; M rows, K inputs, N outputs, group g, tm the M tile, b the activation
itemsize, T = ceil(M / tm) M tiles):
  codes   T * K * N / 2                    (once per M tile: once in all at decode, M <= tm)
  scales  T * (K / g) * N * 2 * (1 + asym) (bf16 scale, and bias when asymmetric: 4 / g or 8 / g
                                             bytes per weight, 3% / 6% of the codes at g = 128,
                                             12.5% / 25% at g = 32)
  x       (N / 64) * M * K * 2             (bf16; each N tile re-reads the activations, L2 absorbs most)
  y       M * N * 2                        (bf16; a cast to b after, for f32 activations)
At decode the codes dominate: K * N * (0.5 + 2 * (1 + asym) / g) bytes against 2 K N for a bf16
weight, 3.9x fewer at g = 128 (symmetric), 3.2x at g = 32 (asymmetric). The XLA path (`int4_linear`) moves the
same codes but writes and reads each dequantised tile through memory.

Status: interpret mode (with the race detector) and CUDA lowering pass on jax 0.11.2 (CPU); never
compiled or timed on a GPU (tests/test_int4_matmul_mgpu.py's `gpu` tests do that), so it is never
the "auto" kernel (`resolve_int4_kernel`): `kernel="pallas"` selects it explicitly. Untuned: no
producer warpgroup, no persistent grid, no split-K (decode programs number N / 64: 64 for N = 4096
on 132 SMs, the first thing tuning changes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.pallas.common import pad_to

try:  # Mosaic GPU's Pallas API as used here is jax >= 0.11 (plgpu.kernel + GPU interpret mode)
    from jax.experimental.pallas import mosaic_gpu as plgpu
    MGPU_AVAILABLE = hasattr(plgpu, "InterpretGPUParams") and hasattr(plgpu, "kernel")
except ImportError:  # pragma: no cover - depends on the installed jax
    plgpu = None
    MGPU_AVAILABLE = False

TILE_N = 64                         # wgmma M per warpgroup: W^T rows per program
SYMMETRIC_ZERO = 8


@dataclasses.dataclass
class Int4KernelWeight:
    """A [..., in, out] int4 matrix in the kernel's layout (module docstring); stacked layers lead.

    codes: int4 [..., out, in] (stored code - 8); scale, bias: [..., in / g, out] in the compute dtype
    (bias None: symmetric); perm: int32 [..., in] act-order permutation applied to x, or None."""

    codes: jax.Array
    scale: jax.Array
    bias: jax.Array | None = None
    perm: jax.Array | None = None
    group_size: int = 128

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.codes.shape[:-2], self.codes.shape[-1], self.codes.shape[-2])

    @property
    def dtype(self):
        return self.scale.dtype

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.codes, self.scale, self.bias, self.perm) if a is not None)


jax.tree_util.register_dataclass(Int4KernelWeight, data_fields=["codes", "scale", "bias", "perm"],
                                 meta_fields=["group_size"])


def kernel_layout(codes: jax.Array, scale: jax.Array, zero: jax.Array | None, perm: jax.Array | None,
                  group_size: int, dtype=jnp.bfloat16) -> Int4KernelWeight:
    """Unpacked codes uint8 [..., in, out] (0..15, rows in storage order), scale [..., in / g, out],
    zero uint8 [..., in / g, out] or None -> the kernel's layout (done once, at load)."""
    if dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"the int4 kernel computes in bfloat16 or float16, got dtype {jnp.dtype(dtype).name}")
    signed = (codes.astype(jnp.int8) - SYMMETRIC_ZERO).astype(jnp.int4)
    s32 = scale.astype(jnp.float32)
    bias = None if zero is None else ((SYMMETRIC_ZERO - zero.astype(jnp.float32)) * s32).astype(dtype)
    return Int4KernelWeight(jnp.swapaxes(signed, -1, -2), s32.astype(dtype), bias, perm, group_size)


def dequantize(w: Int4KernelWeight) -> jax.Array:
    """The whole matrix [..., in, out] in f32 (rows in storage order): the reference's weight."""
    g = w.group_size
    c = jnp.swapaxes(w.codes, -1, -2).astype(jnp.float32)                       # [..., K, N]
    s = jnp.repeat(w.scale.astype(jnp.float32), g, axis=-2)
    b = 0.0 if w.bias is None else jnp.repeat(w.bias.astype(jnp.float32), g, axis=-2)
    return c * s + b


def ref_int4_matmul(x: jax.Array, w: Int4KernelWeight) -> jax.Array:
    """x [M, K] @ the dequantised weight in f32 at HIGHEST precision (the oracle), f32 [M, N]."""
    if w.perm is not None:
        x = jnp.take(x, w.perm, axis=-1)
    return jnp.dot(x.astype(jnp.float32), dequantize(w), precision=lax.Precision.HIGHEST)


@dataclasses.dataclass(frozen=True)
class Int4Tiles:
    """tile_m: activation rows per program (wgmma N: a multiple of 8, 8..256); stages: shared-memory
    slots the K loop cycles through (stages - 1 steps' copies in flight)."""

    tile_m: int
    stages: int = 4

    def __post_init__(self):
        if self.tile_m % 8 or not 8 <= self.tile_m <= 256:
            raise ValueError(f"tile_m must be a multiple of 8 in 8..256, got {self.tile_m}")
        if self.stages < 2:
            raise ValueError(f"stages must be >= 2, got {self.stages}")


# Untuned until a GPU run. Decode reads the weight once: small M tiles, deep pipeline.
DECODE_TILES = Int4Tiles(16, stages=6)       # M <= 16
MID_TILES = Int4Tiles(64, stages=4)          # M <= 64
PREFILL_TILES = Int4Tiles(128, stages=4)     # larger M
SHIPPED_TILES = (DECODE_TILES, MID_TILES, PREFILL_TILES)


def default_tiles(m: int) -> Int4Tiles:
    return DECODE_TILES if m <= 16 else MID_TILES if m <= 64 else PREFILL_TILES


def k_step(group_size: int) -> int:
    """K rows per pipeline step: one group, at most 128 rows (a 256-row group is two steps), at
    least 64 (a 32-row tile of codes is 16 bytes, below the smallest swizzle: two groups a step)."""
    return max(min(group_size, 128), 64)


def smem_bytes(tiles: Int4Tiles, group_size: int, dtype=jnp.bfloat16, asym: bool = True) -> int:
    tk, it = k_step(group_size), jnp.dtype(dtype).itemsize
    gps = max(1, tk // group_size)
    per_slot = TILE_N * tk // 2 + tiles.tile_m * tk * it + gps * TILE_N * it * (2 if asym else 1)
    return tiles.stages * per_slot + TILE_N * (tk + tiles.tile_m) * it


def _transforms(dtype, minor: int):
    bits = jnp.dtype(dtype).itemsize * 8 if dtype != jnp.int4 else 4
    swizzle = plgpu.find_swizzle(minor * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def _int4_kernel(w_ref, s_ref, b_ref, x_ref, o_ref, w_smem, s_smem, b_smem, x_smem, deq_smem, o_smem, bar,
                 *, k_steps, steps_per_group, gps, g):
    # GMEM: w_ref [Np, K] int4 (K-major); s_ref, b_ref [G, Np] (b_ref None: symmetric);
    #       x_ref [Mp, K]; o_ref [Mp, Np].
    # SMEM: w_smem [S, 64, tk]; s_smem, b_smem [S, gps, 64] (gps = groups per step);
    #       x_smem [S, tm, tk]; deq_smem [64, tk] (the step's dequantised W^T tile); o_smem [tm, 64].
    # Step kb uses slot kb % S; its slot is refilled with step kb + S once its wgmma has finished.
    tm, tn = o_smem.shape
    S = w_smem.shape[0]
    tk = w_smem.shape[2]
    ni, mi = lax.axis_index("n"), lax.axis_index("m")
    cols, rows = pl.ds(ni * tn, tn), pl.ds(mi * tm, tm)
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def fetch(kb, slot):
        ks = pl.ds(kb * tk, tk)
        groups = pl.ds(kb // steps_per_group * gps, gps)         # the step's gps scale rows
        plgpu.copy_gmem_to_smem(w_ref.at[cols, ks], w_smem.at[slot], bar.at[slot])
        plgpu.copy_gmem_to_smem(x_ref.at[rows, ks], x_smem.at[slot], bar.at[slot])
        plgpu.copy_gmem_to_smem(s_ref.at[groups, cols], s_smem.at[slot], bar.at[slot])
        if b_ref is not None:
            plgpu.copy_gmem_to_smem(b_ref.at[groups, cols], b_smem.at[slot], bar.at[slot])

    for j in range(min(S, k_steps)):                          # the pipeline's first steps
        fetch(j, j)

    def mma_all(acc_ref):
        def body(kb, carry):
            slot = lax.rem(kb, S)
            plgpu.barrier_wait(bar.at[slot])
            codes = plgpu.load(w_smem.at[slot], layout=plgpu.Layout.WGMMA_UPCAST_4X)
            w = plgpu.layout_cast(codes, plgpu.Layout.WGMMA).astype(x_smem.dtype)      # [64, tk]
            parts = []
            for h in range(gps):                                  # each group of the step: its own row
                part = lax.slice(w, (0, h * g), (tn, (h + 1) * g)) if gps > 1 else w
                scale = plgpu.load(s_smem.at[slot, h], layout=row_layout)
                part = part * lax.broadcast_in_dim(scale, part.shape, [0])
                if b_ref is not None:
                    bias = plgpu.load(b_smem.at[slot, h], layout=row_layout)
                    part = part + lax.broadcast_in_dim(bias, part.shape, [0])
                parts.append(part)
            deq_smem[...] = lax.concatenate(parts, 1) if gps > 1 else parts[0]
            plgpu.commit_smem()                                  # register stores before wgmma reads them
            plgpu.wgmma(acc_ref, deq_smem, x_smem.at[slot].T)    # [64, tm] += W^T tile @ x^T tile
            plgpu.wgmma_wait(0)
            # this step's reads of the slot (register loads, the wgmma) are done: fence them
            # before the TMA that refills it
            plgpu.commit_smem()

            @pl.when(kb + S < k_steps)
            def _():
                fetch(kb + S, slot)
            return carry
        lax.fori_loop(0, k_steps, body, None)
        return acc_ref[...]

    acc = pl.run_scoped(mma_all, plgpu.ACC((tn, tm), jnp.float32))
    o_smem.T[...] = plgpu.layout_cast(acc.astype(o_smem.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[rows, cols])
    plgpu.wait_smem_to_gmem(0)


def _check(x: jax.Array, w: Int4KernelWeight) -> None:
    if x.ndim != 2 or w.codes.ndim != 2:
        raise ValueError(f"x must be [M, K] and the codes [N, K], got {x.shape} and {w.codes.shape}")
    n, k = w.codes.shape
    if x.shape[1] != k:
        raise ValueError(f"x [M, K={x.shape[1]}] and the weight [K={k}, N] disagree on K")
    if w.codes.dtype != jnp.int4:
        raise ValueError(f"codes must be int4 (kernel_layout), got {w.codes.dtype}")
    g = w.group_size
    if g % 32 or k % g or (g > 128 and g % 128):
        raise ValueError(f"group_size must be 32, 64, 128 or a multiple of 128 dividing K={k} for the kernel, "
                         f"got {g}")
    if k % k_step(g):
        raise ValueError(f"K={k} must be a multiple of the kernel's {k_step(g)}-row K step (group_size {g})")
    if w.scale.shape != (k // g, n) or (w.bias is not None and w.bias.shape != w.scale.shape):
        raise ValueError(f"scale and bias must be [K / g, N] = {(k // g, n)}, got {w.scale.shape}"
                         f"{'' if w.bias is None else f' and {w.bias.shape}'}")


def int4_matmul_mgpu(x: jax.Array, w: Int4KernelWeight, *, tiles: Int4Tiles | None = None,
                     interpret=None) -> jax.Array:
    """x [M, K] @ the int4 weight [K, N] -> [M, N] in x.dtype by the Mosaic GPU kernel (Hopper).

    x is multiplied in the weight's compute dtype (bf16 or f16; f32 activations are rounded to it),
    f32 accumulation. The wrapper pads M to the tile and N to 64 (a padded weight is a copy: serving
    shapes have N a multiple of 64)."""
    if not MGPU_AVAILABLE:
        raise ValueError(f"int4_matmul_mgpu needs jax >= 0.11 (Mosaic GPU plgpu.kernel); this is jax "
                         f"{jax.__version__}")
    _check(x, w)
    out_dtype = x.dtype
    if w.perm is not None:
        x = jnp.take(x, w.perm, axis=-1)
    cdt = w.scale.dtype
    m, k = x.shape
    n = w.codes.shape[0]
    tiles = tiles or default_tiles(m)
    tm, S = tiles.tile_m, tiles.stages
    tk = k_step(w.group_size)
    gps = max(1, tk // w.group_size)
    xp = pad_to(x.astype(cdt), 0, tm)
    codes = pad_to(w.codes, 0, TILE_N)
    scale = pad_to(w.scale, 1, TILE_N)
    bias = None if w.bias is None else pad_to(w.bias, 1, TILE_N)
    mp, np_ = xp.shape[0], codes.shape[0]
    scratch = [plgpu.SMEM((S, TILE_N, tk), jnp.int4, transforms=_transforms(jnp.int4, tk)),
               plgpu.SMEM((S, gps, TILE_N), cdt),
               plgpu.SMEM((S, gps, TILE_N), cdt) if bias is not None else None,
               plgpu.SMEM((S, tm, tk), cdt, transforms=_transforms(cdt, tk)),
               plgpu.SMEM((TILE_N, tk), cdt, transforms=_transforms(cdt, tk)),
               plgpu.SMEM((tm, TILE_N), cdt, transforms=_transforms(cdt, TILE_N)),
               plgpu.Barrier(num_arrivals=4 if bias is not None else 3, num_barriers=S)]
    asym = bias is not None

    def kernel(*refs):
        if asym:
            w_ref, s_ref, b_ref, x_ref, o_ref, w_smem, s_smem, b_smem, x_smem, deq_smem, o_smem, bar = refs
        else:
            w_ref, s_ref, x_ref, o_ref, w_smem, s_smem, x_smem, deq_smem, o_smem, bar = refs
            b_ref = b_smem = None
        _int4_kernel(w_ref, s_ref, b_ref, x_ref, o_ref, w_smem, s_smem, b_smem, x_smem, deq_smem, o_smem, bar,
                     k_steps=k // tk, steps_per_group=max(1, w.group_size // tk), gps=gps, g=w.group_size)

    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((mp, np_), cdt),
        scratch_types=[s for s in scratch if s is not None],
        grid=(np_ // TILE_N, mp // tm), grid_names=("n", "m"), compiler_params=plgpu.CompilerParams(),
        interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                   else plgpu.InterpretGPUParams() if interpret else None))
    args = (codes, scale) + ((bias,) if asym else ()) + (xp,)
    return call(*args)[:m, :n].astype(out_dtype)

