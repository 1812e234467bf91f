"""`linear`: the one place a weight meets an activation, dispatching on the weight's type.

A weight is a registered pytree type. `DenseWeight` holds a plain matrix; quantised (FP8 with
scales) and adapter (LoRA) types register their own kernel with `register_linear`, so a model
file calls `linear(x, w, b)` and never branches on how its weights are stored. Stacked experts
`[X, in, out]` are `layers/experts.py`'s `ExpertWeight` and its `grouped_linear`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxserve.pallas.common import target_platform


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DenseWeight:
    """A plain matrix `w [..., in, out]` (stacked layers lead; `lax.scan` slices them off)."""

    w: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    @property
    def dtype(self):
        return self.w.dtype


_LINEAR: dict[type, Callable] = {}
_TAKES_OUT_DTYPE: set[type] = set()


def register_linear(weight_type: type) -> Callable:
    """Decorator: `fn(x [..., in], weight) -> [..., out]` (in x.dtype) becomes the matmul of
    `weight_type`. A kernel with an `out_dtype` keyword returns that dtype from its f32
    accumulator when asked (`linear(..., out_dtype=jnp.float32)`: the head's logits)."""
    def register(fn: Callable) -> Callable:
        _LINEAR[weight_type] = fn
        if "out_dtype" in inspect.signature(fn).parameters:
            _TAKES_OUT_DTYPE.add(weight_type)
        return fn
    return register


@register_linear(DenseWeight)
def _dense(x: jax.Array, weight: DenseWeight, out_dtype=None) -> jax.Array:
    # f32 accumulation for low-precision inputs, result in the activation dtype unless told. On a
    # GPU the GEMM accumulates in f32 whatever its output type, so a result in the activation
    # dtype is asked for directly, even for f32 logits (cast after, as vLLM's logits are): under
    # tensor parallelism the row-parallel partial sums (wo, w_down) are then all-reduced in bf16,
    # half the bytes of f32 (vLLM's choice), and cuBLAS reads the head's bf16 weight as it is (a
    # one-row bf16 x bf16 -> f32 dot made XLA convert the whole [E, V] head to f32 first: 3x
    # its bytes). XLA:CPU has no bf16 x bf16 -> f32 fused dot and rounds a bf16 dot's partial
    # sums, so the CPU asks for f32. (Chosen at trace time, from the target.)
    low = x.dtype in (jnp.bfloat16, jnp.float16)
    pref = jnp.float32 if low and target_platform() != "gpu" else None
    return jnp.einsum("...i,io->...o", x, weight.w, preferred_element_type=pref).astype(out_dtype or x.dtype)


def linear(x: jax.Array, weight, b: jax.Array | None = None, *, out_dtype=None) -> jax.Array:
    """x [..., in] @ weight [in, out] (+ b [out]), by the kernel registered for weight's type;
    the result in `out_dtype` (default x.dtype)."""
    try:
        fn = _LINEAR[type(weight)]
    except KeyError:
        raise TypeError(f"no linear kernel registered for weight type {type(weight).__name__}; "
                        f"known: {', '.join(t.__name__ for t in _LINEAR)}") from None
    if out_dtype is None:
        y = fn(x, weight)
    elif type(weight) in _TAKES_OUT_DTYPE:
        y = fn(x, weight, out_dtype=out_dtype)
    else:
        y = fn(x, weight).astype(out_dtype)
    if b is not None:
        y = y + b.astype(y.dtype)
    return y
