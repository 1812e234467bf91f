"""FP8 weights at load time: `--quantization fp8` on a full-precision checkpoint, and FP8
checkpoints detected from `config.json`'s `quantization_config`.

Formats read (tensor names next to each linear layer's `<prefix>.weight`, stored e4m3 [out, in]):
  HF "fp8" (DeepSeek-V3, Qwen3-*-FP8): `weight_block_size: [128, 128]` and `weight_scale_inv`
      [ceil(out/128), ceil(in/128)] (a multiplier, despite the name); without a block size, a
      per-tensor `weight_scale`; `activation_scheme` "dynamic", or "static" with `input_scale`.
  compressed-tensors "float-quantized": `weight_scale` [out, 1] (strategy "channel") or [1]
      ("tensor"), [ceil(out/b), ceil(in/b)] ("block"); `input_activations` absent (W8A16),
      dynamic (per token) or static (`input_scale` [1]).
Modules the checkpoint leaves unquantised (no scale tensor: lm_head, MoE routers, `ignore`d
layers) stay `DenseWeight`. Mixture-of-experts experts (one tensor per layer and expert) stack
into one `Fp8Weight` [L, X, in, out] inside their `ExpertWeight`. Embeddings and norms are never
quantised; `--quantization fp8` also skips lm_head and the routers (vLLM's defaults) and covers
the experts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.config import FP8_ACTIVATIONS
from jaxserve.layers.experts import ExpertWeight
from jaxserve.layers.fp8 import Fp8Weight, default_activations, resolve_kernel
from jaxserve.layers.linear import DenseWeight
from jaxserve.pallas.fp8_matmul import BLOCK, quantize_weight
from jaxserve.sharding.plan import place

SKIP_ON_THE_FLY = ("lm_head", "layers.router")     # vLLM's default: the head and routers keep the model dtype
# `--quantization fp8`'s weight scales. Chosen on a broad held-out set (benchmarks/RESULTS.md,
# "FP8 weight granularity"): per-channel, 1 x 128 groups, 128 x 128 blocks and per-tensor measure
# within the spread between draws of one granularity's rounding errors; per-channel has the lowest
# mean, splits over any tensor-parallel size that splits the matrix (no block alignment) and runs
# on every kernel.
DEFAULT_GRANULARITY = "channel"


@dataclasses.dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint's FP8 linear layers are stored (parsed from quantization_config)."""

    method: str                      # "fp8" (HF) or "compressed-tensors"
    scale_suffix: str                # "weight_scale_inv" or "weight_scale"
    activations: str                 # "none", "dynamic" or "static"
    block_size: int = BLOCK


def scheme_of(hf_config: dict) -> Fp8Scheme | None:
    """The FP8 scheme of a config.json, None when it has no quantization_config; raises
    ValueError for quantization methods jaxserve cannot read."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config.fmt must be 'e4m3', got {q.get('fmt')!r}")
        block = q.get("weight_block_size")
        act = q.get("activation_scheme", "dynamic")
        if act not in ("dynamic", "static"):
            raise ValueError(f"quantization_config.activation_scheme must be dynamic or static, got {act!r}")
        if block is not None:
            if len(block) != 2 or block[0] != block[1]:
                raise ValueError(f"quantization_config.weight_block_size must be square [b, b], got {block}")
            return Fp8Scheme("fp8", "weight_scale_inv", act, int(block[0]))
        return Fp8Scheme("fp8", "weight_scale", act)
    if method == "compressed-tensors":
        groups = list((q.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors: exactly one config group is supported, got {len(groups)}")
        wq, aq = groups[0].get("weights") or {}, groups[0].get("input_activations")
        if wq.get("type") != "float" or wq.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors: only 8-bit float weights are supported, got {wq}")
        if wq.get("strategy") not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors: weight strategy must be tensor, channel or block, got "
                             f"{wq.get('strategy')!r}")
        block = (wq.get("block_structure") or [BLOCK, BLOCK])[0]
        act = "none" if not aq else ("dynamic" if aq.get("dynamic") else "static")
        return Fp8Scheme("compressed-tensors", "weight_scale", act, int(block))
    raise ValueError(f"quantization_config.quant_method {method!r} is not supported; jaxserve reads "
                     "'fp8', 'compressed-tensors' (FP8 and int4), 'gptq' and 'awq' (int4) checkpoints")


def _prefix(weight_name: str) -> str:
    if not weight_name.endswith(".weight"):
        raise ValueError(f"{weight_name} is not a '.weight' tensor")
    return weight_name[: -len("weight")]


def has_fp8(scheme: Fp8Scheme, names, weight_name: str) -> bool:
    return _prefix(weight_name) + scheme.scale_suffix in names


def read_fp8(scheme: Fp8Scheme, get: Callable[[str], np.ndarray], weight_name: str, k: int, n: int,
             k_major: bool = False):
    """One layer's (e4m3 w [in, out] (or [out, in] when `k_major`), f32 scale [r, c], input_scale []
    or None) from the checkpoint's [out, in] tensors."""
    prefix = _prefix(weight_name)
    w = np.asarray(get(weight_name))
    if w.dtype != ml_dtypes.float8_e4m3fn:
        raise ValueError(f"{weight_name} is {w.dtype}, expected float8_e4m3fn (F8_E4M3)")
    if w.shape != (n, k):
        raise ValueError(f"{weight_name} has shape {w.shape}, expected {(n, k)} from the model config")
    w = w if k_major else w.T
    s = np.asarray(get(prefix + scheme.scale_suffix), np.float32)
    b = scheme.block_size
    if s.size == 1:
        s = s.reshape(1, 1)
    elif s.ndim == 2 and s.shape == (n, 1):                          # per output channel
        s = s.T
    elif s.ndim == 2 and s.shape == (-(-n // b), -(-k // b)):       # blocks, [out/b, in/b]
        s = s.T
    else:
        raise ValueError(f"{prefix}{scheme.scale_suffix} has shape {s.shape}; expected [1], [{n}, 1] or "
                         f"[{-(-n // b)}, {-(-k // b)}] for a [{n}, {k}] weight")
    x_scale = None
    if scheme.activations == "static":
        x_scale = np.asarray(get(prefix + "input_scale"), np.float32).reshape(())
    return w, np.ascontiguousarray(s), x_scale


def served_activations(scheme: Fp8Scheme, device=None, force: str = "auto") -> str:
    """How a checkpoint's activations are served: its own scheme ("dynamic" or "static": W8A8)
    where the device has FP8 tensor cores (`default_activations`: compute capability >= 8.9), else
    "none" (W8A16, the weights dequantised tile by tile and the activations left as they are, as
    vLLM's Marlin path runs FP8 checkpoints off FP8 hardware: emulated e4m3 activations would only
    cost accuracy and time). `force` "w8a8" / "w8a16" overrides (--fp8-activations)."""
    if force not in FP8_ACTIVATIONS:
        raise ValueError(f"fp8_activations must be one of {', '.join(FP8_ACTIVATIONS)}, got {force!r}")
    if scheme.activations == "none" or force == "w8a16":
        return "none"
    if force == "w8a8" or default_activations(device) != "none":
        return scheme.activations
    return "none"


def stack_fp8(scheme: Fp8Scheme, get, names: list[str], k: int, n: int, data_sharding, kernel: str = "auto",
              lead: tuple[int, ...] | None = None, activations: str | None = None):
    """Per-layer FP8 tensors -> one stacked Fp8Weight [L, in, out] on the device ([L, out, in]
    for the Mosaic GPU kernel), the codes placed as `data_sharding` ([L, in, out]) says and the
    scales with them (`scale_sharding`); `lead` (default: [len(names)]) the stacked axes the names
    fill in order, [L, X] for per-layer experts. activations: as served (`served_activations`;
    None: the scheme's)."""
    kernel = resolve_kernel(kernel, num_devices=data_sharding.mesh.size)
    k_major = kernel == "pallas"
    lead = tuple(lead or (len(names),))
    parts = [read_fp8(scheme, get, name, k, n, k_major) for name in names]
    w = np.stack([p[0] for p in parts]).reshape(*lead, *parts[0][0].shape)
    s = np.stack([p[1] for p in parts]).reshape(*lead, *parts[0][1].shape)
    x_scale = (np.stack([p[2] for p in parts]).reshape(lead) if scheme.activations == "static"
               else None)
    rep = NamedSharding(data_sharding.mesh, PartitionSpec())
    s_sharding = scale_sharding(data_sharding, s.shape, k, n, scheme.block_size)
    return Fp8Weight(jax.device_put(w, _swapped(data_sharding, w.ndim) if k_major else data_sharding),
                     jax.device_put(s, s_sharding), None if x_scale is None else jax.device_put(x_scale, rep),
                     activations=activations or scheme.activations, block_size=scheme.block_size, kernel=kernel,
                     k_major=k_major)


def scale_sharding(codes: NamedSharding, scale_shape: tuple[int, ...], k: int, n: int,
                   block_size: int = BLOCK) -> NamedSharding:
    """Where the scales [..., r, c] of codes [..., K=k, N=n] placed as `codes` go: each device
    holds the scales of its own codes. Per-tensor: replicated; per-channel: split along N with
    the codes; groups and blocks: split along whichever of K, N the codes are split on. Raises
    ValueError when a device's slice of a blocked dimension is not a whole number of blocks."""
    spec = tuple(codes.spec) + (None,) * (len(scale_shape) - len(codes.spec))
    out = list(spec[:-2])
    for dim, size, name in ((-2, k, "input"), (-1, n, "output")):
        axis = spec[dim]
        if axis is None or scale_shape[dim] == 1:
            out.append(None)
            continue
        parts = math.prod(codes.mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))
        if parts > 1 and scale_shape[dim] != size and (size % parts or (size // parts) % block_size):
            raise ValueError(f"FP8 scales per {block_size}-wide block do not split over {parts} devices: "
                             f"each would hold {size / parts:g} of the weight's {size} {name} features, "
                             f"not a whole number of blocks; tensor_parallel_size must divide {size} "
                             f"into multiples of {block_size}")
        out.append(axis)
    return NamedSharding(codes.mesh, PartitionSpec(*out))


def _swapped(sharding: NamedSharding, ndim: int) -> NamedSharding:
    """The sharding of the same array stored with its last two axes swapped."""
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[:-2], spec[-1], spec[-2]))


_quantize = jax.jit(quantize_weight, static_argnames=("granularity", "block_size"))


def quantize_array(w: jax.Array, *, activations: str | None = None, kernel: str = "auto",
                   granularity: str = DEFAULT_GRANULARITY) -> Fp8Weight:
    """A full-precision matrix [..., in, out] -> Fp8Weight (per-output-channel scales unless told),
    made on the array's devices (the data keeps the array's sharding; the scales are replicated).
    activations None: `default_activations()` (W8A8 on GPUs with FP8 tensor cores, else W8A16)."""
    if isinstance(w, jax.ShapeDtypeStruct):      # abstract weights (jaxserve.aot): shapes only
        q, s = jax.eval_shape(lambda w: _quantize(w, granularity), w)
    else:
        q, s = _quantize(w, granularity)
    return fp8_weight(q, s, like=w, activations=activations, kernel=kernel)


def fp8_weight(q: jax.Array, s: jax.Array, *, like=None, activations: str | None = None,
               kernel: str = "auto") -> Fp8Weight:
    """e4m3 codes [..., in, out] and their scales -> an Fp8Weight in the kernel's layout, the
    codes placed as `like` (the full-precision array they came from) is, the scales with them
    (`scale_sharding`)."""
    sharding = getattr(like, "sharding", None)
    sharding = sharding if isinstance(sharding, NamedSharding) else None
    # the devices the weights are for (a compile-only H100 when compiling ahead of time)
    device = None if sharding is None else sharding.mesh.devices.flat[0]
    kernel = resolve_kernel(kernel, device=device, num_devices=1 if sharding is None else sharding.mesh.size)
    activations = activations or default_activations(device)
    k_major = kernel == "pallas"
    if k_major:
        q = jax.eval_shape(jnp.swapaxes, q, -1, -2) if isinstance(q, jax.ShapeDtypeStruct) \
            else jnp.swapaxes(q, -1, -2)
    if sharding is not None:
        q = place(q, _swapped(sharding, like.ndim) if k_major else sharding)
        s = place(s, scale_sharding(sharding, s.shape, *like.shape[-2:]))
    return Fp8Weight(q, s, activations=activations, kernel=kernel, k_major=k_major)


def replace_dense(weights, fn: Callable[[str, DenseWeight], object]):
    """Map every DenseWeight of a model pytree through `fn(param_path, weight)`, the experts'
    (inside an `ExpertWeight`, which stays around the result) included; param paths are the
    declaration's ("layers.wq", "layers.we_gate", "lm_head"), from the pytree's attribute keys."""
    def visit(keypath, leaf):
        if isinstance(leaf, ExpertWeight):
            return ExpertWeight(visit(keypath, leaf.w))
        if not isinstance(leaf, DenseWeight):
            return leaf
        return fn(_path(keypath), leaf)
    return jax.tree_util.tree_map_with_path(visit, weights,
                                            is_leaf=lambda x: isinstance(x, (DenseWeight, ExpertWeight)))


def quantize_weights(weights, *, skip=SKIP_ON_THE_FLY, activations: str | None = None, kernel: str = "auto",
                     granularity: str = DEFAULT_GRANULARITY):
    """`--quantization fp8` on loaded weights: every DenseWeight but `skip` becomes an Fp8Weight."""
    return replace_dense(weights, lambda path, w: w if path in skip else
                         quantize_array(w.w, activations=activations, kernel=kernel, granularity=granularity))


def _path(keypath) -> str:
    return ".".join(str(getattr(k, "name", k)) for k in keypath)


def linear_weight_bytes(weights, skip=SKIP_ON_THE_FLY) -> int:
    """Bytes on the device of the linear layers' weights (data and scales), `skip` excluded."""
    total = 0

    def visit(keypath, leaf):
        nonlocal total
        if isinstance(leaf, (DenseWeight, Fp8Weight)) and _path(keypath) not in skip:
            total += sum(a.nbytes for a in jax.tree_util.tree_leaves(leaf))
        return leaf
    jax.tree_util.tree_map_with_path(visit, weights, is_leaf=lambda x: isinstance(x, (DenseWeight, Fp8Weight)))
    return total


def with_kernel(weights, kernel: str):
    """Every `Fp8Weight` of a model pytree (experts' included) in `kernel`'s layout, "xla" or
    "pallas" (`resolve_kernel` names; "auto" resolves here): the codes transposed where the layout
    changes. For `--fp8-kernel` and the warm-up fallback (jaxserve/engine/fallback.py)."""
    def one(w):
        if not isinstance(w, Fp8Weight):
            return w
        sharding = getattr(w.w, "sharding", None)
        devices = sharding.mesh.size if isinstance(sharding, NamedSharding) else 1
        target = resolve_kernel(kernel, num_devices=devices)
        if w.kernel == target:
            return w
        k_major = target == "pallas"
        q = w.w if k_major == w.k_major else jnp.swapaxes(w.w, -1, -2)
        return dataclasses.replace(w, w=q, kernel=target, k_major=k_major)
    return jax.tree_util.tree_map(one, weights, is_leaf=lambda x: isinstance(x, Fp8Weight))


def kernels_in(weights) -> set[str]:
    """The FP8 kernels a model pytree's `Fp8Weight`s run on (empty: no FP8 weights)."""
    is_fp8 = lambda x: isinstance(x, Fp8Weight)     # noqa: E731
    return {w.kernel for w in jax.tree_util.tree_leaves(weights, is_leaf=is_fp8) if is_fp8(w)}
