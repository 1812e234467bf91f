"""Every GGUF type llama.cpp's presets write, kept quantized: its blocks -> `Int4Weight`s
(layers/int4.py) instead of f32 matrices, without loss. Chosen with `quantization="gguf"` (vLLM's
name for GGUF weights), what a .gguf model gets by default.

llama.cpp stores a matrix [out, in] row by row, each row in blocks of 32 (or super-blocks of 256)
input elements. Each type becomes integer codes with one scale (and offset) per group of 32 or 16
inputs, `w = scale * (code - zero) + offset`, the `Int4Weight` layout the fused CPU kernel and the
tiles read:

| type | bytes / 32 w | codes kept as | group | w per group |
|---|---|---|---|---|
| Q4_0 | 18 | 4-bit q (zero 8) | 32 | d (q - 8) |
| Q4_1 | 20 | 4-bit q (zero 8) | 32 | d q + m |
| Q5_0 | 22 | int8 q - 16 | 32 | d (q - 16) |
| Q5_1 | 24 | int8 q - 16 | 32 | d q + m |
| Q8_0 | 34 | int8 q | 32 | d q |
| Q2_K | 10.5 | 4-bit q (zero 0) | 16 | d sc q - dmin m |
| Q3_K | 13.75 | 4-bit q + 4 (zero 8) | 16 | d (sc - 32) (q - 4) |
| Q4_K | 18 | 4-bit q (zero 0) | 32 | d sc q - dmin m |
| Q5_K | 22 | int8 q | 32 | d sc q - dmin m |
| Q6_K | 26.25 | int8 q - 32 | 16 | d sc (q - 32) |
| IQ4_NL | 18 | int8 kvalues[q] | 32 | d kvalues[q] |
| IQ4_XS | 17 | int8 kvalues[q] | 32 | d (ls - 32) kvalues[q] |
| MXFP4 | 17 | int8 2 e2m1[q] | 32 | 2^(e - 128) 2 e2m1[q] |

Scales and offsets of the 32-element types are widened to f32 (f16 where every value is one:
`layers.int4_layout.cpu_layout`). The K-quants and IQ4_XS keep theirs two-level, as the file does
(`Int4Weight.scale_sup`): the small integers sc (m, ls - 32) as int8 sub-scales, d (-dmin) as f16
per super-block of 256, multiplied out by the kernel (Q4_K: 0.58 bytes a weight in memory, not
0.75) -- on one CPU device; elsewhere (GPU kernels, weights split over devices) they are
multiplied out at load (`QuantTensor.one_level`). The codes keep 4 or 8 bits: types whose codes
are not 4-bit integers (5- and 6-bit, the IQ4 codebooks) take 8-bit codes.
The tensors of one stack (one matrix of every layer) may mix types (a Q4_K_M file's Q6_K
`ffn_down` layers beside Q4_K ones): `stack_mixed` groups the layers by their layout and builds a
`LayerMixWeight` (layers/layer_mix.py), each layer read in its own type.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.layers.int4 import Int4Weight, check_groups
from jaxserve.layers.layer_mix import LayerMixWeight
from jaxserve.loader.int4 import out_split_of, split_of

QK_K = 256
# (elements, bytes) per block
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
          "Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176),
          "Q6_K": (QK_K, 210), "IQ4_NL": (32, 18), "IQ4_XS": (QK_K, 136), "MXFP4": (32, 17)}
KEPT = tuple(BLOCKS)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)   # e2m1, doubled


@dataclasses.dataclass
class QuantTensor:
    """One GGUF matrix as stored, in the Hugging Face orientation [out, in].

    codes: for bits 4 int32 words [out, in / 8] of 4-bit codes (0..15, zero point 8; input 8 r + j
      in bits 4j of word r, `packed_rows`); for bits 8 int8 [out, in] (zero 0).
    scale: f32 [out, in / group]; offset: f32 [out, in / group] or None.
    scale_sup: None, or (the K-quants) f16 [out, in / 256], `scale` then int8: each group's scale
      is scale_sup[g // S] * scale[g], as the file stores it (`Int4Weight.scale_sup`).
    offset_sup: the same for `offset` (int8 then), or None.
    zero_point: the codes' zero point; None: 8 for bits 4, 0 for bits 8.
    """

    kind: str
    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None
    bits: int = 4
    group: int = 32
    scale_sup: np.ndarray | None = None
    offset_sup: np.ndarray | None = None
    zero_point: int | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """[out, in] of the matrix."""
        return self.codes.shape[0], self.codes.shape[1] * (8 if self.bits == 4 else 1)

    @property
    def layout(self) -> tuple:
        """What tensors must share to be stacked into one `Int4Weight`: bits, group, offset or not,
        zero point, two-level scales (and their super-block) or not."""
        sup = None if self.scale_sup is None else self.scale_sup.shape[-1]
        return self.bits, self.group, self.offset is not None, self.zero_point, sup, self.offset_sup is not None

    def take_rows(self, order: np.ndarray) -> QuantTensor:
        """The same tensor with its output rows reordered (llama.cpp's q/k permutation undone)."""
        def take(a):
            return None if a is None else a[order]
        return dataclasses.replace(self, codes=self.codes[order], scale=self.scale[order], offset=take(self.offset),
                                   scale_sup=take(self.scale_sup), offset_sup=take(self.offset_sup))

    def one_level(self) -> QuantTensor:
        """The same tensor with f32 scales and offsets and the default zero point (what every
        platform's kernels read; `stack` keeps two-level scales for the CPU's fused kernel alone)."""
        if self.scale_sup is None and self.zero_point is None:
            return self

        def times(sub, sup):
            if sup is None:
                return sub
            return np.repeat(sup.astype(np.float32), sub.shape[-1] // sup.shape[-1], axis=-1) * sub.astype(np.float32)
        scale, offset = times(self.scale, self.scale_sup), times(self.offset, self.offset_sup)
        shift = (8 if self.bits == 4 else 0) - (self.zero_point or 0)    # s (q - z) + o = s (q - z') + o + (z' - z) s
        if shift:
            offset = shift * scale + (np.float32(0) if offset is None else offset)
        return dataclasses.replace(self, scale=scale, offset=offset, scale_sup=None, offset_sup=None, zero_point=None)


def _f16_raw(b: np.ndarray) -> np.ndarray:
    """Two bytes [..., 2] -> their f16 value [..., 1] (a super-block scale kept as the file has it)."""
    return np.ascontiguousarray(b).view(np.float16)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes [..., 2] -> their f16 value as f32 [...]."""
    return _f16_raw(b)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """Bytes [..., half] -> [..., 2 half]: byte j's low nibble is element j, its high one j + half."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _bits(b: np.ndarray, shifts, mask: int) -> np.ndarray:
    """Bytes [..., n] -> [..., len(shifts), n]: each byte's `mask` bits at each shift."""
    return (b[..., None, :] >> np.array(shifts, np.uint8)[:, None]) & np.uint8(mask)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit (scale, min) [..., 12] -> two [..., 8] uint8."""
    d, m, hi = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = np.concatenate([d & 63, (hi & 0xF) | ((d >> 6) << 4)], axis=-1)
    mn = np.concatenate([m & 63, (hi >> 4) | ((m >> 6) << 4)], axis=-1)
    return sc, mn


def _decode(kind: str, blk: np.ndarray) -> tuple:
    """Blocks [..., bytes] -> (codes [..., elements], scale [..., groups], offset or None, bits,
    group), and for the K-quants and IQ4_XS a sixth item: (scale_sup, offset_sup, zero point), the
    super-block's f16 scales [..., 1] under `scale` (`offset`) then int8 sub-scales."""
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"):
        d = _f16(blk[..., 0:2])[..., None]
        if kind == "Q8_0":
            return blk[..., 2:].view(np.int8), d, None, 8, 32
        if kind == "IQ4_NL":
            return IQ4_VALUES[_nibbles(blk[..., 2:], 16)], d, None, 8, 32
        start = 4 if kind in ("Q4_1", "Q5_1") else 2
        high = kind in ("Q5_0", "Q5_1")
        q = _nibbles(blk[..., start + 4 * high:], 16)                          # [..., 32]
        m = _f16(blk[..., 2:4])[..., None] if start == 4 else None
        if not high:
            return q, d, None if m is None else m + 8 * d, 4, 32               # d q + m = d (q - 8) + m + 8 d
        qh = np.unpackbits(blk[..., start:start + 4], axis=-1, bitorder="little")   # [..., 32]
        codes = ((q | (qh << 4)) - np.uint8(16)).view(np.int8)          # wraps to the signed q - 16
        return codes, d, None if m is None else m + 16 * d, 8, 32
    if kind == "MXFP4":
        e = blk[..., 0:1].astype(np.uint32)
        bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23))
        return MXFP4_VALUES[_nibbles(blk[..., 1:], 16)], bits.view(np.float32), None, 8, 32
    lead = blk.shape[:-1]
    # the K-quants: per super-block of 256 f16 d (and dmin), small integer scales (mins) per group,
    # kept as they are (two-level; `QuantTensor.one_level` multiplies them out)
    i8 = lambda a: np.asarray(a).astype(np.int8)                                 # noqa: E731
    if kind == "Q2_K":                  # scales[16], qs[64], d, dmin
        sc, qs = blk[..., 0:16], blk[..., 16:80]
        d, dmin = _f16_raw(blk[..., 80:82]), _f16_raw(blk[..., 82:84])
        q = _bits(qs.reshape(*lead, 2, 32), (0, 2, 4, 6), 3).reshape(*lead, QK_K)
        return q, i8(sc & 0xF), i8(sc >> 4), 4, 16, (d, -dmin, 0)                # d sc q - dmin m
    if kind == "Q3_K":                  # hmask[32], qs[64], scales[12], d
        hm, qs, s, d = blk[..., 0:32], blk[..., 32:96], blk[..., 96:108], _f16_raw(blk[..., 108:110])
        low = _bits(s[..., 0:8], (0, 4), 0xF).reshape(*lead, 16)
        high = _bits(s[..., 8:12], (0, 2, 4, 6), 3).reshape(*lead, 16)
        sc = (low | (high << 4)).astype(np.int16) - 32
        ql = _bits(qs.reshape(*lead, 2, 32), (0, 2, 4, 6), 3).reshape(*lead, QK_K)
        qh = _bits(hm, tuple(range(8)), 1).reshape(*lead, QK_K)
        return ql + 4 * qh + 4, i8(sc), None, 4, 16, (d, None, None)           # q - 4 * (1 - h) + 8: 4..11
    if kind == "IQ4_XS":                # d, scales_h (u16), scales_l[4], qs[128]
        d = _f16_raw(blk[..., 0:2])
        sh = blk[..., 2:4].copy().view(np.uint16)                                 # [..., 1]
        sl = _bits(blk[..., 4:8], (0, 4), 0xF).swapaxes(-1, -2).reshape(*lead, 8)
        shi = (sh >> (2 * np.arange(8, dtype=np.uint16))) & 3
        ls = (sl | (shi.astype(np.uint8) << 4)).astype(np.int16) - 32
        q = _nibbles(blk[..., 8:].reshape(*lead, 8, 16), 16).reshape(*lead, QK_K)
        return IQ4_VALUES[q], i8(ls), None, 8, 32, (d, None, None)
    if kind in ("Q4_K", "Q5_K"):        # d, dmin, scales[12], (qh[32],) qs[128]
        d, dmin = _f16_raw(blk[..., 0:2]), _f16_raw(blk[..., 2:4])
        sc, mn = _k_scales(blk[..., 4:16])                                       # [..., 8] each
        qs = blk[..., 48:] if kind == "Q5_K" else blk[..., 16:]
        q = _nibbles(qs.reshape(*lead, 4, 32), 32).reshape(*lead, QK_K)          # 4 chunks of 64
        if kind == "Q5_K":
            qh = _bits(blk[..., 16:48], tuple(range(8)), 1).reshape(*lead, QK_K)
            q = (q | (qh << 4)).view(np.int8)                                    # 0..31
        return q, i8(sc), i8(mn), 4 if kind == "Q4_K" else 8, 32, (d, -dmin, 0)   # d sc q - dmin m
    if kind == "Q6_K":                  # ql[128], qh[64], scales[16] (int8), d
        ql, qh = blk[..., 0:128], blk[..., 128:192]
        sc, d = blk[..., 192:208].view(np.int8), _f16_raw(blk[..., 208:210])
        low = _nibbles(ql.reshape(*lead, 2, 64), 64).reshape(*lead, 2, 4, 32)    # per 128: 4 runs of 32
        high = _bits(qh.reshape(*lead, 2, 32), (0, 2, 4, 6), 3)                  # [..., 2, 4, 32]
        codes = ((low | (high << 4)) - np.uint8(32)).view(np.int8).reshape(*lead, QK_K)
        return codes, np.ascontiguousarray(sc), None, 8, 16, (d, None, None)
    raise ValueError(f"GGUF type {kind} is not kept quantized")


def decode(name: str, kind: str, data: np.ndarray, shape: tuple[int, ...]) -> QuantTensor:
    """A kept tensor's raw bytes (uint8 [out, blocks * block bytes]) -> its codes, scales and
    offsets. `shape` is GGUF's (in, out); ValueError naming the tensor for a shape that is not
    whole blocks or bytes that do not match it."""
    if len(shape) != 2:
        raise ValueError(f"tensor {name}: {kind} kept quantized must be a matrix, got shape {tuple(shape)}")
    k, n = int(shape[0]), int(shape[1])
    per, size = BLOCKS[kind]
    if k % per:
        raise ValueError(f"tensor {name}: {k} input features are not whole {kind} blocks of {per}")
    raw = np.asarray(data, np.uint8)
    if raw.shape != (n, k // per * size):
        raise ValueError(f"tensor {name}: {kind} data has shape {raw.shape}, expected {(n, k // per * size)} "
                         f"for a [{n}, {k}] matrix")
    codes, scale, offset, bits, group, *two = _decode(kind, raw.reshape(n, k // per, size))
    codes = codes.reshape(n, k)
    codes = packed_rows(codes) if bits == 4 else np.ascontiguousarray(codes)
    if two:
        (sup, osup, zero_point), = two
        flat = lambda a, cols: None if a is None else np.ascontiguousarray(a).reshape(n, cols)  # noqa: E731
        return QuantTensor(kind, codes, flat(scale, k // group), flat(offset, k // group), bits, group,
                           flat(sup, k // per), flat(osup, k // per), zero_point)
    flat = lambda a: None if a is None else np.ascontiguousarray(a, np.float32).reshape(n, k // group)  # noqa: E731
    return QuantTensor(kind, codes, flat(scale), flat(offset), bits, group)


def packed_rows(codes: np.ndarray) -> np.ndarray:
    """4-bit codes [out, in] (uint8, 0..15) -> int32 words [out, in / 8], input 8 r + j in bits
    4j..4j+3 of word r (`Int4Weight`'s packing, along the input): pairs of codes into bytes, read
    as little-endian words. (Packed before the transpose to [in / 8, out]: 8x fewer elements to move.)"""
    pairs = codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))
    return np.ascontiguousarray(pairs).view("<i4")


def stack(parts: list[QuantTensor], lead: tuple[int, ...], data_sharding: NamedSharding, what: str) -> Int4Weight:
    """Per-layer tensors of one layout ([out, in] each) -> one Int4Weight [*lead, in, out] placed as
    `data_sharding` ([..., in, out]) says: codes, scales and offsets split along the output
    (column-parallel) or along whole groups of the input (row-parallel), as loader/int4.py's
    `stack_int4` places checkpoint int4 weights."""
    if not _two_level_here(data_sharding):
        parts = [pt.one_level() for pt in parts]
    layouts = {pt.layout for pt in parts}
    if len(layouts) != 1:
        raise ValueError(f"{what}: layers mix the GGUF types {sorted({pt.kind for pt in parts})}")
    n, k = parts[0].shape
    bits, group = parts[0].bits, parts[0].group
    spec, shards = split_of(data_sharding, len(lead) + 2)
    check_groups(k, group, shards, what=what)

    def stacked(xs):          # [out, in'] each -> [*lead, in', out]
        out = np.empty((len(xs), *xs[0].T.shape), xs[0].dtype)
        for x, o in zip(xs, out):
            for i in range(0, x.shape[0], 256):      # a block of rows at a time: 3x numpy's whole transpose
                o[:, i:i + 256] = x[i:i + 256].T
        return out.reshape(*lead, *xs[0].T.shape)

    q = stacked([pt.codes for pt in parts])
    place = NamedSharding(data_sharding.mesh, PartitionSpec(*spec))
    def put(field):
        if getattr(parts[0], field) is None:
            return None
        return jax.device_put(stacked([getattr(pt, field) for pt in parts]), place)
    return Int4Weight(jax.device_put(np.asarray(q), place), put("scale"),
                      group_size=group, in_shards=shards, offset=put("offset"), bits=bits,
                      out_shards=out_split_of(data_sharding, len(lead) + 2) if len(lead) <= 1 else 1,
                      zero_point=parts[0].zero_point, scale_sup=put("scale_sup"), offset_sup=put("offset_sup"))


def _two_level_here(data_sharding: NamedSharding) -> bool:
    """Whether a weight placed so keeps two-level scales: on one CPU device (the fused kernel reads
    them; the GPU kernels and a split over devices take one-level f32 ones)."""
    devices = data_sharding.mesh.devices.flat
    return data_sharding.mesh.devices.size == 1 and all(d.platform == "cpu" for d in devices)


def stack_mixed(parts: list[QuantTensor], data_sharding: NamedSharding, what: str) -> Int4Weight | LayerMixWeight:
    """A layer stack's tensors ([out, in] each, one per layer) -> one Int4Weight [L, in, out] when
    they share a layout, else a `LayerMixWeight` of one stack per layout (layers in file order)."""
    layouts = list(dict.fromkeys(pt.layout for pt in parts))
    if len(layouts) == 1:
        return stack(parts, (len(parts),), data_sharding, what)
    which = tuple(layouts.index(pt.layout) for pt in parts)
    groups = [[pt for pt, w in zip(parts, which) if w == i] for i in range(len(layouts))]
    index = tuple(which[:i].count(w) for i, w in enumerate(which))
    stacks = tuple(stack(g, (len(g),), data_sharding, what) for g in groups)
    return LayerMixWeight(stacks, part_of=which, index_in_part=index)


def kept_array(p, sharding_of, quantized, names: list[str]) -> Int4Weight | LayerMixWeight | None:
    """The declared array `p` (a matrix, or the embedding) from its GGUF tensors `names`, read by
    `quantized(name)` (a `QuantTensor`, None for an unkept type): an `Int4Weight` [..., in, out],
    or a `LayerMixWeight` where a layer stack's tensors mix layouts (a Q4_K_M file's Q6_K and Q4_K
    layers); None when any tensor is of another type (read as f32). `sharding_of(axes)` places it.
    The embedding [V, E] is stored as the tied head's [E, V]: `layers/embedding.py` gathers its
    columns. ValueError naming the tensor for a shape the model config does not expect."""
    if not (p.dense or p.path == "embed") or p.per_expert:
        return None
    with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:    # numpy lets go of the GIL
        parts = list(pool.map(quantized, names))
    if any(pt is None for pt in parts):
        return None
    if len({pt.layout for pt in parts}) > 1 and p.stacked_dims != 1:
        return None
    k, n = (p.shape[1], p.shape[0]) if p.path == "embed" else p.shape[-2:]
    for name, pt in zip(names, parts):
        if pt.shape != (n, k):
            raise ValueError(f"tensor {name} has shape {pt.shape}, expected {(n, k)} from the model config")
    axes, lead = (tuple(reversed(p.axes)), ()) if p.path == "embed" else (p.axes, p.shape[:p.stacked_dims])
    try:
        if p.stacked_dims == 1:
            return stack_mixed(parts, sharding_of(axes), names[0])
        return stack(parts, lead, sharding_of(axes), names[0])
    except ValueError as e:
        raise ValueError(f"GGUF {parts[0].kind}: {e}") from None
