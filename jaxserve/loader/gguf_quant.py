"""GGUF Q4_0, Q4_1, Q8_0 and Q4_K tensors kept quantized: their blocks -> `Int4Weight`s (layers/int4.py)
instead of f32 matrices. Chosen with `quantization="gguf"` (vLLM's name for GGUF weights).

llama.cpp stores a matrix [out, in] row by row, each row in blocks of 32 input elements:
  Q4_0 (18 bytes): f16 d, 16 bytes of nibbles; w = d * (q - 8)       -> bits 4, zero 8, group 32
  Q4_1 (20 bytes): f16 d, f16 m, 16 bytes of nibbles; w = d * q + m  -> bits 4, zero 8, offset m + 8d
  Q8_0 (34 bytes): f16 d, 32 int8; w = d * q                         -> bits 8, group 32
Byte j of the nibbles holds element j (low nibble) and element j + 16 (high nibble).
  Q4_K (144 bytes per 256): f16 d, f16 dmin, 12 bytes of 6-bit (sc, m) for 8 sub-blocks of 32,
      128 bytes of nibbles (byte j of 32-byte chunk i: element 64i + j low, 64i + 32 + j high);
      w = d*sc * q - dmin*m                                          -> bits 4, zero 8, group 32
Scales and offsets are widened to f32 (the `Int4Weight` layout); the codes keep 4 or 8 bits.

Other types (F32/F16, Q6_K and the other K-quants, Q5_*, IQ*) stay on gguf/dequantize's f32 path;
so does a stacked array whose layers do not all share one kept type (a Q4_K_M file's Q6_K layers).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.layers.int4 import Int4Weight, check_groups
from jaxserve.loader.int4 import out_split_of, pack_np, split_of

GROUP = 32                                         # elements per GGUF block
_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144)}   # (elements, bytes)
KEPT = tuple(_BLOCKS)


@dataclasses.dataclass
class QuantTensor:
    """One GGUF matrix as stored, in the Hugging Face orientation [out, in].

    codes: uint8 [out, in] (0..15) for bits 4, int8 [out, in] for bits 8.
    scale: f32 [out, in / 32]; offset: f32 [out, in / 32] (Q4_1) or None.
    """

    kind: str
    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None

    @property
    def bits(self) -> int:
        return 8 if self.kind == "Q8_0" else 4

    def take_rows(self, order: np.ndarray) -> QuantTensor:
        """The same tensor with its output rows reordered (llama.cpp's q/k permutation undone)."""
        return QuantTensor(self.kind, self.codes[order], self.scale[order],
                           None if self.offset is None else self.offset[order])


def decode(name: str, kind: str, data: np.ndarray, shape: tuple[int, ...]) -> QuantTensor:
    """A kept tensor's raw bytes (uint8 [out, blocks * block bytes]) -> its codes, scales and
    offsets. `shape` is GGUF's (in, out); ValueError naming the tensor for a shape that is not
    whole blocks of 32 or bytes that do not match it."""
    if len(shape) != 2:
        raise ValueError(f"tensor {name}: {kind} kept quantized must be a matrix, got shape {tuple(shape)}")
    k, n = int(shape[0]), int(shape[1])
    per, size = _BLOCKS[kind]
    if k % per:
        raise ValueError(f"tensor {name}: {k} input features are not whole {kind} blocks of {per}")
    raw = np.asarray(data, np.uint8)
    if raw.shape != (n, k // per * size):
        raise ValueError(f"tensor {name}: {kind} data has shape {raw.shape}, expected {(n, k // per * size)} "
                         f"for a [{n}, {k}] matrix")
    blocks = raw.reshape(n, k // per, size)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)   # [out, in / per]
    if kind == "Q4_K":
        return _q4_k(kind, blocks, d, n, k)
    if kind == "Q8_0":
        codes = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
        return QuantTensor(kind, codes, d, None)
    nibbles = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]          # [out, in / 32, 16]
    codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).reshape(n, k)
    offset = None
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        offset = m + 8 * d          # d*q + m = d*(q - 8) + (m + 8d): the symmetric zero 8, no zero array
    return QuantTensor(kind, codes, d, offset)


def _q4_k(kind: str, blocks: np.ndarray, d: np.ndarray, n: int, k: int) -> QuantTensor:
    """Q4_K super-blocks [out, in / 256, 144] -> codes with a scale and offset per 32."""
    from gguf.quants import Q4_K
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))          # 6-bit, [n * in / 256, 8] each
    scale = (d[..., None] * sc.reshape(n, -1, 8).astype(np.float32)).reshape(n, k // GROUP)
    low_min = (dmin[..., None] * m.reshape(n, -1, 8).astype(np.float32)).reshape(n, k // GROUP)
    nibbles = blocks[..., 16:].reshape(n, -1, 4, 1, 32)                    # 4 chunks of 64 elements
    codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=3).reshape(n, k)
    return QuantTensor(kind, codes, scale, 8 * scale - low_min)      # d*sc*(q - 8) + (8 d*sc - dmin*m)


def stack(parts: list[QuantTensor], lead: tuple[int, ...], data_sharding: NamedSharding, what: str) -> Int4Weight:
    """Per-layer tensors of one kind ([out, in] each) -> one Int4Weight [*lead, in, out] placed as
    `data_sharding` ([..., in, out]) says: codes, scales and offsets split along the output
    (column-parallel) or along whole groups of the input (row-parallel), as loader/int4.py's
    `stack_int4` places checkpoint int4 weights."""
    kinds = {pt.kind for pt in parts}
    if len(kinds) != 1:
        raise ValueError(f"{what}: layers mix the GGUF types {sorted(kinds)}")
    n, k = parts[0].codes.shape
    spec, shards = split_of(data_sharding, len(lead) + 2)
    check_groups(k, GROUP, shards, what=what)

    def stacked(xs):
        return np.ascontiguousarray(np.stack([x.T for x in xs]).reshape(*lead, *xs[0].T.shape))

    codes = stacked([pt.codes for pt in parts])
    q = codes if parts[0].bits == 8 else pack_np(codes, -2)
    place = NamedSharding(data_sharding.mesh, PartitionSpec(*spec))
    offset = None if parts[0].offset is None else jax.device_put(stacked([pt.offset for pt in parts]), place)
    return Int4Weight(jax.device_put(np.asarray(q), place), jax.device_put(stacked([pt.scale for pt in parts]), place),
                      group_size=GROUP, in_shards=shards, offset=offset, bits=parts[0].bits,
                      out_shards=out_split_of(data_sharding, len(lead) + 2) if len(lead) <= 1 else 1)
