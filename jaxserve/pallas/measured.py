"""Which kernels have been measured on which GPU: the table `auto` selection reads.

A kernel that no GPU has compiled and timed is never picked by `auto` (CPU lowering stops before
LLVM and ptxas, so passing the interpret and lowering gates says nothing about whether it compiles,
or how fast it is). Each entry is one measurement written in `benchmarks/RESULTS.md`. A kernel
that `benchmarks/gpu_suite.sh` measures goes in here in the same commit that records its figures.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One kernel measured on one device class, for one class of shapes.

    kernel: "attention/pallas" (Triton ragged paged attention), "attention/mosaic" (Mosaic GPU
      paged attention), "fp8/pallas" (Mosaic GPU FP8 matmul).
    device_class: "sm90" (Hopper: H100/H200), from the CUDA compute capability.
    q_dtypes / head_dims: the shape class the figures cover (None: any). f32 queries are left out
      on purpose where the figures were taken in bf16: GPU dots on f32 run as TF32.
    where: the RESULTS.md section that holds the figures.
    """

    kernel: str
    device_class: str
    q_dtypes: tuple[str, ...] | None
    head_dims: tuple[int, ...] | None
    where: str


MEASURED: tuple[Measurement, ...] = (
    Measurement("attention/pallas", "sm90", ("bfloat16", "float16"), (128,),
                "benchmarks/RESULTS.md, 'Paged attention kernel', 2026-11-22, NVIDIA H100 80GB HBM3: "
                "decode 78% of HBM peak at batch 256 x 8k, bf16 KV; `pytest -m gpu` parity in bf16"),
)


def device_class(compute_capability: str | None) -> str | None:
    """"9.0" -> "sm90"; None (not a CUDA GPU) -> None."""
    if not compute_capability:
        return None
    major, _, minor = str(compute_capability).partition(".")
    return f"sm{major}{(minor or '0')[0]}"


def _dtype_name(dtype) -> str | None:
    return dtype if dtype is None or isinstance(dtype, str) else np.dtype(dtype).name


def find(kernel: str, compute_capability: str | None, q_dtype=None, head_dim: int | None = None,
         table: tuple[Measurement, ...] = MEASURED) -> Measurement | None:
    """The measurement that lets `auto` pick `kernel` here, or None."""
    cls = device_class(compute_capability)
    q_name = _dtype_name(q_dtype)
    for m in table:
        if m.kernel != kernel or m.device_class != cls:
            continue
        if m.q_dtypes is not None and q_name is not None and q_name not in m.q_dtypes:
            continue
        if m.head_dims is not None and head_dim is not None and head_dim not in m.head_dims:
            continue
        return m
    return None


def why_not(kernel: str, compute_capability: str | None, q_dtype=None, head_dim: int | None = None,
            table: tuple[Measurement, ...] = MEASURED) -> str:
    """A log line's reason: what measurement is missing for `kernel` here."""
    cls = device_class(compute_capability) or "this device"
    near = [m for m in table if m.kernel == kernel and m.device_class == cls]
    if not near:
        return f"{kernel} has no GPU measurement on {cls} (benchmarks/gpu_suite.sh records one)"
    q_name = _dtype_name(q_dtype)
    return (f"{kernel} was measured on {cls} for q dtypes {near[0].q_dtypes} and head dims "
            f"{near[0].head_dims}, not q {q_name} with head dim {head_dim}")
