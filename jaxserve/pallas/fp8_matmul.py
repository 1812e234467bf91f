"""FP8 (e4m3) weight matmul: the jnp reference, the XLA path, and the quantisers they share.

    y [M, N] = x [M, K] @ dequant(w [K, N] e4m3, w_scale)

Weight scales (f32 multipliers, `w_f32 = w * scale`), told apart by the scale's shape:
  per-tensor   [1, 1]
  per-channel  [1, N]                       (one per output column)
  groups       [ceil(K / b), N]             (one per output column and 1 x b group of K, the
                                              layout of compressed-tensors' "group" strategy)
  blocks       [ceil(K / b), ceil(N / b)]   (b x b tiles, b = `block_size`, 128 in every
                                              checkpoint seen: DeepSeek-V3, Qwen3-*-FP8)
Activations:
  W8A16: x stays bf16/f32; the weight is widened (exact) and the scale applied after the dot.
  W8A8:  x is quantised to e4m3 per token (per-tensor / per-channel weights) or per 1 x b group
         of K (block and group weights, DeepGEMM's scheme), `quantize_activations`; both operands fp8,
         f32 accumulation, the two scales applied to the f32 result.
Output: f32 from the reference; the activation dtype from `fp8_matmul`.

`fp8_matmul(..., kernel="xla")` is the path for CPU and the fallback: per-tensor / per-channel
is a dot on the fp8 operands with the scales around it, which XLA on Hopper rewrites into a
cuBLASLt FP8 GEMM; block and group scales have no XLA FP8 GEMM, so the weight is dequantised into the
activation dtype and multiplied there (the cost a Mosaic GPU kernel saves, see the issue).

`fp8_matmul(..., kernel="pallas")` is `fp8_matmul_mgpu`, a Mosaic GPU kernel for Hopper (jax >=
0.11, entered through `plgpu.kernel`), W8A8 only (W8A16 goes to XLA): grid (M tiles, N tiles), one
warpgroup per program; per 128-wide K slice a TMA copy of the x tile [tm, 128] and the K-major
weight tile [tn, 128] into one of S SMEM slots (the next S - 1 slices' copies fly while this
one multiplies), an e4m3 x e4m3 wgmma with f32 accumulation; block scales are applied to each slice's
product in registers (DeepGEMM's promotion), per-tensor / per-channel scales once at the end.
Tiles: `DECODE_TILES` (64 x 64, 6 slots) for M <= 64, `PREFILL_TILES` (128 x 128, 4 slots) above.
Status: interpret mode (with the race detector) and CUDA lowering pass on jax 0.11.2 (CPU); not
yet compiled or timed on a GPU (tests/test_fp8_matmul_mgpu.py's `gpu` tests and
benchmarks/bench_fp8_matmul.py do that). Untuned: no producer warpgroup, no persistent
grid, split-K or multicast; `benchmarks/bench_fp8_matmul.py` is where tuning starts.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.pallas.common import pad_to

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)      # 448
BLOCK = 128
_TINY = 1e-12                            # floor on scales: an all-zero row quantises to zeros


GRANULARITIES = ("tensor", "channel", "group", "block")


def scale_kind(scale_shape: tuple[int, ...], n: int) -> str:
    """"tensor", "channel", "group" or "block" from the trailing two dims of a weight scale
    (a group scale with one row is a channel scale: the same numbers)."""
    rows, cols = scale_shape[-2:]
    if rows == 1 and cols == 1 and n != 1:
        return "tensor"
    if rows == 1 and cols == n:
        return "channel"
    if cols == n and n != 1:
        return "group"
    return "block"


def expand_scale(scale: jax.Array, k: int, n: int, block_size: int = BLOCK) -> jax.Array:
    """scale [..., r, c] -> [..., K, N] (blocks and groups repeated, per-tensor / per-channel
    broadcast)."""
    if scale.shape[-2] == 1 and scale.shape[-1] in (1, n):
        return jnp.broadcast_to(scale, (*scale.shape[:-2], k, n))
    s = jnp.repeat(scale, block_size, axis=-2)
    if scale.shape[-1] != n:                                      # blocks: b x b tiles
        s = jnp.repeat(s, block_size, axis=-1)
    return s[..., :k, :n]


def dequantize(w: jax.Array, scale: jax.Array, dtype=jnp.float32, block_size: int = BLOCK):
    """w [..., K, N] e4m3 and its scale -> the weight in `dtype` (product taken in f32)."""
    k, n = w.shape[-2:]
    return (w.astype(jnp.float32) * expand_scale(scale, k, n, block_size)).astype(dtype)


def quantize_weight(w: jax.Array, granularity: str = "channel", block_size: int = BLOCK):
    """w [..., K, N] float -> (e4m3 [..., K, N], f32 scale) with amax / 448 scales per tensor,
    output channel, 1 x b group of K per output channel, or b x b block (partial edge groups and
    blocks take their own amax)."""
    w32 = w.astype(jnp.float32)
    *lead, k, n = w.shape
    if granularity == "tensor":
        amax = jnp.max(jnp.abs(w32), axis=(-2, -1), keepdims=True)
    elif granularity == "channel":
        amax = jnp.max(jnp.abs(w32), axis=-2, keepdims=True)
    elif granularity == "block":
        kb, nb = math.ceil(k / block_size), math.ceil(n / block_size)
        padded = jnp.pad(jnp.abs(w32), [(0, 0)] * len(lead) + [(0, kb * block_size - k),
                                                               (0, nb * block_size - n)])
        amax = padded.reshape(*lead, kb, block_size, nb, block_size).max(axis=(-3, -1))
    elif granularity == "group":
        kb = math.ceil(k / block_size)
        padded = jnp.pad(jnp.abs(w32), [(0, 0)] * len(lead) + [(0, kb * block_size - k), (0, 0)])
        amax = padded.reshape(*lead, kb, block_size, n).max(axis=-2)
    else:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    scale = jnp.maximum(amax / FP8_MAX, _TINY)
    q = (w32 / expand_scale(scale, k, n, block_size)).clip(-FP8_MAX, FP8_MAX).astype(FP8)
    return q, scale


def quantize_activations(x: jax.Array, group: int | None = None):
    """x [M, K] -> (e4m3 [M, K], f32 scale [M, 1]) per token, or [M, ceil(K / group)] per
    1 x group slice of K when `group` is given (block- and group-scaled weights)."""
    x32 = x.astype(jnp.float32)
    m, k = x.shape
    if group is None:
        scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / FP8_MAX, _TINY)
        return (x32 / scale).clip(-FP8_MAX, FP8_MAX).astype(FP8), scale
    g = math.ceil(k / group)
    xp = jnp.pad(x32, ((0, 0), (0, g * group - k))).reshape(m, g, group)
    scale = jnp.maximum(jnp.max(jnp.abs(xp), axis=-1) / FP8_MAX, _TINY)        # [M, G]
    q = (xp / scale[..., None]).clip(-FP8_MAX, FP8_MAX).astype(FP8).reshape(m, g * group)
    return q[:, :k], scale


def ref_fp8_matmul(x: jax.Array, w: jax.Array, w_scale: jax.Array, *, x_scale: jax.Array | None = None,
                   block_size: int = BLOCK) -> jax.Array:
    """The oracle: everything dequantised to f32, one f32 dot at HIGHEST precision.

    x [M, K] float, or e4m3 with `x_scale` [M, 1] (per token) / [M, ceil(K / b)] (per group);
    w [K, N] e4m3; w_scale as in the module docstring. Returns f32 [M, N]."""
    k = x.shape[-1]
    x32 = x.astype(jnp.float32)
    if x_scale is not None:
        x32 = x32 * (x_scale if x_scale.shape[-1] == 1 else
                     jnp.repeat(x_scale, block_size, axis=-1)[:, :k])
    return jnp.dot(x32, dequantize(w, w_scale, jnp.float32, block_size),
                   precision=jax.lax.Precision.HIGHEST)


def _check(x, w, w_scale, block_size):
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"x must be [M, K] and w [K, N], got {x.shape} and {w.shape}")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"x [M, K={x.shape[1]}] and w [K={w.shape[0]}, N] disagree on K")
    if w.dtype != FP8:
        raise ValueError(f"w must be float8_e4m3fn, got {w.dtype}")
    k, n = w.shape
    kb = math.ceil(k / block_size)
    allowed = {(1, 1), (1, n), (kb, n), (kb, math.ceil(n / block_size))}
    if w_scale.shape not in allowed:
        raise ValueError(f"w_scale shape {w_scale.shape} is none of per-tensor (1, 1), per-channel "
                         f"(1, {n}), 1 x {block_size} groups ({kb}, {n}) or {block_size}-blocks "
                         f"({kb}, {math.ceil(n / block_size)})")


def fp8_matmul_xla(x: jax.Array, w: jax.Array, w_scale: jax.Array, *, activations: str = "dynamic",
                   input_scale: jax.Array | None = None, block_size: int = BLOCK,
                   k_major: bool = False) -> jax.Array:
    """x [M, K] (bf16/f16/f32) @ fp8 w [K, N] (or [N, K] when `k_major`) -> [M, N] in x.dtype, by XLA.

    activations: "none" (W8A16), "dynamic" (e4m3 per token / per 1 x b group, computed here) or
    "static" (one f32 `input_scale` from the checkpoint, W8A8)."""
    if k_major:
        w = w.T                  # a layout XLA's dot takes as it is; no copy in the compiled program
    _check(x, w, w_scale, block_size)
    k, n = w.shape
    out_dtype = x.dtype
    acc = dict(preferred_element_type=jnp.float32)
    if scale_kind(w_scale.shape, n) in ("block", "group"):
        if activations == "none":
            xd = x
        elif activations == "static":
            xq = (x.astype(jnp.float32) / input_scale).clip(-FP8_MAX, FP8_MAX).astype(FP8)
            xd = (xq.astype(jnp.float32) * input_scale).astype(out_dtype)
        else:
            xq, xs = quantize_activations(x, block_size)
            xd = (xq.astype(jnp.float32) * jnp.repeat(xs, block_size, axis=-1)[:, :k]).astype(out_dtype)
        # no XLA FP8 GEMM takes block or group scales: dequantise into the activation dtype and dot there
        y = jnp.dot(xd, dequantize(w, w_scale, out_dtype, block_size), **acc)
        return y.astype(out_dtype)
    if activations == "none":
        # e4m3 -> bf16/f32 is exact; the scale goes on the f32 result
        y = jnp.dot(x, w.astype(out_dtype), **acc) * w_scale
    else:
        if activations == "static":
            xs = jnp.reshape(input_scale, (1, 1)).astype(jnp.float32)
            xq = (x.astype(jnp.float32) / xs).clip(-FP8_MAX, FP8_MAX).astype(FP8)
        else:
            xq, xs = quantize_activations(x)
        y = jnp.dot(xq, w, **acc) * xs * w_scale       # fp8 x fp8 -> f32: cuBLASLt on Hopper
    return y.astype(out_dtype)


def fp8_matmul(x: jax.Array, w: jax.Array, w_scale: jax.Array, *, activations: str = "dynamic",
               input_scale: jax.Array | None = None, block_size: int = BLOCK,
               kernel: str = "xla", k_major: bool = False) -> jax.Array:
    """The public entry: x [..., K] @ fp8 w [K, N] -> [..., N] in x.dtype, by `kernel`
    ("xla"; "pallas" = the Mosaic GPU kernel, Hopper only). `k_major`: w is stored [N, K], the
    layout FP8 wgmma reads (the kernel would otherwise transpose the weight on every call)."""
    if activations not in ("none", "dynamic", "static"):
        raise ValueError(f"activations must be 'none', 'dynamic' or 'static', got {activations!r}")
    if activations == "static" and input_scale is None:
        raise ValueError("activations='static' needs input_scale")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if kernel == "xla":
        y = fp8_matmul_xla(x2, w, w_scale, activations=activations, input_scale=input_scale,
                           block_size=block_size, k_major=k_major)
    elif kernel == "pallas":
        y = fp8_matmul_mgpu(x2, w, w_scale, activations=activations, input_scale=input_scale,
                            block_size=block_size, k_major=k_major)
    else:
        raise ValueError(f"kernel must be 'xla' or 'pallas', got {kernel!r}")
    return y.reshape(*lead, y.shape[-1])


# ----------------------------------------------------------------------------------------------
# The Mosaic GPU kernel (Hopper; jax >= 0.11)
# ----------------------------------------------------------------------------------------------
class _LazyMosaicGpu:
    """`jax.experimental.pallas.mosaic_gpu`, imported on first use: the import costs ~1 s of every
    start-up (on CPU too), and only this GPU kernel needs it."""

    @functools.cached_property
    def module(self):
        try:  # Mosaic GPU's Pallas API as used here is jax >= 0.11 (plgpu.kernel + GPU interpret mode)
            from jax.experimental.pallas import mosaic_gpu
        except ImportError:  # pragma: no cover - depends on the installed jax
            return None
        return mosaic_gpu

    def __getattr__(self, name: str):
        return getattr(self.module, name)


plgpu = _LazyMosaicGpu()


def mgpu_available() -> bool:
    """Whether the installed jax has the Mosaic GPU API this kernel uses (imports it)."""
    return hasattr(plgpu.module, "InterpretGPUParams") and hasattr(plgpu.module, "kernel")


def __getattr__(name: str):     # MGPU_AVAILABLE, computed (and Mosaic GPU imported) when asked
    if name == "MGPU_AVAILABLE":
        return mgpu_available()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

KSLICE = 128                     # K per pipeline step = the scale block: one scale pair per step


@dataclasses.dataclass(frozen=True)
class Fp8Tiles:
    """A program's output tile [tile_m, tile_n] (wgmma M is 64 per warpgroup: tile_m 64 or 128)
    and the number of SMEM slots the K loop cycles through (stages - 1 slices in flight)."""

    tile_m: int
    tile_n: int
    stages: int = 4

    def __post_init__(self):
        if self.tile_m not in (64, 128) or self.tile_n % 64 or not 64 <= self.tile_n <= 256:
            raise ValueError(f"tiles must be tile_m 64 or 128 and tile_n 64..256 (multiple of 64), got {self}")
        if self.stages < 2:
            raise ValueError(f"stages must be >= 2, got {self.stages}")


# Untuned until a GPU run (benchmarks/bench_fp8_matmul.py). Decode is weight-bandwidth bound:
# 64-wide N tiles give N / 64 programs (128 for N = 8192 on 132 SMs) and 6 slices in flight.
# Every shipped configuration compiles for an H100 without register spills (`jaxserve compile
# --kernels`, benchmarks/RESULTS.md): 128 x 128 tiles with K-varying (block / group) scales need
# 255 registers and spill 168 bytes, so those weights take 128 x 64 tiles at larger M (161, none).
DECODE_TILES = Fp8Tiles(64, 64, stages=6)        # M <= 64
PREFILL_TILES = Fp8Tiles(128, 128, stages=4)     # larger M, per-tensor / per-channel scales
BLOCK_PREFILL_TILES = Fp8Tiles(128, 64, stages=4)   # larger M, block / group scales
SHIPPED_TILES = (DECODE_TILES, PREFILL_TILES, BLOCK_PREFILL_TILES)


def default_tiles(m: int, scales: str = "channel") -> Fp8Tiles:
    """The tiles for M rows and a weight's scale kind (`scale_kind`)."""
    if m <= 64:
        return DECODE_TILES
    return BLOCK_PREFILL_TILES if scales in ("block", "group") else PREFILL_TILES


def _fp8_kernel(a_ref, as_ref, b_ref, bs_ref, o_ref, a_smem, b_smem, as_smem, bs_smem, o_smem, bar, scale_bar,
                *, k_steps, per_slice):
    # GMEM: a_ref [Mp, Kp] e4m3; b_ref [Np, Kp] e4m3 (K-major, as FP8 wgmma needs);
    #       o_ref [Mp, Np] (the activation dtype);
    #       per_slice (block, group weights): as_ref [Kb, Mp] / bs_ref [Kb, Np] f32, row / column scales
    #       per 128-wide K slice; else as_ref [1, Mp] / bs_ref [1, Np], applied once at the end.
    # SMEM: a_smem [S, tm, 128]; b_smem [S, tn, 128]; as_smem [S, tm]; bs_smem [S, tn]; o_smem [tm, tn].
    # Slot of K slice kb: kb % S; slices kb + 1 .. kb + S - 1 are in flight while kb multiplies.
    tm, tn = o_smem.shape
    S = a_smem.shape[0]
    mi, ni = lax.axis_index("m"), lax.axis_index("n")
    rows, cols = pl.ds(mi * tm, tm), pl.ds(ni * tn, tn)
    layout = plgpu.Layout.WGMMA

    def fetch(kb, slot):
        ks = pl.ds(kb * KSLICE, KSLICE)
        plgpu.copy_gmem_to_smem(a_ref.at[rows, ks], a_smem.at[slot], bar.at[slot])
        plgpu.copy_gmem_to_smem(b_ref.at[cols, ks], b_smem.at[slot], bar.at[slot])
        if per_slice:
            plgpu.copy_gmem_to_smem(as_ref.at[kb, rows], as_smem.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(bs_ref.at[kb, cols], bs_smem.at[slot], bar.at[slot])

    def outer(slot):
        """[tm, tn] product of the slot's row and column scales, in the WGMMA layout."""
        sa = plgpu.load(as_smem.at[slot], layout=layout.reduce(1))
        sb = plgpu.load(bs_smem.at[slot], layout=layout.reduce(0))
        return lax.broadcast_in_dim(sa, (tm, tn), [0]) * lax.broadcast_in_dim(sb, (tm, tn), [1])

    if not per_slice:
        plgpu.copy_gmem_to_smem(as_ref.at[0, rows], as_smem.at[0], scale_bar)
        plgpu.copy_gmem_to_smem(bs_ref.at[0, cols], bs_smem.at[0], scale_bar)
    for j in range(min(S - 1, k_steps)):                    # the pipeline's first slices
        fetch(j, j)

    if per_slice:
        def body(kb, acc):
            slot = lax.rem(kb, S)
            # the scale loads of slice kb - 1 (ordinary SMEM reads) must be ordered before the
            # TMA that refills their slot: a proxy fence (the race detector flags it without one)
            plgpu.commit_smem()

            @pl.when(kb + S - 1 < k_steps)
            def _():                                        # into slice kb - 1's slot, free now
                fetch(kb + S - 1, lax.rem(kb + S - 1, S))

            plgpu.barrier_wait(bar.at[slot])

            def mma(acc_ref):
                plgpu.wgmma(acc_ref, a_smem.at[slot], b_smem.at[slot].T)
                return acc_ref[...]
            part = pl.run_scoped(mma, plgpu.ACC((tm, tn), jnp.float32))    # [tm, tn] f32
            # DeepGEMM's scheme: each 128-wide K slice's product scaled in f32 before it is summed
            return acc + part * outer(slot)

        acc = lax.fori_loop(0, k_steps, body, plgpu.layout_cast(jnp.zeros((tm, tn), jnp.float32), layout))
    else:
        def mma_all(acc_ref):
            def body(kb, carry):
                slot = lax.rem(kb, S)
                plgpu.barrier_wait(bar.at[slot])
                plgpu.wgmma(acc_ref, a_smem.at[slot], b_smem.at[slot].T)
                plgpu.wgmma_wait(1)                         # slice kb - 1's wgmma is done: its slot is free

                @pl.when(kb + S - 1 < k_steps)
                def _():                                    # refill it while slice kb multiplies
                    fetch(kb + S - 1, lax.rem(kb + S - 1, S))
                return carry
            lax.fori_loop(0, k_steps, body, None)
            plgpu.wgmma_wait(0)
            return acc_ref[...]
        # one accumulator over all of K (the scales do not change along K): scaled once here
        acc = pl.run_scoped(mma_all, plgpu.ACC((tm, tn), jnp.float32))
        plgpu.barrier_wait(scale_bar)
        acc = acc * outer(0)
    o_smem[...] = acc.astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[rows, cols])
    plgpu.wait_smem_to_gmem(0)


def _transforms(dtype, minor: int):
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def smem_bytes(tiles: Fp8Tiles, out_dtype) -> int:
    tm, tn, S = tiles.tile_m, tiles.tile_n, tiles.stages
    return S * (tm + tn) * KSLICE + S * 4 * (tm + tn) + tm * tn * jnp.dtype(out_dtype).itemsize


def fp8_matmul_mgpu(x: jax.Array, w: jax.Array, w_scale: jax.Array, *, activations: str = "dynamic",
                    input_scale: jax.Array | None = None, block_size: int = BLOCK,
                    k_major: bool = False, tiles: Fp8Tiles | None = None, interpret=None) -> jax.Array:
    """x [M, K] @ fp8 w [K, N] -> [M, N] in x.dtype by the Mosaic GPU kernel (W8A8: x is
    quantised here per token, or per 1 x 128 group for block and group weights). Same contract as
    `fp8_matmul_xla`; activations="none" (W8A16) is not a kernel case and goes to XLA.

    The wrapper pads M to the tile, K to 128 and N to the tile (a padded weight is a copy:
    shapes that need it belong to XLA in serving). Block and group weights: both scales spread to one value
    per 128-wide K slice (rows [Kb, M], columns [Kb, N]); each slice's wgmma result is scaled
    and added in registers. Per-tensor / per-channel weights: one accumulator over all of K,
    scaled once by the row (token) and column (channel) scales. `k_major`: w is stored [N, K] (no transpose here)."""
    if not mgpu_available():
        raise ValueError(f"fp8_matmul_mgpu needs jax >= 0.11 (Mosaic GPU plgpu.kernel); this is jax "
                         f"{jax.__version__}")
    w_nk = w if k_major else w.T                                                   # [N, K]
    w = w_nk.T                                                                     # [K, N] view
    _check(x, w, w_scale, block_size)
    if activations == "none":
        return fp8_matmul_xla(x, w_nk, w_scale, activations="none", block_size=block_size, k_major=True)
    kind = scale_kind(w_scale.shape, w.shape[1])
    if block_size != KSLICE and kind in ("block", "group"):
        raise ValueError(f"block_size must be {KSLICE} for the kernel, got {block_size}")
    m, k = x.shape
    n = w.shape[1]
    tiles = tiles or default_tiles(m, kind)
    out_dtype = x.dtype
    kb = math.ceil(k / KSLICE)
    block = kind in ("block", "group")          # scales that change along K: applied per K slice
    # scales per K slice for block and group weights ([Kb, M] rows, [Kb, N] columns), else one row [1, M]
    # and one column [1, N] applied after the whole K loop
    if activations == "static":
        xs = jnp.reshape(input_scale, (1, 1)).astype(jnp.float32)
        xq = (x.astype(jnp.float32) / xs).clip(-FP8_MAX, FP8_MAX).astype(FP8)
        rows = jnp.broadcast_to(xs, (kb if block else 1, m))
    elif block:
        xq, xs = quantize_activations(x, KSLICE)                                  # xs [M, Kb]
        rows = xs.T
    else:
        xq, xs = quantize_activations(x)                                          # xs [M, 1]
        rows = xs.T
    if kind == "block":
        cols = jnp.repeat(w_scale, block_size, axis=1)[:, :n]                     # [Kb, N]
    elif kind == "group":
        cols = w_scale                                                            # [Kb, N] already
    else:
        cols = jnp.broadcast_to(w_scale.astype(jnp.float32), (1, n))
    a = pad_to(pad_to(xq, 0, tiles.tile_m), 1, KSLICE)
    b = pad_to(pad_to(w_nk, 0, tiles.tile_n), 1, KSLICE)                        # [Np, Kp] K-major
    rows = pad_to(rows.astype(jnp.float32), 1, tiles.tile_m)
    cols = pad_to(cols.astype(jnp.float32), 1, tiles.tile_n)
    mp, np_ = a.shape[0], b.shape[0]
    tm, tn = tiles.tile_m, tiles.tile_n
    S = tiles.stages
    scratch = [plgpu.SMEM((S, tm, KSLICE), FP8, transforms=_transforms(FP8, KSLICE)),
               plgpu.SMEM((S, tn, KSLICE), FP8, transforms=_transforms(FP8, KSLICE)),
               plgpu.SMEM((S, tm), jnp.float32),
               plgpu.SMEM((S, tn), jnp.float32),
               plgpu.SMEM((tm, tn), out_dtype, transforms=_transforms(out_dtype, tn)),
               plgpu.Barrier(num_arrivals=4 if block else 2, num_barriers=S),
               plgpu.Barrier(num_arrivals=2)]
    call = plgpu.kernel(
        functools.partial(_fp8_kernel, k_steps=kb, per_slice=block),
        out_type=jax.ShapeDtypeStruct((mp, np_), out_dtype), scratch_types=scratch,
        grid=(mp // tm, np_ // tn), grid_names=("m", "n"), compiler_params=plgpu.CompilerParams(),
        interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                   else plgpu.InterpretGPUParams() if interpret else None))
    return call(a, rows, b, cols)[:m, :n]
