"""MXFP4 checkpoints (gpt-oss: `quantization_config.quant_method` "mxfp4"): expert matrices
shipped as `<name>_blocks` / `<name>_scales` uint8 tensors, dequantized here at load to the
full-precision tensor `<name>` the model declares. Host numpy, never imports jax.

The format (OCP Microscaling, MXFP4): 32 consecutive values along a matrix's input axis share
one scale, an e8m0 byte (2 ** (byte - 127)); each value is an fp4 e2m1 code (sign, 2 exponent
bits, 1 mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}), two codes per byte, the even element in
the low nibble. gpt-oss stores an expert tensor `[X, out, in]` as blocks `[X, out, in / 32, 16]`
and scales `[X, out, in / 32]`; the tensor it stands for (what transformers' `Mxfp4Dequantize`
produces, and what an unquantized gpt-oss checkpoint holds) is `[X, in, out]`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

BLOCK = 32
# e2m1 code -> value (code bit 3 is the sign)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def is_mxfp4(hf_config: dict) -> bool:
    return (hf_config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> f32 [..., G * 32]: each byte's low
    nibble then its high nibble, times 2 ** (scale - 127) of its block."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} must be scales {tuple(scales.shape)} + "
                         f"({BLOCK // 2},): {BLOCK} fp4 values per scale")
    values = np.empty(blocks.shape[:-1] + (BLOCK,), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values *= np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK)


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [..., in] (in a multiple of 32) -> (blocks, scales) of `dequantize`'s layout: each
    block's scale the power of two that brings its largest magnitude to at most 6 (the largest
    e2m1 value), each value rounded to the nearest e2m1 code. For tests and tools writing
    MXFP4 checkpoints."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 quantizes blocks of {BLOCK} values; the last axis is {w.shape[-1]}")
    b = w.astype(np.float32).reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = np.abs(b).max(-1)
    exp = np.clip(np.ceil(np.log2(np.maximum(amax, 2.0 ** -126) / 6.0)), -127, 127)
    codes = np.abs((b / np.exp2(exp)[..., None])[..., None] - FP4_VALUES).argmin(-1).astype(np.uint8)
    # C order whatever w's strides were: safetensors writes an array's buffer as it lies
    return (np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4), np.uint8),
            np.ascontiguousarray(exp + 127, np.uint8))


def dequantizing_getter(get: Callable[[str], np.ndarray]) -> Callable[[str], np.ndarray]:
    """`get` (a checkpoint reader: name -> array) that also answers `<name>` for every
    `<name>_blocks` / `<name>_scales` pair it holds, dequantized to [..., in, out] f32."""
    names = getattr(get, "names", frozenset())
    packed = {n.removesuffix("_blocks") for n in names
              if n.endswith("_blocks") and n.removesuffix("_blocks") + "_scales" in names}

    def read(name: str) -> np.ndarray:
        if name in packed and name not in names:
            try:
                w = dequantize(get(name + "_blocks"), get(name + "_scales"))
            except ValueError as e:
                raise ValueError(f"tensor {name}: {e}") from None
            return np.swapaxes(w, -1, -2)
        return get(name)

    read.names = frozenset(names) | packed
    return read
