"""`Fp8Weight`: an e4m3 matrix with its scales, a weight type for `linear`.

Built by the loader (`--quantization fp8` on a full-precision checkpoint, or an FP8 checkpoint);
model code calls `linear(x, w)` as for a `DenseWeight` (and `grouped_linear` for experts
`[X, in, out]` inside an `ExpertWeight`). The matmul itself is
`jaxserve.pallas.fp8_matmul.fp8_matmul` (its docstring defines the scale layouts).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from jaxserve.layers.experts import register_ragged
from jaxserve.layers.linear import register_linear
from jaxserve.pallas import measured as measured_kernels
from jaxserve.pallas.fp8_matmul import BLOCK, dequantize, fp8_matmul, quantize_activations, scale_kind

ACTIVATIONS = ("none", "dynamic", "static")
KERNELS = ("auto", "xla", "pallas")
KERNEL_ALIASES = {"mosaic": "pallas"}     # the Pallas kernel is a Mosaic GPU one
logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Fp8Weight:
    """w [..., in, out] float8_e4m3fn, or [..., out, in] when `k_major` (the layout the Mosaic GPU
    kernel reads); stacked layers lead (`lax.scan` slices them off).

    scale: f32 multipliers [..., 1, 1] per tensor, [..., 1, out] per output channel,
      [..., ceil(in / b), out] per 1 x b group of inputs of each output channel, or
      [..., ceil(in / b), ceil(out / b)] per b x b block (b = block_size). Under tensor
      parallelism the scales are split with the codes they multiply (`loader.fp8.scale_sharding`).
    input_scale: [...] f32 static activation scale (compressed-tensors W8A8), else None.
    activations: "none" (W8A16), "dynamic" (e4m3 per token / per 1 x b group) or "static".
    kernel: "xla" or "pallas" (resolved from "auto" when the weight is made).
    """

    w: jax.Array
    scale: jax.Array
    input_scale: jax.Array | None = None
    activations: str = "dynamic"
    block_size: int = BLOCK
    kernel: str = "xla"
    k_major: bool = False

    def __post_init__(self):
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {self.activations!r}")
        if self.kernel not in ("xla", "pallas"):
            raise ValueError(f"kernel must be 'xla' or 'pallas' once resolved, got {self.kernel!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        """[..., in, out] whatever the storage layout."""
        return (*self.w.shape[:-2], *self.w.shape[-2:][:: -1 if self.k_major else 1])

    @property
    def dtype(self):
        return self.w.dtype

    @property
    def granularity(self) -> str:
        return scale_kind(self.scale.shape, self.shape[-1])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.w, self.scale, self.input_scale) if a is not None)


jax.tree_util.register_dataclass(Fp8Weight, data_fields=["w", "scale", "input_scale"],
                                 meta_fields=["activations", "block_size", "kernel", "k_major"])


def resolve_kernel(name: str = "auto", device=None, num_devices: int = 1,
                   measured: tuple | None = None) -> str:
    """"auto": the Mosaic GPU kernel where it has a recorded GPU measurement for this GPU class
    (`jaxserve.pallas.measured`; none yet), XLA elsewhere and on meshes of more than one device
    (`num_devices`): XLA partitions its own matmul over the mesh, but not a Pallas call, and the
    kernel has no `shard_map` wrapper yet. `measured`: the table (injectable in tests)."""
    name = KERNEL_ALIASES.get(name, name)
    if name not in KERNELS:
        raise ValueError(f"fp8 kernel must be one of {KERNELS + tuple(KERNEL_ALIASES)}, got {name!r}")
    if name == "pallas" and num_devices > 1:
        raise ValueError(f"fp8 kernel 'pallas' runs on one device; weights placed on {num_devices} "
                         "devices (tensor parallelism) use kernel 'xla'")
    if name != "auto":
        return name
    if num_devices > 1:
        return "xla"
    device = device or jax.devices()[0]
    cc = getattr(device, "compute_capability", None)
    hopper = device.platform == "gpu" and str(cc or "").startswith("9")
    if not (hopper and _kernel_available()):
        return "xla"
    table = measured_kernels.MEASURED if measured is None else measured
    if measured_kernels.find("fp8/pallas", str(cc), table=table) is None:
        logger.info("fp8 kernel auto: xla (%s)", measured_kernels.why_not("fp8/pallas", str(cc), table=table))
        return "xla"
    return "pallas"


def default_activations(device=None) -> str:
    """What `--quantization fp8` does with activations: "dynamic" (W8A8, e4m3 per token) where
    the GPU has FP8 tensor cores (compute capability >= 8.9): an FP8 dot reads the 1-byte weight
    as it is, while W8A16 there would widen it to a bf16 copy first (more bytes than bf16 weights).
    "none" (W8A16) elsewhere: no FP8 math on CPU, and it is the more accurate of the two."""
    device = device or jax.devices()[0]
    cc = str(getattr(device, "compute_capability", "") or "0")
    try:
        fp8_cores = device.platform == "gpu" and tuple(int(v) for v in cc.split(".")[:2]) >= (8, 9)
    except ValueError:
        fp8_cores = False
    return "dynamic" if fp8_cores else "none"


def _kernel_available() -> bool:
    from jaxserve.pallas.fp8_matmul import MGPU_AVAILABLE
    return MGPU_AVAILABLE


@register_linear(Fp8Weight)
def _fp8(x: jax.Array, weight: Fp8Weight) -> jax.Array:
    return fp8_matmul(x, weight.w, weight.scale, activations=weight.activations,
                      input_scale=weight.input_scale, block_size=weight.block_size,
                      kernel=weight.kernel, k_major=weight.k_major)


@register_ragged(Fp8Weight)
def _fp8_ragged(x: jax.Array, weight: Fp8Weight, group_sizes: jax.Array) -> jax.Array:
    # No grouped FP8 kernel yet: on ragged_dot backends the experts are dequantised into the
    # activation dtype for the call (the tiles layout dequantises only the routed experts).
    # Activations are rounded to e4m3 as `fp8_matmul` would (per token, or per 1 x b group).
    w = jnp.swapaxes(weight.w, -1, -2) if weight.k_major else weight.w
    if weight.activations == "dynamic":
        block = weight.granularity == "block"
        xq, xs = quantize_activations(x, weight.block_size if block else None)
        xs = jnp.repeat(xs, weight.block_size, axis=-1)[:, : x.shape[-1]] if block else xs
        x = (xq.astype(jnp.float32) * xs).astype(x.dtype)
    elif weight.activations == "static":
        raise ValueError("static activation scales are not supported for experts on the ragged layout")
    pref = jnp.float32 if x.dtype in (jnp.bfloat16, jnp.float16) else None
    return jax.lax.ragged_dot(x, dequantize(w, weight.scale, x.dtype, weight.block_size), group_sizes,
                              preferred_element_type=pref).astype(x.dtype)
