"""Int4 (W4A16) checkpoints at load time, detected from `config.json`'s `quantization_config`, read
into `Int4Weight`s (jaxserve/layers/int4.py: codes packed along the input, GPTQ's layout).

Formats read (tensors next to each linear layer's `<prefix>.weight`, which these files lack):
  GPTQ (`quant_method` "gptq", `bits` 4): `qweight` int32 [in/8, out], input row 8r+j in bits
      4j of word r; `qzeros` int32 [groups, out/8], column 8c+j in bits 4j; `scales` f16
      [groups, out]; `g_idx` int32 [in] (each input row's group). `checkpoint_format` "gptq" (v1,
      the default: AutoGPTQ, optimum) stores zero - 1: AutoGPTQ's packer subtracted 1 before
      packing and its dequantiser, vLLM's GPTQ kernels (`zeros + 1`) and GPTQModel's v1 -> v2
      conversion add it back; here `(nibble + 1) & 15` (a stored -1 wrapped to 15 is zero 0).
      "gptq_v2" stores the zero as it is. Symmetric checkpoints store zero 8 (nibbles 7 in v1).
      `desc_act` true (act-order): the rows' groups follow `g_idx`; the rows are sorted by group
      at load (`perm`, applied to the activations) and every group must hold `group_size` rows.
  AWQ (`quant_method` "awq", `version` "gemm", `zero_point` true): `qweight` int32 [in, out/8]
      and `qzeros` [groups, out/8] with the columns of each word interleaved: nibble i holds
      column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; `scales` f16 [groups, out]; zeros stored as they are.
  compressed-tensors `pack-quantized` (int, 4 bits, strategy "group" or "channel", no input
      activation quantisation): `weight_packed` int32 [out, in/8] (input 8c+i in bits 4i of
      word c), codes stored as signed int4 + 8; `weight_scale` [out, groups];
      `weight_zero_point` int32 [ceil(out/8), groups] packed along the output (asymmetric only,
      also + 8); `weight_g_idx` [in] with actorder; `weight_shape` [out, in].
Modules without these tensors (lm_head, routers, ignored layers) stay `DenseWeight`s; an int4
lm_head is dequantised to the model dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.layers.int4 import PACK, SYMMETRIC_ZERO, Int4Weight, check_groups

METHODS = ("gptq", "awq", "compressed-tensors")
# vLLM's --quantization names for the same checkpoints (its kernel choices) map to the method
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "compressed_tensors": "compressed-tensors"}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)     # nibble i of an AWQ word holds column AWQ_ORDER[i]


@dataclasses.dataclass(frozen=True)
class Int4Scheme:
    """How a checkpoint's int4 linear layers are stored (parsed from quantization_config)."""

    method: str                      # "gptq", "awq" or "compressed-tensors"
    group_size: int | None           # None: one group over the whole input (per-channel)
    symmetric: bool
    act_order: bool = False          # GPTQ desc_act / compressed-tensors actorder
    zero_offset: int = 0             # added to stored zeros (1 for GPTQ v1 checkpoints)


def is_int4(hf_config: dict) -> bool:
    """Whether config.json's quantization_config describes an integer weight-only checkpoint
    (this module's business) rather than FP8 (loader/fp8.py)."""
    q = hf_config.get("quantization_config") or {}
    method = q.get("quant_method")
    if method in ("gptq", "awq"):
        return True
    if method == "compressed-tensors":
        groups = list((q.get("config_groups") or {}).values())
        return any((g.get("weights") or {}).get("type") == "int" for g in groups)
    return False


def _field(q: dict, name: str, allowed, default=None, prefix="quantization_config"):
    v = q.get(name, default)
    if v not in allowed:
        raise ValueError(f"{prefix}.{name} must be one of {list(allowed)} for int4 weights, got {v!r}")
    return v


def _group(value, field: str) -> int | None:
    if value == -1:
        return None
    if not isinstance(value, int) or value <= 0 or value % PACK:
        raise ValueError(f"{field} must be -1 or a positive multiple of {PACK}, got {value!r}")
    return value


def scheme_of(hf_config: dict) -> Int4Scheme:
    """The int4 scheme of a config.json whose `is_int4` is true; ValueError naming the field for
    anything jaxserve cannot load exactly."""
    q = hf_config["quantization_config"]
    method = q.get("quant_method")
    if method in ("gptq", "awq"):
        _field(q, "bits", (4,), q.get("w_bit"))
        group = _group(q.get("group_size", q.get("q_group_size", 128)), "quantization_config.group_size")
    if method == "gptq":
        fmt = _field(q, "checkpoint_format", ("gptq", "gptq_v2"), "gptq")
        sym = bool(q.get("sym", True))
        return Int4Scheme("gptq", group, sym, bool(q.get("desc_act", False)), 1 if fmt == "gptq" else 0)
    if method == "awq":
        _field(q, "version", ("gemm", "GEMM"), "gemm")
        _field(q, "zero_point", (True,), True)
        return Int4Scheme("awq", group, False)
    groups = list((q.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors: exactly one config group is supported, got {len(groups)}")
    fmt = groups[0].get("format") or q.get("format")
    if fmt != "pack-quantized":
        raise ValueError(f"compressed-tensors: int4 weights must use format 'pack-quantized', got {fmt!r}")
    w, pre = groups[0]["weights"], "quantization_config.config_groups.*.weights"
    _field(w, "num_bits", (4,), prefix=pre)
    strategy = _field(w, "strategy", ("group", "channel"), prefix=pre)
    if groups[0].get("input_activations"):
        raise ValueError("compressed-tensors: quantised input_activations with int4 weights (W4A8) are not "
                         "supported; jaxserve reads W4A16")
    # "group" (alias "dynamic") stores each input's group in weight_g_idx; "weight" (alias "static")
    # only chose the order GPTQ visited the columns in, the groups stay contiguous (no g_idx)
    actorder = _field(w, "actorder", (None, "group", "weight", "static", "dynamic", False, True), prefix=pre)
    group = _group(w.get("group_size"), pre + ".group_size") if strategy == "group" else None
    return Int4Scheme("compressed-tensors", group,
                      bool(w.get("symmetric", True)), actorder in ("group", "dynamic", True))


def _prefix(weight_name: str) -> str:
    if not weight_name.endswith(".weight"):
        raise ValueError(f"{weight_name} is not a '.weight' tensor")
    return weight_name[: -len("weight")]


def _code_name(scheme: Int4Scheme) -> str:
    return "weight_packed" if scheme.method == "compressed-tensors" else "qweight"


def has_int4(scheme: Int4Scheme, names, weight_name: str) -> bool:
    return _prefix(weight_name) + _code_name(scheme) in names


def unpack_np(words: np.ndarray, axis: int, order=tuple(range(PACK))) -> np.ndarray:
    """int32 words -> uint8 codes with `axis` 8x longer: element 8c + order[i] from bits 4i of word c."""
    w = np.moveaxis(np.asarray(words).view(np.uint32), axis, -1)
    out = np.empty((*w.shape[:-1], w.shape[-1], PACK), np.uint8)
    for i, j in enumerate(order):
        out[..., j] = (w >> (4 * i)) & 0xF
    return np.moveaxis(out.reshape(*w.shape[:-1], w.shape[-1] * PACK), -1, axis)


def pack_np(codes: np.ndarray, axis: int, order=tuple(range(PACK))) -> np.ndarray:
    """The inverse of `unpack_np`: uint8 codes (0..15) -> int32 words along `axis`."""
    c = np.moveaxis(np.asarray(codes, np.uint32), axis, -1)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // PACK, PACK)
    w = np.zeros(c.shape[:-1], np.uint32)
    for i, j in enumerate(order):
        w |= c[..., j] << (4 * i)
    return np.moveaxis(w.view(np.int32), -1, axis)


def _get(get, name: str, dtype, shape) -> np.ndarray:
    x = np.asarray(get(name))
    if x.shape != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} from the model config")
    return x.astype(dtype, copy=False) if dtype is not None else x


def stored_group(scheme: Int4Scheme, k: int) -> int:
    """The group size an `Int4Weight` of `k` input rows is stored with: the checkpoint's, or for
    per-channel scales (one group over all rows) the largest of 128, 64, ..., 8 dividing k, the
    scales repeated: the kernel tiles by groups, and a split over devices needs whole groups."""
    if scheme.group_size is not None:
        return scheme.group_size
    return next((g for g in (128, 64, 32, 16, 8) if k % g == 0), k)


def read_int4(scheme: Int4Scheme, get: Callable[[str], np.ndarray], names, weight_name: str, k: int, n: int):
    """One layer's (codes uint8 [in, out] in storage order, scale f32 [in / g, out], zero uint8
    [in / g, out] or None (symmetric), perm int32 [in] or None) from its checkpoint tensors, g =
    `stored_group`. Raises ValueError naming the tensor or field for anything inconsistent."""
    p = _prefix(weight_name)
    g = scheme.group_size or k
    check_groups(k, g, what=weight_name)
    if n % PACK:
        raise ValueError(f"{weight_name}: {n} output features are not a multiple of {PACK} (int4 packing)")
    G = k // g
    gidx_name = p + ("weight_g_idx" if scheme.method == "compressed-tensors" else "g_idx")
    if scheme.method == "gptq":
        codes = unpack_np(_get(get, p + "qweight", None, (k // PACK, n)), 0)
        scale = _get(get, p + "scales", np.float32, (G, n))
        zero = (unpack_np(_get(get, p + "qzeros", None, (G, n // PACK)), 1) + scheme.zero_offset) & 0xF
    elif scheme.method == "awq":
        codes = unpack_np(_get(get, p + "qweight", None, (k, n // PACK)), 1, AWQ_ORDER)
        scale = _get(get, p + "scales", np.float32, (G, n))
        zero = unpack_np(_get(get, p + "qzeros", None, (G, n // PACK)), 1, AWQ_ORDER)
    else:
        shape_name = p + "weight_shape"
        if shape_name in names and tuple(np.asarray(get(shape_name)).tolist()) != (n, k):
            raise ValueError(f"{shape_name} is {np.asarray(get(shape_name)).tolist()}, expected {[n, k]}")
        codes = unpack_np(_get(get, p + "weight_packed", None, (n, k // PACK)), 1).T
        scale = _get(get, p + "weight_scale", np.float32, (n, G)).T
        zero = None
        if not scheme.symmetric:
            zp = p + "weight_zero_point"
            if zp not in names:
                raise ValueError(f"{zp} is missing: quantization_config says symmetric false (asymmetric "
                                 "int4 needs zero points)")
            zero = unpack_np(_get(get, zp, None, (-(-n // PACK), G)), 0)[:n].T
    perm = _act_order(scheme, get, names, gidx_name, k, g)
    if perm is not None:
        codes = codes[perm]
    if zero is not None and scheme.symmetric and scheme.method == "gptq" and not (zero == SYMMETRIC_ZERO).all():
        raise ValueError(f"{p}qzeros: quantization_config.sym is true but the stored zero points are not 8")
    if zero is not None and (zero == SYMMETRIC_ZERO).all():
        zero = None
    if G == 1 and stored_group(scheme, k) != k:             # per channel: repeat into tile-sized groups
        reps = k // stored_group(scheme, k)
        scale = np.repeat(scale, reps, 0)
        zero = None if zero is None else np.repeat(zero, reps, 0)
    return np.ascontiguousarray(codes), np.ascontiguousarray(scale), zero, perm


def _act_order(scheme: Int4Scheme, get, names, gidx_name: str, k: int, g: int) -> np.ndarray | None:
    """The permutation that makes each group's rows contiguous (None when they already are), from
    the checkpoint's g_idx; ValueError when g_idx contradicts the config or the group size."""
    trivial = np.arange(k) // g
    if gidx_name not in names:
        if scheme.act_order:
            raise ValueError(f"{gidx_name} is missing: act-order (desc_act / actorder) needs each input "
                             "row's group index")
        return None
    gidx = _get(get, gidx_name, np.int64, (k,))
    if not scheme.act_order:
        if not np.array_equal(gidx, trivial):
            raise ValueError(f"{gidx_name} does not match quantization_config: desc_act is false, so input "
                             f"row i must be in group i // {g}")
        return None
    perm = np.argsort(gidx, kind="stable")
    if not np.array_equal(gidx[perm], trivial):
        raise ValueError(f"{gidx_name} does not match group_size {g}: every one of the {k // g} groups must "
                         f"hold exactly {g} input rows")
    return None if np.array_equal(perm, np.arange(k)) else perm.astype(np.int32)


def dequantize_np(codes, scale, zero, group_size: int) -> np.ndarray:
    """f32 [in, out] (storage order) from codes, group scales and zeros (host; for an int4 lm_head)."""
    z = SYMMETRIC_ZERO if zero is None else np.repeat(zero.astype(np.int16), group_size, 0)
    return (codes.astype(np.int16) - z).astype(np.float32) * np.repeat(scale, group_size, 0)


def stack_int4(scheme: Int4Scheme, get, names, layer_names: list[str], k: int, n: int, data_sharding: NamedSharding,
               lead: tuple[int, ...] | None = None, kernel: str = "auto"):
    """Per-layer int4 tensors -> one stacked Int4Weight [L, in, out] (`lead`: the stacked axes the
    names fill in order, [L, X] for experts), placed as `data_sharding` ([..., in, out]) says:
    codes, scales and zeros split along the output (column-parallel) or along whole groups of
    the input (row-parallel), the permutation replicated. `kernel` "pallas" (one device, not
    experts): re-laid out for the Mosaic GPU kernel, an `Int4KernelWeight` (layers/int4_kernel.py)."""
    from jaxserve.layers.int4_kernel import resolve_int4_kernel, to_kernel
    pallas = resolve_int4_kernel(kernel, num_devices=data_sharding.mesh.size) == "pallas"
    lead = tuple(lead or (len(layer_names),))
    parts = [read_int4(scheme, get, names, name, k, n) for name in layer_names]
    g = stored_group(scheme, k)
    perms = [pt[3] for pt in parts]
    zeros = [pt[2] for pt in parts]

    def stacked(xs):
        return np.stack(xs).reshape(*lead, *xs[0].shape)

    spec, shards = split_of(data_sharding, len(lead) + 2)
    mesh = data_sharding.mesh
    check_groups(k, g, shards, what=layer_names[0])
    if len(lead) > 1:
        # experts run inside `sharding.plan.shard_experts`'s shard_map: the kernel sees each
        # device's own rows (one shard), and a global act-order permutation cannot be cut there
        if shards > 1 and any(pm is not None for pm in perms):
            raise ValueError(f"{layer_names[0]}: act-order (g_idx) int4 experts cannot be split along their "
                             f"input over {shards} devices; use a smaller tensor_parallel_size or "
                             "--enable-expert-parallel")
        shards = 1
    out_shards = 1 if len(lead) > 1 else out_split_of(data_sharding, len(lead) + 2)
    q = pack_np(stacked([pt[0] for pt in parts]), -2)
    zero = None
    if any(z is not None for z in zeros):
        zero = stacked([np.full((k // g, n), SYMMETRIC_ZERO, np.uint8) if z is None else z.astype(np.uint8)
                        for z in zeros])
    perm = None
    if any(pm is not None for pm in perms):
        perm = stacked([np.arange(k, dtype=np.int32) if pm is None else pm for pm in perms])
    place = NamedSharding(mesh, PartitionSpec(*spec))   # codes [.., in/8, out] and groups [.., in/g, out] alike
    rep = NamedSharding(mesh, PartitionSpec(*spec[:-2], None))
    w = Int4Weight(jax.device_put(q, place), jax.device_put(stacked([pt[1] for pt in parts]), place),
                   None if zero is None else jax.device_put(zero, place),
                   None if perm is None else jax.device_put(perm, rep), group_size=g, in_shards=shards,
                   out_shards=out_shards)
    return to_kernel(w) if pallas and len(lead) == 1 else w


def abstract_int4(scheme: Int4Scheme, k: int, n: int, data_sharding: NamedSharding, lead: tuple[int, ...],
                  what: str = "weight") -> Int4Weight:
    """What `stack_int4` makes of a checkpoint in `scheme`, as `jax.ShapeDtypeStruct`s with the same
    shardings and split counts: compiling a config-only int4 model ahead of time (`jaxserve.aot`).
    Zero points are assumed stored (asymmetric schemes) and act order present where the scheme says."""
    g = stored_group(scheme, k)
    spec, shards = split_of(data_sharding, len(lead) + 2)
    check_groups(k, g, shards, what=what)
    out_shards = 1 if len(lead) > 1 else out_split_of(data_sharding, len(lead) + 2)
    shards = 1 if len(lead) > 1 else shards
    place = NamedSharding(data_sharding.mesh, PartitionSpec(*spec))
    rep = NamedSharding(data_sharding.mesh, PartitionSpec(*spec[:-2], None))

    def sds(shape, dtype, sharding):
        return jax.ShapeDtypeStruct(tuple(lead) + shape, np.dtype(dtype), sharding=sharding)
    return Int4Weight(sds((k // PACK, n), np.int32, place), sds((k // g, n), np.float32, place),
                      None if scheme.symmetric else sds((k // g, n), np.uint8, place),
                      sds((k,), np.int32, rep) if scheme.act_order else None,
                      group_size=g, in_shards=shards, out_shards=out_shards)


def split_of(data_sharding: NamedSharding, ndim: int) -> tuple[tuple, int]:
    """The full PartitionSpec of an [..., in, out] array of `ndim` axes placed as `data_sharding`,
    and over how many devices its input rows split (row-parallel: the kernel's `in_shards`)."""
    spec = tuple(data_sharding.spec) + (None,) * (ndim - len(data_sharding.spec))
    return spec, _devices_along(data_sharding, spec[-2])


def out_split_of(data_sharding: NamedSharding, ndim: int) -> int:
    """Over how many devices an [..., in, out] array's output columns split (the kernel's `out_shards`)."""
    spec = tuple(data_sharding.spec) + (None,) * (ndim - len(data_sharding.spec))
    return _devices_along(data_sharding, spec[-1])


def _devices_along(data_sharding: NamedSharding, axis) -> int:
    if axis is None:
        return 1
    return int(np.prod([data_sharding.mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis)]))


def read_dense(scheme: Int4Scheme, get, names, weight_name: str, k: int, n: int) -> np.ndarray:
    """An int4 matrix that is not stacked (a quantised lm_head) dequantised: f32 [in, out]."""
    codes, scale, zero, perm = read_int4(scheme, get, names, weight_name, k, n)
    w = dequantize_np(codes, scale, zero, stored_group(scheme, k))
    if perm is not None:
        w = w[np.argsort(perm)]
    return w


def method_of(quantization: str | None) -> str | None:
    """A `--quantization` value -> the int4 checkpoint method it names, None for others."""
    q = ALIASES.get(quantization, quantization)
    return q if q in METHODS else None
