"""The fused CPU kernel's weight layout for `Int4Weight` (`cpu_layout`): column blocks, zero points
folded into the offsets, f16 scales where exact. The engine applies it at load with `--dtype auto`
on one CPU device (`loader.cpu_matmuls_for`); `layers.int4` runs both layouts (the kernel reads the
blocks in place, the tiles copy each tile back: `int4_cpu.unblock`) and undoes it
(`checkpoint_layout`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.layers.experts import ExpertWeight
from jaxserve.layers.int4 import Int4Weight
from jaxserve.layers.linear import DenseWeight

COL_BLOCK = 64                # columns per block (the kernel's threads claim 64 columns at a time)
INT8_GROUP = 32               # input rows per scale of `int8_of` (GGUF's Q8_0 blocks)


def _exact_f16(a: np.ndarray | None) -> bool:
    return a is None or bool(np.all(a.astype(np.float16).astype(a.dtype) == a))


def cpu_layout(w: Int4Weight, col_block: int = COL_BLOCK, donate: bool = False, k4: bool = False) -> Int4Weight:
    """`w` laid out for the fused CPU kernel, the same matrix (every dequantised value unchanged):

    - column blocks (`Int4Weight.col_block`): a thread's columns are one run of memory (the
      kernel read this model's matrices at 40-43 GB/s so, 20-24 in the checkpoint layout);
    - a `zero` array, or a zero point under an `offset`, folded into the offset
      (`offset - zero * scale`, what both the kernel and `dequantize` add), zero point 0: GGUF
      Q4_1's offset is then its f16 `m` again;
    - scales and offsets in f16 when every value is one (GGUF's and GPTQ's are): 0.625 bytes a
      weight for Q4_1, as the file has it, instead of 0.75; two-level ones (`Int4Weight.scale_sup`,
      GGUF's K-quants) stay so, their zero point unfolded (the kernel subtracts it);
    - with `k4`, 8-bit codes (without a `zero` array) as unsigned bytes four input rows a word,
      zero point + 128 (`Int4Weight.q`): what AVX512-VNNI's products take, so the kernel sums them
      as exact integer dot products with int8 activations (`fused_int8_x`), as it does int4 codes.

    A weight on several devices, or whose columns are not whole blocks, is returned as it is.
    Done on the host in numpy at load (XLA would compile each step for each shape: 1.75 s).
    `donate`: `w`'s arrays are deleted once their copies are made (the engine's load: the whole
    model is then never held twice)."""
    if w.col_block or w.in_shards != 1 or w.out_shards != 1 or w.shape[-1] % col_block:
        return w

    def host(a):
        return None if a is None else np.asarray(a)
    scale, zero, offset, zero_point = host(w.scale), host(w.zero), host(w.offset), w.zero_point
    if not w.two_level and (zero is not None or (offset is not None and w.group_zero)):
        s = scale.astype(np.float32)
        zp = zero.astype(np.float32) if zero is not None else np.float32(w.group_zero)
        folded = (np.float32(0) if offset is None else offset.astype(np.float32)) - zp * s
        # a zero array stays where its fold is no f16 pair (GPTQ's zeros times f16 scales): one
        # byte a group, not two more
        if zero is None or (_exact_f16(scale) and _exact_f16(folded)):
            zero, offset, zero_point = None, folded, 0
    q = host(w.q)
    if k4 and w.bits == 8 and zero is None and q.dtype == np.int8 and q.shape[-2] % 4 == 0:
        u = q.view(np.uint8) ^ np.uint8(0x80)                          # code + 128
        *lead, rows, out = u.shape
        q = np.ascontiguousarray(np.swapaxes(u.reshape(*lead, rows // 4, 4, out), -1, -2)).view(np.int32)[..., 0]
        zero_point = (zero_point or 0) + 128
    if scale.dtype == np.float32 and _exact_f16(scale) and _exact_f16(offset):
        scale, offset = scale.astype(np.float16), None if offset is None else offset.astype(np.float16)

    def blocks(a, like):
        if a is None:
            return None
        *lead, rows, out = a.shape
        b = np.ascontiguousarray(np.swapaxes(a.reshape(*lead, rows, out // col_block, col_block), -3, -2))
        return jax.device_put(b, like.sharding)
    out = dataclasses.replace(w, q=blocks(q, w.q), scale=blocks(scale, w.scale), zero=blocks(zero, w.scale),
                              offset=blocks(offset, w.scale), scale_sup=blocks(host(w.scale_sup), w.scale),
                              offset_sup=blocks(host(w.offset_sup), w.scale), zero_point=zero_point,
                              col_block=col_block)
    if donate:
        del scale, zero, offset, q
        for a in (w.q, w.scale, w.zero, w.offset, w.scale_sup, w.offset_sup):
            if isinstance(a, jax.Array):
                a.delete()
    return out


def with_cpu_layout(weights, donate: bool = False, k4: bool = False):
    """`weights` (any pytree) with every `Int4Weight` on the fused kernel laid out for it
    (`cpu_layout`; `donate`: the old arrays deleted one weight at a time; `k4`: 8-bit codes of
    weights with int8 activations four a word); experts (inside an `ExpertWeight`) keep theirs."""
    def relay(w):
        if isinstance(w, Int4Weight) and w.fused_max_rows is not None:
            return cpu_layout(w, donate=donate, k4=k4 and w.fused_int8_x and w.amx_min_rows is None)
        return w
    return jax.tree.map(relay, weights, is_leaf=lambda x: isinstance(x, (Int4Weight, ExpertWeight)))


def take_columns(w: Int4Weight, ids: jax.Array) -> Int4Weight:
    """The matrix's columns `ids` [T] (an unstacked weight): [rows, T] arrays in the checkpoint layout."""
    def cols(a):
        if a is None:
            return None
        if w.col_block:
            return a[ids // w.col_block, :, ids % w.col_block].T        # [T, rows] -> [rows, T]
        return jnp.take(a, ids, axis=-1)
    return dataclasses.replace(w, q=cols(w.q), scale=cols(w.scale), zero=cols(w.zero), offset=cols(w.offset),
                               scale_sup=cols(w.scale_sup), offset_sup=cols(w.offset_sup), col_block=0)


def int8_of(w: DenseWeight, group_size: int = INT8_GROUP) -> Int4Weight:
    """A dense matrix [in, out] rounded as GGUF's Q8_0 rounds one: per group of `group_size` input
    rows and output column, an f16 scale max|w| / 127 and int8 codes (to 1/254 of the group's
    max|w|): a quarter of f32's bytes for the fused CPU kernel to read."""
    a = np.asarray(jax.device_get(w.w), np.float32)
    k, n = a.shape
    g = a.reshape(k // group_size, group_size, n)
    scale = (np.abs(g).max(axis=1) / 127).astype(np.float16).astype(np.float32)      # [in / g, out]
    codes = np.rint(g / np.where(scale > 0, scale, 1)[:, None, :]).clip(-127, 127).astype(np.int8)
    return Int4Weight(jnp.asarray(codes.reshape(k, n)), jnp.asarray(scale), group_size=group_size, bits=8)


def dense_as_int8(weights, group_size: int = INT8_GROUP):
    """`weights` (any pytree) with every unstacked `DenseWeight` whose rows split into whole groups
    as `int8_of`'s; the rest as they are."""
    def rounded(w):
        if isinstance(w, DenseWeight) and w.w.ndim == 2 and w.w.shape[0] % group_size == 0:
            return int8_of(w, group_size)
        return w
    return jax.tree.map(rounded, weights, is_leaf=lambda x: isinstance(x, DenseWeight))
