"""Choosing the int4 (W4A16) matmul: the XLA tiles of `Int4Weight`, or the Mosaic GPU kernel.

`kernel="pallas"` re-lays an `Int4Weight` out once, at load, into the kernel's `Int4KernelWeight`
(signed int4 codes [N, K], compute-dtype scales and biases; `jaxserve.pallas.int4_matmul`), a weight
type of its own for `linear`. "auto" always means "xla": the kernel has passed interpret-mode
parity and CUDA lowering only, never a compile on a GPU, so nothing selects it but an explicit
`kernel="pallas"` (`loader.int4.stack_int4(kernel=...)`, `use_kernel(weights, "pallas")`).

Experts stay `Int4Weight`s inside their `ExpertWeight` under either kernel: `grouped_linear`'s
tiles vmap `int4_linear`, and on ragged_dot backends `layers/int4.py`'s ragged kernel dequantises
the experts for the call.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.layers.experts import ExpertWeight
from jaxserve.layers.int4 import Int4Weight, unpack
from jaxserve.layers.linear import register_linear
from jaxserve.pallas.int4_matmul import MGPU_AVAILABLE, Int4KernelWeight, int4_matmul_mgpu, kernel_layout

KERNELS = ("auto", "xla", "pallas")
# bf16_min_rows: the kernel computes in its own dtype whatever the rows
_KERNEL_FIELDS = ("q", "scale", "zero", "perm", "group_size", "in_shards", "bf16_min_rows")


def resolve_int4_kernel(name: str = "auto", num_devices: int = 1) -> str:
    """"auto" -> "xla" (see the module docstring); "pallas" needs jax >= 0.11 and one device (XLA
    partitions its own matmul over a mesh, not a Pallas call)."""
    if name not in KERNELS:
        raise ValueError(f"int4 kernel must be one of {KERNELS}, got {name!r}")
    if name == "pallas":
        if num_devices > 1:
            raise ValueError(f"int4 kernel 'pallas' runs on one device; weights placed on {num_devices} "
                             "devices (tensor parallelism) use kernel 'xla'")
        if not MGPU_AVAILABLE:
            raise ValueError(f"int4 kernel 'pallas' needs jax >= 0.11 (Mosaic GPU); this is jax {jax.__version__}")
    return "xla" if name == "auto" else name


def to_kernel(w: Int4Weight, dtype=jnp.bfloat16) -> Int4KernelWeight:
    """An `Int4Weight` [..., in, out] on one device -> the Mosaic GPU kernel's layout (computing in `dtype`)."""
    if w.in_shards != 1:
        raise ValueError(f"int4 kernel 'pallas' runs on one device; this weight's rows are split over {w.in_shards}")
    # the kernel knows codes, scales, integer zeros and a permutation; a weight using any other
    # field (a variant added to Int4Weight later) is refused rather than re-laid out without it
    extra = [f.name for f in dataclasses.fields(w) if f.name not in _KERNEL_FIELDS and _in_use(getattr(w, f.name), f)]
    if extra:
        raise ValueError(f"int4 kernel 'pallas' cannot run this Int4Weight: it uses {', '.join(extra)}")
    return kernel_layout(unpack(w.q), w.scale, w.zero, w.perm, w.group_size, dtype)


def _in_use(value, field: dataclasses.Field) -> bool:
    """An array field that is set, or a scalar one away from its default."""
    if value is None:
        return False
    return not isinstance(value, (bool, int, float, str)) or value != field.default


def use_kernel(weights, kernel: str = "auto", dtype=jnp.bfloat16):
    """A model pytree with every `Int4Weight` outside an `ExpertWeight` re-laid out for `kernel`
    (unchanged for "xla"/"auto")."""
    if resolve_int4_kernel(kernel) == "xla":
        return weights
    return jax.tree.map(lambda leaf: to_kernel(leaf, dtype) if isinstance(leaf, Int4Weight) else leaf, weights,
                        is_leaf=lambda x: isinstance(x, (Int4Weight, ExpertWeight)))


@register_linear(Int4KernelWeight)
def _int4_pallas(x: jax.Array, w: Int4KernelWeight) -> jax.Array:
    if w.codes.ndim != 2:
        raise ValueError(f"int4 kernel linear takes one [out, in] matrix, got codes {w.codes.shape}")
    lead = x.shape[:-1]
    y = int4_matmul_mgpu(x.reshape(-1, x.shape[-1]), w)
    return y.reshape(*lead, y.shape[-1])

