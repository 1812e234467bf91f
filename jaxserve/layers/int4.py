"""`Int4Weight`: 4-bit integer weight codes with per-group scales (W4A16), a weight type for `linear`.

Built by the loader from GPTQ, AWQ and compressed-tensors `pack-quantized` checkpoints
(jaxserve/loader/int4.py converts all three to this one layout). The matmul dequantizes inside the
jitted step one tile at a time (`TILE_BYTES` of the activation dtype at most, `tile_shape`), so
the full-precision matrix never exists in memory, and accumulates in f32.

Dequantisation of input row k, output column o: `(code[k, o] - zero[k // g, o]) * scale[k // g, o]`
(`+ offset[k // g, o]` when the weight has one: GGUF's Q4_1 `d * q + m`) for group size g; a
weight with an act-order permutation multiplies `x[..., perm]` (the loader sorts the rows by
group so each group is contiguous). `bits=8` (GGUF's Q8_0) holds signed int8 codes unpacked,
[in, out], zero 0; jaxserve/loader/gguf_quant.py builds those and the Q4_0/Q4_1 ones.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.layers import int4_cpu
from jaxserve.layers.experts import register_ragged
from jaxserve.layers.linear import register_linear
from jaxserve.pallas.common import target_platform

PACK = 8                      # int4 codes per int32 word
SYMMETRIC_ZERO = 8            # the zero point of symmetric (signed int4 + 8) codes
TILE_BYTES = 4 << 20          # dequantised bytes per tile, at most (one tile when the matrix is smaller)
# f32 activations of at least this many rows multiply bf16 tiles under `with_bf16_tiles` (the CPU
# default: XLA:CPU's bf16 x bf16 -> f32 dot runs 1.3-1.8x its f32 one from 64 rows, and slower than
# it for one or two rows; benchmarks/RESULTS.md)
BF16_MIN_ROWS = 16
MIN_TILE_COLS = 256           # narrowest column tile before the tile splits the input rows too


def zero_point_of(bits: int, zero_point: int | None = None) -> int:
    """The zero point of groups without a `zero` array: `zero_point`, by default 8 for int4
    (symmetric codes) and 0 for int8."""
    return (SYMMETRIC_ZERO if bits == 4 else 0) if zero_point is None else zero_point


@dataclasses.dataclass
class Int4Weight:
    """A [..., in, out] matrix as 4-bit codes; stacked layers (and experts) lead.

    q: int32 [..., in / 8, out], input row 8 * r + j in bits 4j..4j+3 of word r (GPTQ's packing);
      with bits=8 int8 [..., in, out], the signed codes themselves, or (the fused CPU kernel's
      layout for integer dot products, `layers.int4_layout.cpu_layout`) int32 [..., in / 4, out]:
      unsigned codes, input row 4 * r + j in byte j of word r.
    scale: f32 [..., in / g, out], one per group of g input rows and output column.
    zero: uint8 [..., in / g, out] zero points (0..15), or None: symmetric, zero 8 (0 with bits=8).
    perm: int32 [..., in] act-order input permutation (rows are stored in this order), or None.
    group_size: g (a multiple of 8 that divides `in`).
    offset: f32 [..., in / g, out] added after scaling (a float minimum per group), or None.
    bits: 4 (packed codes) or 8 (int8 codes).
    in_shards: how many devices the input rows are split over (row-parallel tensor parallelism):
      the kernel tiles each shard's rows separately so no tile straddles two devices.
    out_shards: the same for the output columns (column-parallel, a vocabulary-split head).
    bf16_min_rows: f32 activations of at least this many rows are rounded to bf16 and multiply tiles
      dequantised to bf16 (f32 accumulation); None: tiles in the activation dtype (`with_bf16_tiles`).
    fused_max_rows: activations of at most this many rows take the fused CPU kernel
      (layers/int4_cpu.py) where it fits; None: always the tiles (`with_fused_kernel`).
    q8_min_rows: with `fused_int8_x`, activations of at least this many rows are one int8 part per
      block (llama.cpp's Q8 activations: to 1/254 of the block's max, half the integer work); None:
      two parts at every row count. `--q8-activations` sets it for a GGUF file's weights, which then
      take the fused kernel at every row count (`loader.cpu_matmuls_for`).
    amx_min_rows: activations of this many rows or more (to `int4_cpu.AMX_MAX_ROWS`) take the AMX
      kernel where it fits (`int4_cpu.amx()`: the bf16 tiles' arithmetic, 3-6x faster); None: never.
    fused_int8_x: int4 matmuls in the fused kernel split their activations into two int8 parts per
      block of 32 inputs (to 1.6e-5 of the block's max) and sum integer dot products
      (`int4_cpu.int8_dot()`; the CPU's `--dtype auto`).
    layer: an int32 index, or None. When set, every array keeps its leading stacked-layer axis and
      this weight is that layer's slice (the layer scan's way to hand the fused kernel a whole
      stack without XLA copying the layer out of it; `layers.scan.scan_layers`).
    zero_point: the zero point of every group when `zero` is None; None: 8 for bits 4
      (symmetric), 0 for bits 8.
    col_block: 0, or the fused CPU kernel's layout (`layers.int4_layout.cpu_layout`): every array [..., rows, out]
      stored as column blocks [..., out / col_block, rows, col_block], so that a thread's columns
      are one contiguous run of memory.
    scale_sup: None, or two-level scales (GGUF's K-quants, as llama.cpp stores them): `scale` is
      then int8 sub-scales and each group's scale is `scale_sup[..., gi // S, n] * scale[..., gi, n]`,
      `scale_sup` f16 [..., in / (g S), out] (same layout as `scale`, S groups a super-block):
      1.06 bytes a group and column, not 4 (Q4_K: 0.58 bytes a weight, not 0.75).
    offset_sup: the same for `offset` (then int8), or None.
    """

    q: jax.Array
    scale: jax.Array
    zero: jax.Array | None = None
    perm: jax.Array | None = None
    group_size: int = 128
    in_shards: int = 1
    offset: jax.Array | None = None
    bits: int = 4
    out_shards: int = 1
    bf16_min_rows: int | None = None
    fused_max_rows: int | None = None
    layer: jax.Array | None = None
    fused_int8_x: bool = False
    zero_point: int | None = None
    col_block: int = 0
    amx_min_rows: int | None = None
    q8_min_rows: int | None = None
    scale_sup: jax.Array | None = None
    offset_sup: jax.Array | None = None

    @property
    def pack(self) -> int:
        """Input rows per element of `q`: 8 (int4), 4 (8-bit codes four a word), 1 (int8)."""
        return PACK if self.bits == 4 else 4 if self.q.dtype == jnp.int32 else 1

    @property
    def shape(self) -> tuple[int, ...]:
        blocked = 1 if self.col_block else 0
        lead = self.q.shape[1 if self.layer is not None else 0:-2 - blocked]
        out = self.q.shape[-1] * (self.q.shape[-3] if blocked else 1)
        return (*lead, self.q.shape[-2] * self.pack, out)

    @property
    def dtype(self):
        """What it computes in: f32 (f16 scales are storage only; `cpu_layout`)."""
        if self.scale_sup is not None or self.scale.dtype == jnp.float16:
            return jnp.dtype(jnp.float32)
        return self.scale.dtype

    @property
    def group_zero(self) -> int:
        """The groups' zero point when `zero` is None."""
        return zero_point_of(self.bits, self.zero_point)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.q, self.scale, self.zero, self.perm, self.offset, self.scale_sup,
                                      self.offset_sup) if a is not None)

    @property
    def two_level(self) -> bool:
        """Whether scales (offsets) are int8 sub-scales under f16 super-block scales (`scale_sup`)."""
        return self.scale_sup is not None or self.offset_sup is not None


jax.tree_util.register_dataclass(Int4Weight, data_fields=["q", "scale", "zero", "perm", "offset", "layer",
                                                          "scale_sup", "offset_sup"],
                                 meta_fields=["group_size", "in_shards", "bits", "out_shards", "bf16_min_rows",
                                              "fused_max_rows", "fused_int8_x", "zero_point", "col_block",
                                              "amx_min_rows", "q8_min_rows"])


def _is_int4(x) -> bool:
    return isinstance(x, Int4Weight)


def with_bf16_tiles(weights, min_rows: int = BF16_MIN_ROWS):
    """`weights` (any pytree) with every `Int4Weight`'s matmul taking f32 activations of at least
    `min_rows` rows through bf16 tiles (see `Int4Weight.bf16_min_rows`): `--dtype auto` on CPU.
    Teacher-forced agreement with the f32 tiles 0.996 and perplexity ratio 0.9996 on the default
    model (benchmarks/RESULTS.md); the result of a row then depends on how many rows its step had."""
    return jax.tree.map(lambda w: dataclasses.replace(w, bf16_min_rows=min_rows) if isinstance(w, Int4Weight) else w,
                        weights, is_leaf=_is_int4)


def with_fused_kernel(weights, max_rows: int = int4_cpu.FUSED_MAX_ROWS, int8_x: bool = False,
                      amx_min_rows: int | None = None):
    """`weights` (any pytree) with every `Int4Weight`'s matmul of at most `max_rows` rows taking the
    fused CPU kernel where it fits (`Int4Weight.fused_max_rows`; call `int4_cpu.load()` first),
    with `int8_x` the int4 ones taking their activations as int8 parts (`Int4Weight.fused_int8_x`;
    needs `int4_cpu.int8_dot()`), and from `amx_min_rows` rows the AMX kernel (needs `int4_cpu.amx()`)."""
    if int8_x and int4_cpu.int8_dot() is None:
        raise ValueError("int8_x: the fused CPU kernel has no integer dot product here (int4_cpu.int8_dot())")
    if amx_min_rows is not None and not int4_cpu.amx():
        raise ValueError("amx_min_rows: the AMX kernel does not run here (int4_cpu.amx() is False)")
    return jax.tree.map(lambda w: dataclasses.replace(w, fused_max_rows=max_rows, fused_int8_x=int8_x,
                                                      amx_min_rows=amx_min_rows)
                        if isinstance(w, Int4Weight) else w, weights, is_leaf=_is_int4)


def with_q8_rows(weights, min_rows: int = int4_cpu.FUSED_MAX_ROWS + 1):
    """`weights` (any pytree) with every `Int4Weight` on the fused kernel with int8 activations
    (int4 codes, or 8-bit ones four a word) taking it at every row count, activations of
    `min_rows` rows or more as one int8 part a block (`Int4Weight.q8_min_rows`: llama.cpp's
    arithmetic for a GGUF file's weights, 1.5x the two-part kernel and 1.3-2x XLA's bf16 tiles
    on a 1.7B model's int4 matrices at 64-512 rows)."""
    def q8(w):
        if isinstance(w, Int4Weight) and _int8_x(w) and w.fused_max_rows is not None:
            return dataclasses.replace(w, fused_max_rows=max(w.fused_max_rows, 1 << 30), q8_min_rows=min_rows)
        return w
    return jax.tree.map(q8, weights, is_leaf=_is_int4)


def fused_kernel_rows(weights) -> int:
    """The most rows any `Int4Weight` in `weights` sends through the fused CPU kernel (0: none)."""
    leaves = jax.tree.leaves(weights, is_leaf=_is_int4)
    return max((w.fused_max_rows or 0 for w in leaves if isinstance(w, Int4Weight)), default=0)


def _to_blocks(a: jax.Array | None, cb: int) -> jax.Array | None:
    """[..., rows, out] -> [..., out / cb, rows, cb]."""
    if a is None:
        return None
    *lead, rows, out = a.shape
    return jnp.swapaxes(a.reshape(*lead, rows, out // cb, cb), -3, -2)


def _from_blocks(a: jax.Array | None) -> jax.Array | None:
    """The inverse of `_to_blocks`."""
    if a is None:
        return None
    *lead, nb, rows, cb = a.shape
    return jnp.swapaxes(a, -3, -2).reshape(*lead, rows, nb * cb)


def checkpoint_layout(w: Int4Weight) -> Int4Weight:
    """A `cpu_layout` weight's arrays back in [..., rows, out] (the same matrix)."""
    if not w.col_block:
        return w
    return dataclasses.replace(w, q=_from_blocks(w.q), scale=_from_blocks(w.scale), zero=_from_blocks(w.zero),
                               offset=_from_blocks(w.offset), scale_sup=_from_blocks(w.scale_sup),
                               offset_sup=_from_blocks(w.offset_sup), col_block=0)


def _at_layer(w: Int4Weight, only_scales: bool = False) -> Int4Weight:
    """A `layer`-indexed weight as the plain slice (for the tiles); `only_scales`: the scale and
    offset arrays alone sliced (the codes stay the stack, still indexed by `layer`)."""
    def cut(a):
        return None if a is None else jax.lax.dynamic_index_in_dim(a, w.layer, keepdims=False)
    if only_scales:
        return dataclasses.replace(w, scale=cut(w.scale), offset=cut(w.offset), scale_sup=cut(w.scale_sup),
                                   offset_sup=cut(w.offset_sup))
    return dataclasses.replace(w, q=cut(w.q), scale=cut(w.scale), zero=cut(w.zero), perm=cut(w.perm),
                               offset=cut(w.offset), scale_sup=cut(w.scale_sup), offset_sup=cut(w.offset_sup),
                               layer=None)


def _times_sup(sub: jax.Array | None, sup: jax.Array | None) -> jax.Array | None:
    """Two-level scales [..., G, n] (int8) x [..., G / S, n] -> f32 [..., G, n] (the group axis is
    -2 in both layouts); exact: an f16 times a small integer."""
    if sub is None or sup is None:
        return sub
    return jnp.repeat(sup.astype(jnp.float32), sub.shape[-2] // sup.shape[-2], axis=-2) * sub.astype(jnp.float32)


def plain_scales(w: Int4Weight) -> Int4Weight:
    """`w` with two-level scales (`Int4Weight.scale_sup`) multiplied out to f32 (the same matrix):
    what the tiles and `dequantize` read (the AMX kernel takes no two-level weight: `_amx`)."""
    if not w.two_level:
        return w
    return dataclasses.replace(w, scale=_times_sup(w.scale, w.scale_sup), offset=_times_sup(w.offset, w.offset_sup),
                               scale_sup=None, offset_sup=None)


def unpack(q: jax.Array) -> jax.Array:
    """int32 [..., r, out] -> the uint8 codes [..., 8 r, out] (row 8 r + j from bits 4j)."""
    shifts = jnp.arange(PACK, dtype=jnp.uint32)[:, None] * 4
    codes = (q.astype(jnp.uint32)[..., :, None, :] >> shifts) & 0xF          # [..., r, 8, out]
    return codes.reshape(*q.shape[:-2], q.shape[-2] * PACK, q.shape[-1]).astype(jnp.uint8)


def pack(codes: jax.Array) -> jax.Array:
    """The inverse of `unpack`: codes [..., 8 r, out] (0..15) -> int32 [..., r, out]."""
    c = codes.astype(jnp.uint32).reshape(*codes.shape[:-2], codes.shape[-2] // PACK, PACK, codes.shape[-1])
    shifts = jnp.arange(PACK, dtype=jnp.uint32)[:, None] * 4
    return jax.lax.bitcast_convert_type(jnp.sum(c << shifts, axis=-2, dtype=jnp.uint32), jnp.int32)


def dequantize(q, scale, zero=None, group_size: int = 128, dtype=jnp.float32, offset=None, bits: int = 4,
               zero_point: int | None = None) -> jax.Array:
    """Codes [..., in / 8, out] (int8 [..., in, out] with bits=8) with their group scales (and
    zeros, offsets) -> [..., in, out] in `dtype` (rows in storage order). The reference; the matmul
    calls it one tile at a time. `zero_point`: as `Int4Weight.zero_point`.

    Computed as `code * scale + bias` with the per-group `bias = offset - zero * scale` (1/g of the
    elements): one multiply-add a weight, not a subtract, multiply and add. Exact where the
    factored form is (GGUF Q4_0, Q8_0: f16 scales times small integers); otherwise within an f32
    rounding of `(code - zero) * scale + offset`."""
    if bits == 4:
        # int32 shifts: the nibble is the same as with unsigned ones, and int32 -> f32 is one instruction
        shifts = jnp.arange(PACK, dtype=jnp.int32)[:, None] * 4
        codes = (q.astype(jnp.int32)[..., :, None, :] >> shifts) & 0xF            # [..., r, 8, out]
        codes = codes.reshape(*q.shape[:-2], q.shape[-2] * PACK, q.shape[-1])
    elif q.dtype == jnp.int32:            # 8-bit codes four a word (byte j: row 4 r + j)
        b = jax.lax.bitcast_convert_type(q, jnp.uint8)                            # [..., r, out, 4]
        codes = jnp.swapaxes(b, -1, -2).reshape(*q.shape[:-2], q.shape[-2] * 4, q.shape[-1])
    else:
        codes = q
    g = group_size
    s = scale.astype(jnp.float32)
    bias = None
    zp = zero_point_of(bits, zero_point)
    if zero is not None:
        bias = -zero.astype(jnp.float32) * s
    elif zp:
        bias = -float(zp) * s
    if offset is not None:
        bias = offset.astype(jnp.float32) if bias is None else bias + offset.astype(jnp.float32)
    grouped = codes.reshape(*codes.shape[:-2], codes.shape[-2] // g, g, codes.shape[-1]).astype(jnp.float32)
    w = grouped * s[..., :, None, :]
    if bias is not None:
        w = w + bias[..., :, None, :]
    return w.reshape(codes.shape).astype(dtype)


def ref_int4_matmul(x: jax.Array, w: Int4Weight) -> jax.Array:
    """x [..., in] @ the whole dequantised matrix, f32 (the test oracle)."""
    if w.perm is not None:
        x = jnp.take(x, w.perm, axis=-1)
    w = plain_scales(checkpoint_layout(w))
    full = dequantize(w.q, w.scale, w.zero, w.group_size, offset=w.offset, bits=w.bits, zero_point=w.zero_point)
    return jnp.einsum("...k,ko->...o", x.astype(jnp.float32), full, precision="highest")


def tile_rows(in_rows: int, out: int, group_size: int, itemsize: int = 4) -> int:
    """Input rows per tile: the most whole groups (dividing `in_rows`) whose dequantised rows fit
    in TILE_BYTES."""
    groups = in_rows // group_size
    fit = max(1, TILE_BYTES // max(1, group_size * out * itemsize))
    per_tile = max(d for d in range(1, min(groups, fit) + 1) if groups % d == 0)
    return per_tile * group_size


def tile_shape(in_rows: int, out: int, group_size: int, itemsize: int = 4) -> tuple[int, int]:
    """(input rows, output columns) of one dequantised tile of an [in_rows, out] matrix.

    The tile keeps every input row when a slice of at least MIN_TILE_COLS columns fits in
    TILE_BYTES: each output column is then computed by one dot with the full depth and written
    once. Splitting the depth instead costs a read and write of the whole [rows, out] f32
    accumulator per tile, which for a wide matrix (a 49152-word tied head over 576 features, one
    32-row group per tile) cost more than the dot. Deeper matrices (K x MIN_TILE_COLS over the
    budget) tile both ways; the accumulator then is [rows, MIN_TILE_COLS]. Column counts prefer
    a divisor of `out` (no remainder tile) no smaller than half the budget's."""
    if in_rows * out * itemsize <= TILE_BYTES:
        return in_rows, out
    fit = TILE_BYTES // (in_rows * itemsize)
    if fit < MIN_TILE_COLS:
        cols = min(out, MIN_TILE_COLS)
        return tile_rows(in_rows, cols, group_size, itemsize), cols
    div = [d for d in range(fit // 2, fit + 1) if out % d == 0]
    return in_rows, max(div) if div else fit - fit % 8


@register_linear(Int4Weight)
def int4_linear(x: jax.Array, w: Int4Weight, out_dtype=None) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out], the weight dequantised one `tile_shape` tile at a
    time into x.dtype (f32 accumulation; f32 tiles for bf16/f16 on CPU; bf16 tiles for f32 rows as
    `w.bf16_min_rows` says). Under tensor parallelism
    each device's block (`in_shards` slices of the rows, `out_shards` of the columns) is tiled on
    its own, so no tile straddles two devices; row-parallel partial sums are added once at the end.
    Up to `w.fused_max_rows` rows go to the fused CPU kernel instead, where it takes the weight,
    and from `w.amx_min_rows` rows the AMX kernel."""
    if _amx(x, w) or _fused(x, w):
        return _fused_matmul(x, w).astype(out_dtype or x.dtype)
    layer = None                 # a stack in column blocks: the layer `cut` copies its tiles from
    scale_layer = None           # the same for scales and offsets (None once two-level ones are multiplied out)
    if w.col_block and int4_cpu.load() is None:
        layer, w = w.layer, dataclasses.replace(w, layer=None)
        scale_layer = layer
        if layer is not None and w.perm is not None:      # the layer's act-order permutation
            w = dataclasses.replace(w, perm=jax.lax.dynamic_index_in_dim(w.perm, layer, keepdims=False))
        if w.two_level:          # this layer's scales multiplied out (a 32nd of the codes' elements)
            w = plain_scales(_at_layer(dataclasses.replace(w, layer=layer), only_scales=True) if layer is not None
                             else w)
            w, scale_layer = dataclasses.replace(w, layer=None), None
    elif w.col_block:            # no kernel library to copy them: XLA's transpose (slow, correct)
        w = checkpoint_layout(_at_layer(w) if w.layer is not None else w)
    elif w.layer is not None:
        w = _at_layer(w)
    w = plain_scales(w)
    if len(w.shape) != 2 + (layer is not None):
        raise ValueError(f"int4 linear takes one [in/8, out] matrix, got codes {w.q.shape} "
                         "(stacked layers are sliced off by lax.scan, experts by grouped_linear)")
    K, N = w.shape[-2:]
    P, cb = w.pack, w.col_block
    if w.perm is not None:
        x = jnp.take(x, w.perm, axis=-1)
    lead = x.shape[:-1]
    xm = x.reshape(-1, K)
    M, S, So, g = xm.shape[0], w.in_shards, w.out_shards, w.group_size
    if cb and (S > 1 or So > 1):
        raise ValueError("an Int4Weight in column blocks (cpu_layout) is on one device")
    ks, ns = K // S, N // So                           # rows, columns per device block
    cdt = x.dtype
    if w.bf16_min_rows is not None and cdt == jnp.float32 and M >= w.bf16_min_rows:
        cdt, xm = jnp.bfloat16, xm.astype(jnp.bfloat16)
    elif target_platform() == "cpu" and cdt in (jnp.bfloat16, jnp.float16):
        # XLA:CPU fuses the dequantisation into the dot, and its fused dot has no bf16 x bf16 -> f32
        # ("Unsupported element type for DotThunk"): the tile is multiplied in f32 there
        cdt, xm = jnp.float32, xm.astype(jnp.float32)
    acc_t = jnp.float32 if cdt in (jnp.bfloat16, jnp.float16) else cdt
    tk, nc = tile_shape(ks, ns, g, jnp.dtype(cdt).itemsize)
    if cb:
        nc = max(cb, nc - nc % cb)                     # whole column blocks
    T, C = ks // tk, ns // nc                          # row tiles, whole column tiles per block (static)

    # [S, rows, (So,) cols] views (bitcasts): a split of the rows (columns) over devices stays a
    # split of S (So), and the tiles slice the unsplit axes. No So axis when the columns are whole:
    # XLA:CPU copies the whole operand to relayout a size-1 middle axis. fori_loops slicing the
    # operands in place, not scans over them: XLA copies a scan's stacked inputs every call.
    split = (So,) if So > 1 else ()
    def view(a, per):
        if a is None or cb:                        # column blocks: `cut` reads the arrays in place
            return a
        return a.reshape(S, ks // per, *split, ns)
    qs, ss, zs, os_ = view(w.q, P), view(w.scale, g), view(w.zero, g), view(w.offset, g)
    xs = xm.reshape(M, S, ks)
    spec = "msk,sokn->smon" if split else "msk,skn->smn"

    def block(c0, width):
        """Output columns [c0, c0 + width) of every device block: [S, M, (So,) width]."""
        def tile(t, acc):
            def cut(a, per):
                if a is None:
                    return None
                if cb:                          # column blocks: the same [1, r, width], copied out
                    lay = scale_layer if a is ss or a is os_ else layer
                    return int4_cpu.unblock(a, lay, t * (tk // per), c0 // cb, tk // per, width // cb)[None]
                a = jax.lax.dynamic_slice_in_dim(a, t * (tk // per), tk // per, 1)
                a = jax.lax.dynamic_slice_in_dim(a, c0, width, a.ndim - 1)
                return jnp.swapaxes(a, 1, 2) if split else a                  # [S, (So,) r, width]
            wt = dequantize(cut(qs, P), cut(ss, g), cut(zs, g), g, cdt, cut(os_, g), w.bits,
                            zero_point=w.zero_point)                          # this tile only
            return acc + jnp.einsum(spec, jax.lax.dynamic_slice_in_dim(xs, t * tk, tk, 2), wt,
                                    preferred_element_type=acc_t)
        zero = jnp.zeros((S, M, *split, width), acc_t)
        return tile(0, zero) if T == 1 else jax.lax.fori_loop(0, T, tile, zero)

    def put(out, c0, width):
        return jax.lax.dynamic_update_slice_in_dim(out, block(c0, width), c0, out.ndim - 1)

    if C == 1 and nc == ns:
        out = block(0, ns)
    else:
        out = jax.lax.fori_loop(0, C, lambda c, o: put(o, c * nc, nc), jnp.zeros((S, M, *split, ns), acc_t))
        if C * nc < ns:                                # the remainder columns, a static tile
            out = put(out, C * nc, ns - C * nc)
    y = out.sum(0) if S > 1 else out[0]
    return y.reshape(*lead, N).astype(out_dtype or x.dtype)


def _kernel_takes(w: Int4Weight) -> bool:
    return (w.in_shards == 1 and w.out_shards == 1 and
            int4_cpu.fits(w.q, w.scale, w.zero, w.offset, w.group_size, w.bits, w.layer is not None, w.col_block,
                          w.scale_sup, w.offset_sup))


def _fused(x: jax.Array, w: Int4Weight) -> bool:
    return w.fused_max_rows is not None and 1 <= math.prod(x.shape[:-1]) <= w.fused_max_rows and _kernel_takes(w)


def _amx(x: jax.Array, w: Int4Weight) -> bool:
    rows = math.prod(x.shape[:-1])
    return (w.amx_min_rows is not None and w.amx_min_rows <= rows and int4_cpu.amx_pays(rows)
            and int4_cpu.amx_fits(w.shape[-2], w.bits) and w.pack != 4 and not w.two_level and _kernel_takes(w))


def _int8_x(w: Int4Weight) -> bool:
    return w.fused_int8_x and (w.bits == 4 or w.pack == 4)


@jax.custom_vjp
def _fused_matmul(x: jax.Array, w: Int4Weight) -> jax.Array:
    """x [..., in] @ w through the fused CPU kernel (the AMX one where `_amx`) -> [..., out] f32."""
    K, N = w.shape
    amx = _amx(x, w)
    lead = x.shape[:-1]
    if w.perm is not None:
        perm = w.perm if w.layer is None else jax.lax.dynamic_index_in_dim(w.perm, w.layer, keepdims=False)
        x = jnp.take(x, perm, axis=-1)
    rows = math.prod(lead)
    y = int4_cpu.matmul(x.reshape(-1, K), w.q, w.scale, w.zero, w.offset, w.layer, w.group_size, w.bits,
                        int8_x=_int8_x(w) and not amx, zero_point=w.group_zero, col_block=w.col_block,
                        amx=amx, int8_hi_only=w.q8_min_rows is not None and rows >= w.q8_min_rows,
                        scale_sup=w.scale_sup, offset_sup=w.offset_sup)
    return y.reshape(*lead, N)


def _fused_fwd(x, w):
    return _fused_matmul(x, w), (x, w)


def _fused_bwd(res, g):
    """Gradients through the tiles (the kernel has no transpose): the same matmul, differentiable."""
    x, w = res
    dx, dw = jax.vjp(lambda x, w: int4_linear(x, w, out_dtype=jnp.float32), x,
                     dataclasses.replace(checkpoint_layout(w), fused_max_rows=None, amx_min_rows=None))[1](g)
    if w.col_block:       # the cotangents back in column blocks (integer codes' are float0 zeros)
        def back(d, like):
            if d is None or d.dtype == jax.dtypes.float0:
                return None if like is None else np.zeros(like.shape, jax.dtypes.float0)
            return _to_blocks(d, w.col_block)
        dw = dataclasses.replace(dw, q=back(dw.q, w.q), scale=back(dw.scale, w.scale), zero=back(dw.zero, w.zero),
                                 offset=back(dw.offset, w.offset), scale_sup=back(dw.scale_sup, w.scale_sup),
                                 offset_sup=back(dw.offset_sup, w.offset_sup), col_block=w.col_block)
    return dx, dataclasses.replace(dw, fused_max_rows=w.fused_max_rows, amx_min_rows=w.amx_min_rows)


_fused_matmul.defvjp(_fused_fwd, _fused_bwd)


@register_ragged(Int4Weight)
def int4_ragged(x: jax.Array, w: Int4Weight, group_sizes: jax.Array) -> jax.Array:
    """Experts x [M, in] (rows sorted by expert) @ w [X, in, out] for ragged_dot backends (GPU).
    No grouped int4 kernel: the experts are dequantised into x.dtype for the call (X * in * out
    elements of temporaries), rows put back in checkpoint order (each expert has its own act-order
    permutation, so x cannot be permuted instead). The tiles layout never materialises them."""
    w = plain_scales(checkpoint_layout(w))
    full = dequantize(w.q, w.scale, w.zero, w.group_size, x.dtype, offset=w.offset, bits=w.bits,
                      zero_point=w.zero_point)                                                   # [X, in, out]
    if w.perm is not None:
        full = jnp.take_along_axis(full, jnp.argsort(w.perm, axis=-1)[..., None], axis=-2)
    pref = jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else None
    return jax.lax.ragged_dot(x, full, group_sizes, preferred_element_type=pref).astype(x.dtype)


def check_groups(in_rows: int, group_size: int, shards: int = 1, what: str = "weight") -> None:
    """Raise ValueError unless `in_rows` splits into whole groups (and, over `shards` devices,
    into whole groups per device)."""
    if group_size % PACK or in_rows % group_size:
        raise ValueError(f"{what}: {in_rows} input features do not divide into groups of {group_size} "
                         f"(group_size must be a multiple of {PACK} that divides the input size)")
    if shards > 1 and (in_rows % shards or (in_rows // shards) % group_size):
        raise ValueError(f"{what}: int4 group scales do not split over {shards} devices: each would "
                         f"hold {in_rows / shards:g} of the {in_rows} input features, not a whole number "
                         f"of {group_size}-row groups; tensor_parallel_size must divide {in_rows} into "
                         f"multiples of {group_size}")

