"""The weight declaration a model file writes once: for every array its shape, logical axes,
checkpoint name and how dummy weights initialise it. The loaders (safetensors, GGUF, dummy), the
sharding rules, abstract shape checks and the tests all read it; nothing else lists weights.

    params = llama.declare(cfg)                  # list[Param]
    abstract_weights(params, jnp.bfloat16)       # path -> ShapeDtypeStruct, no allocation
    llama.build(cfg, {p.path: array, ...})       # the model's pytree (DenseWeight where declared)
"""

from __future__ import annotations

import dataclasses
import math

import jax

INITS = ("normal", "ones", "zeros")


@dataclasses.dataclass(frozen=True)
class Param:
    """One array of a model.

    path: its place in the model pytree ("embed", "layers.wq").
    shape: the full shape; per-layer arrays are stacked, the layer axis first.
    axes: one logical axis name per dimension (the sharding rules map them to mesh axes).
    checkpoint: the Hugging Face tensor name; "{layer}" stands for the layer index when stacked.
    stacked: the checkpoint holds one tensor per layer, stacked here on axis 0.
    transpose: the checkpoint stores the matrix [out, in]; the model uses [in, out].
    dense: a matmul operand, wrapped in a weight type (DenseWeight) in the pytree.
    init: how `--load-format dummy` fills it: normal(0, 0.02), ones or zeros.
    """

    path: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    checkpoint: str
    stacked: bool = False
    transpose: bool = False
    dense: bool = False
    init: str = "normal"

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"{self.path}: shape {self.shape} and axes {self.axes} differ in rank")
        if self.init not in INITS:
            raise ValueError(f"{self.path}: init must be one of {INITS}, got {self.init!r}")

    def checkpoint_name(self, layer: int | None = None) -> str:
        return self.checkpoint.format(layer=layer) if self.stacked else self.checkpoint

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def abstract_weights(params: list[Param], dtype) -> dict[str, jax.ShapeDtypeStruct]:
    """path -> ShapeDtypeStruct: what loading would allocate, without allocating it."""
    return {p.path: jax.ShapeDtypeStruct(p.shape, dtype) for p in params}


def num_parameters(params: list[Param]) -> int:
    return sum(p.size for p in params)
