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
    per_expert: (stacked only) the checkpoint holds one tensor per layer and expert ("{expert}"
        in its name), stacked here on axes 0 (layer) and 1 (expert).
    transpose: the checkpoint stores the matrix [out, in]; the model uses [in, out].
    dense: a matmul operand, wrapped in a weight type (DenseWeight; an ExpertWeight around it
        when per_expert) in the pytree, and what FP8 loading and quantisation apply to.
    layers: (stacked only) the checkpoint layer of each stacked index, when the array holds only
        some layers (a model mixing dense and MoE MLPs); None: layers 0 .. shape[0] - 1.
    rows: (start, stop) or (start, stop, step) of the checkpoint tensor's `out` axis (its first
        axis when `transpose`, its last otherwise) this array holds, when the checkpoint fuses
        several arrays into one tensor (Phi-3's qkv_proj and gate_up_proj: ranges; gpt-oss's
        experts' gate_up_proj: gate and up interleaved, step 2); None: the whole tensor.
    init: how `--load-format dummy` fills it: normal(0, 0.02), ones or zeros.
    dtype: a dtype name the array keeps whatever the serving dtype (DeepSeek V3's routing bias:
        float32, as vLLM keeps it: its experts' biases differ in digits bfloat16 drops); None: the
        serving dtype.
    """

    path: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    checkpoint: str
    stacked: bool = False
    per_expert: bool = False
    transpose: bool = False
    dense: bool = False
    init: str = "normal"
    layers: tuple[int, ...] | None = None
    rows: tuple[int, ...] | None = None
    dtype: str | None = None

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"{self.path}: shape {self.shape} and axes {self.axes} differ in rank")
        if self.init not in INITS:
            raise ValueError(f"{self.path}: init must be one of {INITS}, got {self.init!r}")
        if self.per_expert and not self.stacked:
            raise ValueError(f"{self.path}: per_expert arrays must also be stacked by layer")
        if self.layers is not None and (not self.stacked or len(self.layers) != self.shape[0]):
            raise ValueError(f"{self.path}: layers {self.layers} must name one checkpoint layer "
                             f"per stacked index ({self.shape[0] if self.shape else 0})")
        if self.rows is not None and len(self.rows) not in (2, 3):
            raise ValueError(f"{self.path}: rows must be (start, stop) or (start, stop, step), got {self.rows}")

    @property
    def out_axis(self) -> int:
        """The checkpoint tensor's axis `rows` selects from."""
        return 0 if self.transpose else -1

    def row_slice(self) -> slice:
        return slice(*self.rows) if self.rows is not None else slice(None)

    def checkpoint_name(self, index: int | None = None, expert: int | None = None) -> str:
        """The checkpoint tensor of stacked index `index` (and `expert`)."""
        if not self.stacked:
            return self.checkpoint
        layer = index if self.layers is None else self.layers[index]
        return self.checkpoint.format(layer=layer, expert=expert)

    @property
    def stacked_dims(self) -> int:
        """Leading axes stacked from separate checkpoint tensors (layer, then expert)."""
        return 2 if self.per_expert else 1 if self.stacked else 0

    def checkpoint_names(self) -> list[tuple[tuple[int, ...], str]]:
        """(index into the stacked axes, checkpoint name) of every tensor this array holds."""
        if not self.stacked:
            return [((), self.checkpoint)]
        if not self.per_expert:
            return [((i,), self.checkpoint_name(i)) for i in range(self.shape[0])]
        return [((i, e), self.checkpoint_name(i, e)) for i in range(self.shape[0])
                for e in range(self.shape[1])]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def abstract_weights(params: list[Param], dtype) -> dict[str, jax.ShapeDtypeStruct]:
    """path -> ShapeDtypeStruct: what loading would allocate, without allocating it."""
    return {p.path: jax.ShapeDtypeStruct(p.shape, p.dtype or dtype) for p in params}


def num_parameters(params: list[Param]) -> int:
    return sum(p.size for p in params)


def layer_param_makers(num_layers: int, layer: str = "model.layers.{layer}."):
    """(per_layer, matrix): the families' makers of `Param`s stacked over layers.
    `per_layer(name, shape, axes, suffix, ids=all layers, **Param fields)` declares
    `layers.{name}` [len(ids), *shape] read from `layer + suffix` of each layer in `ids`;
    `matrix` is the same for a linear weight (stored [in, out]: transposed from the checkpoint)."""
    every = tuple(range(num_layers))

    def per_layer(name, shape, axes, suffix, ids=every, **kw):
        return Param(f"layers.{name}", (len(ids), *shape), ("layers", *axes), layer + suffix,
                     stacked=True, layers=None if ids == every else ids, **kw)

    def matrix(name, shape, axes, suffix, ids=every):
        return per_layer(name, shape, axes, suffix, ids, transpose=True, dense=True)

    return per_layer, matrix


def is_plain_array(a) -> bool:
    """A plain array of a built model (to wrap as a `DenseWeight`), concrete or abstract: a
    `jax.ShapeDtypeStruct` with its sharding stands for one when compiling without the devices
    (`jaxserve.aot`)."""
    return isinstance(a, (jax.Array, jax.ShapeDtypeStruct))
