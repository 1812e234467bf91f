"""Model loading: a Hugging Face directory (config.json + safetensors) or a single GGUF file
-> (ModelConfig, Weights). Never needs torch.

Both sources are read through a `get(hf_name) -> np.ndarray` function that returns tensors in
the Hugging Face layout (`[out, in]` for matrices); `assemble` walks the model's weight
declaration (`declare(cfg)` in its family file) and builds the stacked `[in, out]` pytree in
the requested dtype, each array placed with its sharding. `--load-format dummy` is
`loader/dummy.py`.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.host_memory import release_freed_host_memory
from jaxserve.layers import int4_cpu
from jaxserve.layers.int4 import BF16_MIN_ROWS, Int4Weight, with_bf16_tiles, with_fused_kernel, with_q8_rows
from jaxserve.layers.int4_layout import with_cpu_layout
from jaxserve.layers.layer_mix import LayerMixWeight
from jaxserve.layers.linear import DenseWeight
from jaxserve.loader.hf_overrides import apply_hf_overrides
from jaxserve.models.registry import get_model
from jaxserve.sharding.mesh import make_mesh
from jaxserve.sharding.plan import plan_for

logger = logging.getLogger(__name__)

class ModelLoadError(ValueError):
    """The model files are missing, unreadable or describe something jaxserve cannot run."""


def resolve_dtype(dtype: str, platform: str | None = None):
    """"auto" is float32 on CPU (bf16 matmuls are slow there) and bfloat16 on accelerators."""
    if dtype == "auto":
        platform = platform or jax.default_backend()
        return jnp.float32 if platform == "cpu" else jnp.bfloat16
    try:
        return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[dtype]
    except KeyError:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}") from None


def bf16_tiles_pay() -> bool:
    """Whether XLA:CPU's bf16 tiles beat f32 ones here: where the CPU multiplies bf16 itself
    (AVX512-BF16 or AMX-BF16: prefill of 64 prompts 1.44x on a Zen 4), not on an x86 CPU without
    (a Zen 3 with AVX2 only: 0.77x, batch 64 1.00x; benchmarks/RESULTS.md). Unknown flags (not x86
    Linux): bf16 tiles. JAXSERVE_CPU_BF16_TILES=1 or 0 decides instead."""
    forced = os.environ.get("JAXSERVE_CPU_BF16_TILES")
    if forced in ("0", "1"):
        return forced == "1"
    return int4_cpu.native_bf16() is not False


BATCH_INVARIANT_ROWS = 1 << 30        # `fused_max_rows` of a batch-invariant engine: every step


def _batch_invariant(weights, dtype: str, devices: int, platform: str | None, quantized: bool):
    """`cpu_matmuls_for(batch_invariant=True)`: the fused kernel at every row count, or why not."""
    why = None
    if (platform or jax.default_backend()) != "cpu":
        why = f"the CPU (its matmuls are chosen by row count there), not {platform or jax.default_backend()}"
    elif resolve_dtype(dtype, platform) != jnp.float32:
        why = f"f32 activations on the CPU (dtype auto or float32), got dtype {dtype!r}"
    elif not quantized:
        why = ("quantized linear layers (a GGUF kept quantized, GPTQ/AWQ/compressed-tensors int4): this "
               "model's are dense, and XLA's dot sums a row in an order that depends on the batch")
    elif devices != 1:
        why = f"one device (the fused kernel does not split over devices), got {devices}"
    elif int4_cpu.load() is not None:
        why = f"the fused CPU kernel, which did not build here: {int4_cpu.load()}"
    if why is not None:
        raise ValueError(f"batch_invariant needs {why}")
    logger.info("batch-invariant: quantized matmuls of every row count use the fused CPU kernel")
    return with_cpu_layout(with_fused_kernel(weights, max_rows=BATCH_INVARIANT_ROWS,
                                             int8_x=int4_cpu.int8_dot() is not None))


# `--q8-activations` unset: on for a GGUF model of this many parameters or more (its prefill and large
# batches are int8 compute, 1.3-2x faster so; below, the default model keeps two int8 parts or bf16)
Q8_AUTO_PARAMS = 10**9


def parameter_count(weights) -> int:
    """The model's parameters: every matrix's and vector's logical elements (quantized or not)."""
    kept = (Int4Weight, LayerMixWeight, DenseWeight)
    leaves = jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, kept))
    return sum(math.prod(x.shape) for x in leaves if hasattr(x, "shape"))


def cpu_matmuls_for(weights, dtype: str, devices: int = 1, platform: str | None = None,
                    batch_invariant: bool = False, q8: bool | None = False, donate: bool = False,
                    w4a16: bool = False):
    """`weights` as the engine runs them with `--dtype dtype` on `devices` devices: with "auto" on
    CPU (f32 activations), quantized weights take batches of `BF16_MIN_ROWS` rows or more through
    bf16 tiles where they pay (`bf16_tiles_pay`; `layers.int4.with_bf16_tiles`) and, on
    one device, steps of at most `int4_cpu.FUSED_MAX_ROWS` rows through the fused CPU kernel
    (`layers.int4.with_fused_kernel`) when it builds here, the weights laid out for it
    (`layers.int4_layout.with_cpu_layout`: column blocks, f16 scales where exact), and where the
    CPU has Intel AMX (`int4_cpu.amx()`) the bf16 tiles' steps (past the fused kernel's rows, up to
    `int4_cpu.AMX_MAX_ROWS`) through the AMX kernel instead (the same bf16 arithmetic, 3-5x faster
    on this model's matrices at 32-64 rows). An explicit
    "float32" keeps f32 tiles at every row count (close across batch sizes, 1e-5 on the default
    model, yet not bit for bit: XLA's dot blocks by rows).
    `batch_invariant`: every quantized matmul takes the fused kernel (its rows are independent) at
    every row count; a ValueError says why where that cannot be (a GPU, dense weights, several
    devices, activations not f32, no kernel build).
    `q8` (`--q8-activations`, a GGUF file's weights): every matmul takes the fused kernel, its
    activations as one int8 part a block as llama.cpp computes them (`layers.int4.with_q8_rows`
    from one row: a row's result then does not depend on its step's size, prefill or decode),
    not two parts to 16 rows and XLA's bf16 tiles above; None: so for models of `Q8_AUTO_PARAMS`
    parameters or more. `donate`: `weights`' arrays may be deleted
    as they are laid out anew (the engine's load: the model is never held twice).
    `w4a16`: the quantized weights are a checkpoint's made for W4A16 (AWQ, GPTQ, compressed-tensors
    int4), computed as their dequantized weights: f32 activations in the fused kernel and f32
    tiles above its rows (no int8 parts, no bf16 tiles, no AMX), unless `q8` asks for int8 ones."""
    quantized = any(isinstance(w, Int4Weight) for w in jax.tree.leaves(
        weights, is_leaf=lambda x: isinstance(x, Int4Weight)))
    explicit_q8 = q8 is not None
    if q8 is None:
        q8 = parameter_count(weights) >= Q8_AUTO_PARAMS
    if batch_invariant:
        return _batch_invariant(weights, dtype, devices, platform, quantized)
    if dtype != "auto" or resolve_dtype(dtype, platform) != jnp.float32:     # f32 activations: CPU
        return weights
    exact = w4a16 and not q8
    if exact and quantized:
        logger.info("int4 checkpoint (W4A16): quantized matmuls take f32 activations, as its dequantized "
                    "weights compute (--q8-activations: int8 ones)")
    if not exact and bf16_tiles_pay():
        weights = with_bf16_tiles(weights)
    elif quantized and not exact:
        logger.info("quantized matmuls of many rows keep f32 tiles: this CPU has no bf16 multiplies "
                    "(JAXSERVE_CPU_BF16_TILES=1 takes bf16 tiles)")
    if devices == 1 and quantized:
        why = int4_cpu.load()
        if why is None:
            dot = None if exact else int4_cpu.int8_dot()
            logger.info("quantized matmuls of up to %d rows use the fused CPU kernel%s", int4_cpu.FUSED_MAX_ROWS,
                        f", int4 ones with int8 activations ({dot})" if dot else
                        " (f32 activations)" if exact else
                        " (f32 activations: this build has no integer dot product)")
            # AMX where the bf16 tiles ran (past the fused kernel's rows): the same numbers
            amx = (max(BF16_MIN_ROWS, int4_cpu.FUSED_MAX_ROWS + 1) if int4_cpu.amx() and bf16_tiles_pay()
                   and not exact else None)
            if amx:
                logger.info("quantized matmuls of %d to %d rows use the AMX kernel (the bf16 tiles' arithmetic)",
                            amx, int4_cpu.AMX_MAX_ROWS)
            # 8-bit codes four a word where VNNI multiplies them (AVX2's pair sums would saturate)
            weights = with_cpu_layout(with_fused_kernel(weights, int8_x=dot is not None, amx_min_rows=amx),
                                      donate=donate, k4=dot == "AVX512-VNNI")
            if q8 and dot is not None and not amx:
                logger.info("--q8-activations%s: every quantized matmul takes the fused CPU kernel with int8 "
                            "activations, one part a block, as llama.cpp computes them (each row's result "
                            "independent of its step's size)",
                            "" if explicit_q8 else " (a GGUF model of 1B parameters or more)")
                weights = with_q8_rows(weights, min_rows=1)
            elif q8 and explicit_q8:
                logger.warning("--q8-activations needs the fused CPU kernel with integer dot products and no "
                               "AMX kernel (int8_dot: %s, amx: %s): not applied", dot, bool(amx))
            return weights
        logger.info("quantized matmuls of few rows use XLA's tiles, not the fused CPU kernel: %s", why)
    return weights


def assemble(cfg: ModelConfig, get: Callable[[str], np.ndarray], dtype, mesh=None, *,
             quantization: str | None = None, fp8_scheme=None, expert_parallel: bool = False,
             int4_scheme=None, fp8_activations: str = "auto"):
    """Read every declared array through `get` (Hugging Face names and layouts), stack the
    per-layer ones, cast to `dtype` and place each with the sharding its logical axes get on
    `mesh` (default: one device). Returns the model's weights pytree.

    Arrays are built shard by shard (`jax.make_array_from_callback`): each device's slice is
    cut from the per-layer checkpoint tensors and only that slice travels to the device; the
    stacked, cast array is never assembled whole on the host. The per-layer tensors of the
    array being placed are read once and kept until its last shard is cut (GGUF dequantizes
    whole tensors, so reading them once per device made TP 8 loads 7x slower).

    Linear layers and experts become `Fp8Weight`s (jaxserve/loader/fp8.py) when `fp8_scheme`
    (an FP8 checkpoint's format) finds their scales, or when `quantization="fp8"` quantises them
    here; an e4m3 tensor without scales is an error, never cast as it is. `int4_scheme` (a GPTQ,
    AWQ or compressed-tensors int4 checkpoint's format) makes them `Int4Weight`s
    (jaxserve/loader/int4.py)."""
    model = get_model(cfg.architecture)
    mesh = mesh if mesh is not None else make_mesh()
    plan = plan_for(cfg, mesh, expert_parallel)
    np_dtype = np.dtype(jnp.dtype(dtype))
    names = getattr(get, "names", ())
    if fp8_scheme is not None or quantization == "fp8":
        from jaxserve.loader import fp8
    served = None if fp8_scheme is None else fp8.served_activations(fp8_scheme, mesh.devices.flat[0], fp8_activations)
    if served is not None and served != fp8_scheme.activations:
        logger.info("FP8 checkpoint with %s activations (W8A8) served as W8A16 (activations left in %s): "
                    "this device has no FP8 tensor cores, where vLLM too runs weights-only FP8; "
                    "--fp8-activations w8a8 forces W8A8", fp8_scheme.activations, np_dtype.name)
    if int4_scheme is not None:
        from jaxserve.loader import int4

    quantized = getattr(get, "quantized", None)   # a GGUF file's blocks, kept (loader/gguf_quant.py)
    reads: dict[str, np.ndarray] = {}     # this array's checkpoint tensors, by name

    def tensor(name: str, shape: tuple[int, ...], transpose: bool, rows=None) -> np.ndarray:
        if name not in reads:
            reads[name] = get(name)
        x = reads[name]
        if x.dtype.name == "float8_e4m3fn" and fp8_scheme is not None and fp8.has_fp8(fp8_scheme, names, name):
            # an FP8 tensor of an array that is no matmul operand (MLA's kv_b, absorbed into q and
            # the output): dequantised to the model dtype, once
            x = reads[name] = _dequantized_fp8(fp8_scheme, get, name, x.shape)
        if x.dtype.name == "float8_e4m3fn":   # casting the codes would drop their scales silently
            raise ModelLoadError(f"tensor {name} is FP8 (F8_E4M3) but no scale for it was found "
                                 f"(quantization_config: {'none' if fp8_scheme is None else fp8_scheme.method})")
        if rows is not None:                  # this array's part of a fused tensor (Phi-3's qkv_proj)
            axis = 0 if transpose else x.ndim - 1     # the `out` axis (Param.rows)
            if x.shape[axis] < rows[1]:
                raise ModelLoadError(f"tensor {name} has {x.shape[axis]} rows, expected at least {rows[1]} "
                                     "from the model config")
            x = x[(slice(None),) * axis + (slice(*rows),)]
        x = x.T if transpose else x
        if x.shape != shape:
            raise ModelLoadError(f"tensor {name} has shape {tuple(x.shape)}, expected {shape} "
                                 "from the model config")
        return x

    def shard(p, index: tuple[slice, ...]) -> np.ndarray:
        dt = np.dtype(p.dtype) if p.dtype else np_dtype
        if not p.stacked:
            return np.ascontiguousarray(tensor(p.checkpoint, p.shape, p.transpose, p.rows)[index], dtype=dt)
        # stacked axes (layer, and expert for per-expert tensors): one checkpoint tensor each
        n = p.stacked_dims
        picks = [range(p.shape[d])[index[d]] for d in range(n)]
        inner = p.shape[n:]
        x = None
        for pos in itertools.product(*(range(len(r)) for r in picks)):
            ids = [r[j] for r, j in zip(picks, pos)]
            part = tensor(p.checkpoint_name(*ids), inner, p.transpose, p.rows)[index[n:]]
            if x is None:
                x = np.empty(tuple(len(r) for r in picks) + part.shape, dt)
            x[pos] = part
        return x

    arrays = {}
    for p in model.declare(cfg):
        sharding = plan.sharding(p.axes)
        checkpoint_names = [name for _, name in p.checkpoint_names()]
        kept = _kept_gguf(p, plan, quantized, checkpoint_names) if quantized is not None else None
        if kept is not None:
            arrays[p.path] = kept
        elif p.dense and int4_scheme is not None and int4.has_int4(int4_scheme, names, checkpoint_names[0]):
            k, n = p.shape[-2:]
            try:
                if p.stacked:
                    arrays[p.path] = int4.stack_int4(int4_scheme, get, names, checkpoint_names, k, n, sharding,
                                                     lead=p.shape[:p.stacked_dims])
                    continue
                x = int4.read_dense(int4_scheme, get, names, p.checkpoint, k, n).astype(np_dtype)
            except ValueError as e:
                raise ModelLoadError(f"{int4_scheme.method} int4 checkpoint: {e}") from None
            arrays[p.path] = jax.device_put(x, sharding)
        elif p.dense and fp8_scheme is not None and fp8.has_fp8(fp8_scheme, names, checkpoint_names[0]):
            k, n = p.shape[-2:]
            try:
                if p.stacked:     # [L, in, out], or experts [L, X, in, out]
                    arrays[p.path] = fp8.stack_fp8(fp8_scheme, get, checkpoint_names, k, n, sharding,
                                                   lead=p.shape[:p.stacked_dims], activations=served)
                    continue
                # an unstacked FP8 matrix (a quantised lm_head): dequantised to the model dtype
                w, s, _ = fp8.read_fp8(fp8_scheme, get, p.checkpoint, k, n)
                from jaxserve.pallas.fp8_matmul import dequantize
                x = np.asarray(dequantize(w, s, jnp.float32, fp8_scheme.block_size)).astype(np_dtype)
            except ValueError as e:
                raise ModelLoadError(f"FP8 checkpoint: {e}") from None
            arrays[p.path] = jax.device_put(x, sharding)
        else:
            done: dict[tuple, np.ndarray] = {}

            def cb(index, p=p, done=done):
                key = tuple((s.start, s.stop) for s in index)
                if key not in done:
                    done[key] = shard(p, index)
                return done[key]

            arrays[p.path] = jax.make_array_from_callback(p.shape, sharding, cb)
            reads.clear()
        if p.dense and quantization == "fp8" and p.path not in fp8.SKIP_ON_THE_FLY:
            arrays[p.path] = fp8.quantize_array(arrays[p.path])   # the full-precision copy is dropped
    return model.build(cfg, arrays)


def _dequantized_fp8(scheme, get, name: str, shape: tuple[int, int]) -> np.ndarray:
    """An FP8 checkpoint matrix [out, in] with its scales -> f32 [out, in]."""
    from jaxserve.loader import fp8
    from jaxserve.pallas.fp8_matmul import dequantize
    try:
        w, s, _ = fp8.read_fp8(scheme, get, name, shape[1], shape[0])       # [in, out]
    except ValueError as e:
        raise ModelLoadError(f"FP8 checkpoint: {e}") from None
    return np.asarray(dequantize(w, s, jnp.float32, scheme.block_size)).T


def _kept_gguf(p, plan, quantized, names: list[str]):
    """`gguf_quant.kept_array` (the declared array's GGUF tensors kept quantized, or None), its
    errors as load errors naming the tensor."""
    from jaxserve.loader import gguf_quant
    try:
        return gguf_quant.kept_array(p, plan.sharding, quantized, names)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None


def load_hf_config(path: Path, hf_overrides: dict | None = None) -> ModelConfig:
    """`path`/config.json with `hf_overrides` (loader/hf_overrides.py) merged in."""
    hf = apply_hf_overrides(_hf_json(path), hf_overrides)
    try:
        cfg = ModelConfig.from_hf(hf)
    except ValueError as e:   # unsupported architecture, missing or out-of-range field
        raise ModelLoadError(f"{path / 'config.json'}: {e}") from None
    if hf.get("vision_config") is not None:     # Gemma3ForConditionalGeneration
        logger.warning("%s: %s has a vision tower (vision_config); jaxserve serves its text model only, "
                       "the vision tower and multimodal projector weights are not loaded (no image inputs)",
                       path, cfg.architecture)
    return cfg


def _hf_json(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} has no config.json; expected a Hugging Face model directory "
                             "(config.json + *.safetensors) or a .gguf file")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_file} is not valid JSON: {e}") from None


def fp8_scheme_of(path: Path):
    """The quantised format of a Hugging Face directory's checkpoint: an FP8 scheme (loader/fp8.py),
    an int4 one (loader/int4.py), or None."""
    hf = _hf_json(path)
    from jaxserve.loader import mxfp4
    if not hf.get("quantization_config") or mxfp4.is_mxfp4(hf):     # MXFP4: dequantized as read
        return None
    from jaxserve.loader import int4
    from jaxserve.loader.fp8 import scheme_of
    try:
        return int4.scheme_of(hf) if int4.is_int4(hf) else scheme_of(hf)
    except ValueError as e:
        raise ModelLoadError(f"{path / 'config.json'}: {e}") from None


def _safetensors_getter(path: Path) -> Callable[[str], np.ndarray]:
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        weight_map = None
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files")
    handles, where = {}, {}
    for name in files:
        f = path / name
        if not f.is_file():
            raise ModelLoadError(f"{f} is listed in the safetensors index but does not exist")
        try:
            handles[name] = safe_open(str(f), framework="numpy")
        except Exception as e:  # safetensors raises its own SafetensorError / OSError types
            raise ModelLoadError(f"cannot read {f}: corrupt or not a safetensors file ({e})") from None
        for key in handles[name].keys():
            where[key] = name
    if weight_map is not None:
        where.update({k: v for k, v in weight_map.items() if v in handles})

    def get(name: str) -> np.ndarray:
        if name not in where:
            raise ModelLoadError(f"tensor {name} is missing from the safetensors files in {path}")
        try:
            if handles[where[name]].get_slice(name).get_dtype() == "F8_E4M3":
                return _read_f8_e4m3(path / where[name], name)   # numpy has no fp8 for safetensors
            return handles[where[name]].get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"cannot read tensor {name} from {path / where[name]}: "
                                 f"corrupt safetensors file ({e})") from None
    get.names = frozenset(where)
    return get


def _read_f8_e4m3(file: Path, name: str) -> np.ndarray:
    """One F8_E4M3 tensor of a safetensors file as ml_dtypes.float8_e4m3fn, read from the
    format's JSON header (8-byte length, header, then the raw data)."""
    import ml_dtypes
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(n))[name]
        start, end = info["data_offsets"]
        f.seek(8 + n + start)
        data = f.read(end - start)
    return np.frombuffer(data, ml_dtypes.float8_e4m3fn).reshape(info["shape"])


def _fp8_note(scheme, quantization: str | None) -> str:
    """What the load line adds when the linear layers are (or become) FP8."""
    if scheme is not None:
        kind = "int4" if type(scheme).__name__ == "Int4Scheme" else "fp8"
        return f", linear layers {kind} ({scheme.method} checkpoint)"
    if quantization == "gguf":
        return ", quantized tensors kept quantized (--quantization none reads them into the dtype)"
    return ", linear layers quantised to fp8 (per-channel e4m3)" if quantization == "fp8" else ""


def load_model(model: str | os.PathLike, dtype="auto", gguf_reader=None, *, mesh=None,
               load_format: str = "auto", seed: int = 0, quantization: str | None = None,
               expert_parallel: bool = False, hf_overrides: dict | None = None, fp8_activations: str = "auto"):
    """Load a Hugging Face directory or a .gguf file -> (ModelConfig, weights). `dtype` is a name
    or a jnp dtype; `gguf_reader` an already open reader of the file (parsing a GGUF header
    takes seconds); `load_format="dummy"` reads only `config.json` and makes seeded random
    weights of its shapes. `quantization="fp8"` stores the linear layers (not lm_head) in e4m3
    with per-channel scales; FP8 checkpoints are detected from config.json either way, and so are
    int4 ones (GPTQ, AWQ, compressed-tensors), which `quantization` "gptq", "awq",
    "compressed-tensors" (or vLLM's *_marlin names) may name.
    `expert_parallel`: mixture-of-experts weights are placed whole-expert per device
    (`sharding.plan.plan_for`). `hf_overrides`: merged into config.json (vLLM's --hf-overrides)."""
    path = Path(model)
    if not path.exists():
        raise ModelLoadError(_not_a_local_path(str(model)))
    if hf_overrides and path.is_file():
        raise ModelLoadError(f"hf_overrides (or rope_scaling) {sorted(hf_overrides)} merge into a Hugging Face "
                             f"config.json, but {path} is a GGUF file")
    jdtype = resolve_dtype(dtype) if isinstance(dtype, str) else dtype
    if load_format == "dummy":
        from jaxserve.loader.dummy import dummy_weights
        from jaxserve.loader.int4 import method_of
        if method_of(quantization) or quantization == "gguf":
            raise ModelLoadError(f"quantization {quantization!r} reads a checkpoint's int4 weights; "
                                 "--load-format dummy makes full-precision random weights (use fp8 or none)")
        cfg = gguf_config_of(path, gguf_reader) if path.is_file() else load_hf_config(path, hf_overrides)
        logger.info("dummy weights (seed %d) for %s (%s, %d layers, hidden %d) as %s%s", seed,
                    path, cfg.architecture, cfg.num_layers, cfg.hidden_size,
                    jnp.dtype(jdtype).name, _fp8_note(None, quantization))
        weights = dummy_weights(cfg, jdtype, mesh, seed, expert_parallel)
        if quantization == "fp8":
            from jaxserve.loader.fp8 import quantize_weights
            weights = quantize_weights(weights)
        return cfg, weights
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf file")
        from jaxserve.loader import gguf as gguf_loader
        _check_quantization_flag(quantization, None, path)
        cfg, get = gguf_loader.open_gguf(path, gguf_reader, keep_quantized=quantization == "gguf")
        scheme = None
    else:
        cfg = load_hf_config(path, hf_overrides)
        scheme = fp8_scheme_of(path)
        _check_quantization_flag(quantization, scheme, path)
        get = _safetensors_getter(path)
        from jaxserve.loader import mxfp4
        if mxfp4.is_mxfp4(_hf_json(path)):     # gpt-oss: MXFP4 experts, dequantized to the model dtype
            get = mxfp4.dequantizing_getter(get)
            logger.info("%s: MXFP4 expert weights are dequantized to %s at load", path, jnp.dtype(jdtype).name)
    logger.info("loading %s (%s, %d layers, hidden %d) as %s%s", path, cfg.architecture,
                cfg.num_layers, cfg.hidden_size, jnp.dtype(jdtype).name, _fp8_note(scheme, quantization))
    int4_scheme = scheme if type(scheme).__name__ == "Int4Scheme" else None
    weights = assemble(cfg, get, jdtype, mesh, quantization=None if scheme else quantization,
                       fp8_scheme=None if int4_scheme else scheme, expert_parallel=expert_parallel,
                       int4_scheme=int4_scheme, fp8_activations=fp8_activations)
    del get
    release_freed_host_memory()       # the per-layer host tensors
    return cfg, weights


def _check_quantization_flag(quantization: str | None, scheme, path: Path) -> None:
    """`--quantization awq|gptq|compressed-tensors` (vLLM's names, and their *_marlin aliases)
    names the checkpoint's own int4 method: detected from config.json anyway, so the flag only
    has to agree with it (and `fp8` is refused on an int4 checkpoint)."""
    from jaxserve.loader.int4 import Int4Scheme, method_of
    method = method_of(quantization)
    found = getattr(scheme, "method", None)
    if quantization == "gguf" and not path.is_file():
        raise ModelLoadError(f"quantization 'gguf' keeps a .gguf file's quantized tensors quantized, "
                             f"but {path} is a Hugging Face directory")
    if quantization == "fp8" and isinstance(scheme, Int4Scheme):
        raise ModelLoadError(f"quantization 'fp8' quantises a full-precision checkpoint, but "
                             f"{path / 'config.json'} describes a {found} int4 checkpoint")
    if method is None:
        return
    if found != method:
        where = f"{path} is a GGUF file" if path.is_file() else \
            f"{path / 'config.json'} has quantization_config.quant_method {found!r}"
        raise ModelLoadError(f"quantization {quantization!r} names a {method} checkpoint, but {where}")


def _not_a_local_path(name: str) -> str:
    parts = name.split("/")
    if len(parts) == 2 and all(parts) and not name.startswith((".", "~")):
        return (f"{name!r} is not a local path. It looks like a Hugging Face Hub model name: "
                "load_model reads local paths only; LLM, `jaxserve serve` and run-batch download "
                "Hub names (jaxserve.loader.hub.resolve_model gives the local path)")
    return (f"model path {name!r} does not exist (load_model reads local Hugging Face directories "
            "and .gguf files)")


def gguf_config_of(path: Path, reader=None) -> ModelConfig:
    if path.suffix != ".gguf":
        raise ModelLoadError(f"{path} is a file but not a .gguf file")
    from jaxserve.loader import gguf as gguf_loader
    return gguf_loader.open_gguf(path, reader)[0]
