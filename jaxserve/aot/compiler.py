"""`jaxserve compile`: the engine's step programs compiled for a target, on any machine.

The programs come from the engine's own `ModelRunner` (its jitted step, its token buckets, its
`_compile`), built in abstract mode: weights, KV pool, penalty state and inputs are
`jax.ShapeDtypeStruct`s with the sharding plan's shardings on the target's devices (compile-only
H100/H200 devices, or this CPU), and lowering runs under the target's abstract mesh so every
kernel takes its compiled form for the target. No weights are read for a GPU target (MODEL may be
a config directory alone, `--load-format dummy` semantics); for `--target cpu` the engine's own
loader runs, so the programs fit the weight types the engine will hold.

    compile_engine(EngineArgs(model="cfg_dir"), "h100", "out/")   # -> the report (a dict)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from pathlib import Path

import jax

from jaxserve.aot import report as report_lib
from jaxserve.aot.store import ProgramStore, program_key
from jaxserve.aot.targets import Target, client_memory_fraction, get_target
from jaxserve.attention import AttentionCase, cpu_backend, select_backend
from jaxserve.attention import kv_cache as kvc
from jaxserve.attention.backend import Platform, _version
from jaxserve.config import EngineArgs
from jaxserve.default_model import default_model_path
from jaxserve.loader.loader import resolve_dtype
from jaxserve.sharding.mesh import make_mesh
from jaxserve.sharding.plan import plan_for
from jaxserve.worker.model_runner import ModelRunner
from jaxserve.worker.programs import PENALTY_PROGRAM

logger = logging.getLogger(__name__)

# XLA options a compile-only GPU device needs: CUB's radix sort asks a real device for its
# scratch size at compile time (XLA's own sort is used instead: the one way in which these
# programs differ from ones compiled on the GPU, besides autotuning, which a deviceless compile
# skips for the default configurations).
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}
PROBE_BLOCKS = 16                 # the pool of the program compiled to measure temps before sizing


@dataclasses.dataclass
class Setup:
    """What an engine would hold, abstractly: config, dtypes, plan, backend, pool size."""
    cfg: object
    args: EngineArgs
    target: Target
    mesh: object
    plan: object
    weights: object
    dtype: object
    kv_quantize: object
    kv_dtype: object
    backend: str
    bytes_per_block: int
    weight_bytes: int


def _model_config_and_weights(args: EngineArgs, target: Target, mesh, dtype):
    from jaxserve.loader.hub import resolve_model
    from jaxserve.loader.loader import cpu_matmuls_for, gguf_config_of, load_hf_config, load_model
    path = resolve_model(args.model_location(), revision=args.revision, download_dir=args.download_dir,
                         weights=not target.is_gpu) if args.model else str(default_model_path())
    if not target.is_gpu:           # the engine's loader: the weight types it will serve with
        cfg, weights = load_model(path, dtype, mesh=mesh, load_format=args.load_format, seed=args.seed,
                                  quantization=args.load_quantization(path),
                                  expert_parallel=args.enable_expert_parallel,
                                  hf_overrides=args.model_overrides())
        weights = cpu_matmuls_for(weights, args.dtype, mesh.size, batch_invariant=args.batch_invariant)
        return cfg, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), weights)
    from jaxserve.loader.dummy import abstract_weights
    from jaxserve.loader.int4 import is_int4, scheme_of
    from jaxserve.loader.loader import _hf_json
    p = Path(path)
    cfg = gguf_config_of(p) if p.is_file() else load_hf_config(p, args.model_overrides())
    hf = {} if p.is_file() else _hf_json(p)
    int4 = scheme_of(hf) if hf and is_int4(hf) else None
    if hf.get("quantization_config") and int4 is None:
        raise ValueError(f"{path}: quantization_config {hf['quantization_config'].get('quant_method')!r}: an FP8 "
                         "checkpoint's layout is not compiled ahead of time yet (--quantization fp8 on its "
                         "bf16 config is)")
    return cfg, abstract_weights(cfg, dtype, mesh, args.enable_expert_parallel, args.quantization, int4)


def setup(args: EngineArgs, target: Target) -> Setup:
    """The engine's choices for `target`, made by the engine's own functions."""
    from jaxserve.engine.builder import kv_quantization
    spec = args.spec_config()
    if args.enable_lora or spec is not None and spec.method in spec.MODEL_METHODS:
        raise ValueError("jaxserve compile: enable_lora and a draft model's, EAGLE-3 head's or MTP layer's "
                         "programs are not compiled ahead of time yet; serve them without --compiled-dir")
    dtype = resolve_dtype(args.dtype, target.platform)
    mesh = make_mesh(args.tensor_parallel_size, devices=target.devices)
    cfg, weights = _model_config_and_weights(args, target, mesh, dtype)
    if args.cpu_offload_gb:         # as the engine places them (`engine.builder`)
        from jaxserve.layers.host_weights import offload_layer_weights
        weights, _ = offload_layer_weights(weights, args.cpu_offload_gb)
    cfg = dataclasses.replace(cfg, max_model_len=cfg.resolve_max_model_len(args.max_model_len))
    plan = plan_for(cfg, mesh, args.enable_expert_parallel)
    kv_quantize, kv_dtype = kv_quantization(args.kv_cache_dtype, dtype)
    case = AttentionCase.of(cfg, dtype, kv_dtype, args.block_size)
    platform = Platform(target.platform, target.compute_capability, _version(jax.__version__))
    backend = select_backend(args.attention_backend, case, platform=platform)
    if not target.is_gpu:
        backend = cpu_backend(backend, args.attention_backend, args.dtype, mesh.size, case)
    per_block = kvc.bytes_per_block(cfg.num_layers, args.block_size, plan.kv_heads_per_device(cfg.num_kv_heads),
                                    cfg.head_dim, kv_dtype, kv_quantize is not None, latent=cfg.mla is not None)
    weight_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                       for x in jax.tree_util.tree_leaves(weights) if x.sharding.memory_kind != "pinned_host")
    return Setup(cfg, args, target, mesh, plan, weights, dtype, kv_quantize, kv_dtype, backend, per_block,
                 weight_bytes)


def make_runner(s: Setup, num_blocks: int) -> ModelRunner:
    args = s.args
    cache_config = dataclasses.replace(args.cache_config(), num_blocks=num_blocks)
    sched = args.scheduler_config(s.cfg.max_model_len)
    runner = ModelRunner(s.cfg, s.weights, cache_config, sched, dtype=s.dtype, backend=s.backend,
                         max_logprobs=args.max_logprobs, kv_quantize=s.kv_quantize, kv_dtype=s.kv_dtype,
                         plan=s.plan, num_speculative_tokens=sched.num_speculative_tokens, abstract=True)
    runner.lower_context = lambda: s.target.context(s.mesh)
    if s.target.is_gpu:
        runner.compiler_options = {**(runner.compiler_options or {}), **GPU_COMPILER_OPTIONS}
    return runner


def num_blocks_for(s: Setup) -> tuple[int, dict]:
    """The pool the engine would size on the target: on a GPU target jax's share of the device
    memory (`client_memory_fraction`) x gpu_memory_utilization, less the weights, the penalty state
    and the largest program's temps (compiled once with a probe pool: what the engine's profile
    run measures); on the CPU the engine's own rule."""
    from jaxserve.worker.kv_sizing import num_kv_blocks
    args = s.args
    if not s.target.is_gpu or args.num_gpu_blocks_override or args.kv_cache_memory_bytes:
        host_copies = s.mesh.size if not s.target.is_gpu else 1
        return num_kv_blocks(args, s.bytes_per_block * host_copies, s.weight_bytes, stats={}), {}
    probe = make_runner(s, PROBE_BLOCKS)
    resident = temps = 0    # arguments but the pool (weights, penalty state, inputs); the largest temps
    for key in [(probe.buckets[-1], False), (probe._variant_bucket(probe.buckets[-1], True), True)]:
        m = probe._compile(key).memory_analysis()
        resident = max(resident, m.argument_size_in_bytes - PROBE_BLOCKS * s.bytes_per_block)
        temps = max(temps, m.temp_size_in_bytes)
    limit = int(s.target.memory_bytes * client_memory_fraction())     # the engine's bytes_limit there
    budget = int(limit * args.gpu_memory_utilization) - resident - temps
    blocks = budget // s.bytes_per_block
    if blocks < 1:
        raise ValueError(f"target {s.target.name}: no memory left for the KV cache: {limit} bytes (jax's share "
                         f"of {s.target.memory_bytes}) x {args.gpu_memory_utilization} - weights and state "
                         f"{resident} - temps {temps} (more devices: --tensor-parallel-size)")
    return int(blocks), {"device_bytes": s.target.memory_bytes, "bytes_limit": limit, "weights": s.weight_bytes,
                         "resident_without_pool": resident, "temps": temps, "kv_budget": budget}


def compile_engine(args: EngineArgs, target: str | Target, out_dir: str | os.PathLike, *,
                   programs: str = "all", hlo: bool = True, kernels: bool = False) -> dict:
    """Compile the engine's step programs for `target` into `out_dir` (serialized executables, HLO,
    report.json/md) and return the report. programs: "all" (every token bucket, with and without
    prompt logprobs, as the engine's warm-up builds them) or "ci" (the smallest and largest decode
    bucket and the largest bucket). kernels: also compile every shipped GPU kernel configuration
    alone and report its registers, spills and shared memory (`jaxserve.aot.kernels`)."""
    t0 = time.perf_counter()
    if args.batch_invariant and (target != "cpu" if isinstance(target, str) else target.is_gpu):
        raise ValueError("batch_invariant is implemented on the CPU only (its matmuls are chosen by row count "
                         "there); it cannot be compiled for a GPU")
    if isinstance(target, str):
        target = get_target(target, args.tensor_parallel_size)
    s = setup(args, target)
    blocks, sizing = num_blocks_for(s)
    runner = make_runner(s, blocks)
    keys = runner.warmup_keys() if programs == "all" else ci_keys(runner)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    compiled, rows = {}, []
    for key in keys:
        name = runner.program_name(key)
        t1 = time.perf_counter()
        try:
            exe = runner._compile(key)
        except Exception as e:        # noqa: BLE001 - the report says which program failed and why
            logger.error("%s: %s", name, e)
            rows.append(report_lib.failed_program(name, key, repr(e)))
            continue
        compiled[name] = exe
        text = exe.as_text()
        if hlo:
            (out / f"{name}.hlo.txt").write_text(text)
        rows.append(report_lib.program_row(name, key, exe, text, s, runner, time.perf_counter() - t1))
    compiled[PENALTY_PROGRAM] = runner.penalty_program()     # the one helper program a step needs
    ProgramStore(out).write(program_key(runner), compiled)
    kernel_rows = None
    if kernels and target.is_gpu:
        from jaxserve.aot.kernels import kernel_report
        kernel_rows = kernel_report(target)
    report = report_lib.build(s, runner, rows, sizing, seconds=time.perf_counter() - t0, kernels=kernel_rows)
    report_lib.write(report, out)
    return report


def ci_keys(runner: ModelRunner) -> list[tuple]:
    """The smallest and largest decode buckets (max_num_seqs tokens) and the largest bucket, each
    at the block-table width its report scenario needs (`report.CONTEXT` tokens of context for a
    decode, its own tokens for the prefill chunk; the same program where there is one width)."""
    decode = [b for b in runner.buckets if b <= max(runner.max_seqs, 1)] or runner.buckets[:1]

    def at(T: int, tokens: int) -> tuple:
        need = -(-tokens // runner.block_size)
        return runner.step_key(T, False, next((w for w in runner.kv_widths if w >= need), None))
    ctx = report_lib.CONTEXT
    return list(dict.fromkeys([at(decode[0], ctx), at(decode[-1], ctx), at(runner.buckets[-1], runner.buckets[-1])]))
