"""Building an engine: everything `LLMEngine` is made of before it serves its first step.

`build_engine(args)` resolves the model (a local directory, a .gguf file, a hub name or the
embedded default), joins a multi-host job, reads the generation config, loads the weights onto
the mesh, loads the tokenizer, sets up LoRA and a draft model, chooses the attention backend and
kernels, sizes the KV pool from the memory budget (a profile run, or a compiled directory's
size), and builds and warms up the runner — falling back to the next kernel choice when one fails
to compile or run. It returns `EngineParts`; the engine core (`llm_engine.LLMEngine`) adds the
scheduler, the output processor and the step loop. `kernel_table` is the one statement of every
kernel the engine runs, logged once at start-up.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import time
from typing import Any

import jax

from jaxserve.aot.store import compiled_pool_blocks, open_cache, open_matching
from jaxserve.attention import AttentionCase, cpu_backend, select_backend
from jaxserve.attention import kv_cache as kvc
from jaxserve.config import DEFAULT_COMPILATION_CACHE_DIR, EngineArgs, ModelConfig, SchedulerConfig
from jaxserve.default_model import DEFAULT_MODEL_NAME, default_model_path
from jaxserve.engine import multihost
from jaxserve.engine.fallback import Choice, build_with_fallback, fallback_plan
from jaxserve.engine.pooling import engine_args_for_pooling
from jaxserve.layers import int4_cpu
from jaxserve.layers.experts import ExpertWeight, default_layout, experts_read_in_place
from jaxserve.layers.fp8 import Fp8Weight
from jaxserve.layers.host_weights import offload_layer_weights
from jaxserve.layers.int4 import Int4Weight, fused_kernel_rows
from jaxserve.layers.int4_layout import dense_as_int8
from jaxserve.layers.linear import DenseWeight
from jaxserve.loader import generation_config, loader
from jaxserve.loader.fp8 import kernels_in, with_kernel
from jaxserve.loader.gguf import read_gguf
from jaxserve.loader.hub import resolve_model
from jaxserve.loader.loader import ModelLoadError, cpu_matmuls_for, load_model, parameter_count, resolve_dtype
from jaxserve.loader.pooling_config import resolve_pooler
from jaxserve.lora.manager import setup_lora
from jaxserve.lora.weight import LoraWeight
from jaxserve.sharding.mesh import make_mesh
from jaxserve.sharding.plan import plan_for
from jaxserve.tokenizer.tokenizer import Tokenizer
from jaxserve.worker.draft_runner import DraftRunner, load_draft
from jaxserve.worker.head_runner import HeadRunner
from jaxserve.worker.kv_sizing import num_kv_blocks, probe_blocks, profile_peak_bytes
from jaxserve.worker.model_runner import ModelRunner
from jaxserve.worker.pooling_runner import PoolingRunner

logger = logging.getLogger("jaxserve")


@dataclasses.dataclass
class EngineParts:
    """What `build_engine` made (the engine's attributes of the same names)."""
    args: EngineArgs                    # as given, or as a pooling model runs them
    model_path: str
    model_name: str
    group: Any                          # multihost.Group, or None (one process)
    default_sampling_params: dict       # SamplingParams field -> the model's recommended value
    generation_eos: tuple               # generation_config.json's eos ids
    mesh: Any
    model_config: ModelConfig
    tokenizer: Tokenizer
    pooler: Any                         # PoolerConfig of a pooling model, or None
    max_model_len: int
    lora: Any                           # LoraManager, or None
    plan: Any                           # ShardingPlan
    scheduler_config: SchedulerConfig
    runner: ModelRunner
    warmup_seconds: float
    attention_backend: str
    cache_config: Any                   # CacheConfig with num_blocks resolved
    kernels: str                        # `kernel_table`


def build_engine(args: EngineArgs, warmup: bool | str = True) -> EngineParts:
    """Everything an engine is built from, in order: the model resolved (local, GGUF or hub), the
    multi-host group joined, the weights loaded (sharded over the mesh), the tokenizer, LoRA,
    the draft model, the attention backend and kernels chosen, the KV pool sized from the memory
    budget, and the runner built and warmed up — falling back to the next kernel choice when one
    fails to compile or run (`engine.fallback`)."""
    if args.data_parallel_size > 1 and args.data_parallel_rank is None:
        raise ValueError(f"data_parallel_size {args.data_parallel_size}: an engine is one replica; "
                         "serve several with `jaxserve serve --data-parallel-size N` (its load "
                         "balancer), or give each process its --data-parallel-rank")
    model_path = resolve_model(args.model_location(), revision=args.revision, download_dir=args.download_dir,
                               weights=args.load_format != "dummy") \
        if args.model else str(default_model_path())
    model_name = args.served_model_name or (DEFAULT_MODEL_NAME if args.model is None else args.model)
    if args.compilation_cache_dir:      # opt-in: jax.config is the whole process's
        enable_compilation_cache(args.compilation_cache_dir)
    # Several processes: join the job first (before any array), then every process builds
    # the same engine; process 0 schedules, the others follow (`follow`).
    # With Ray, process 0 first has Ray place and start the others (engine/ray_hosts.py).
    hosts = None
    if args.distributed_executor_backend == "ray" and args.nnodes == 1:
        logger.info("distributed_executor_backend 'ray' with nnodes 1: this process drives every "
                    "device of its host; Ray places processes only for nnodes > 1")
    if args.distributed_executor_backend == "ray" and args.nnodes > 1:
        from jaxserve.engine import ray_hosts
        hosts = ray_hosts.start(args, warmup=bool(warmup))
        args = dataclasses.replace(args, master_addr=hosts.master_addr)
    try:
        group = None if args.nnodes == 1 else multihost.initialize(
            args.nnodes, args.node_rank, args.master_addr, args.master_port, hosts=hosts)
    except BaseException:
        if hosts is not None:
            hosts.close()
        raise
    if group is not None and args.tensor_parallel_size != jax.device_count():
        raise ValueError(f"with nnodes={args.nnodes}, tensor_parallel_size must cover every "
                         f"device of every process ({jax.device_count()}), got "
                         f"{args.tensor_parallel_size}")
    reader = read_gguf(model_path) if str(model_path).endswith(".gguf") else None
    # Request fields left unset take the model's recommended values (vLLM's
    # default_sampling_params): SamplingParams field -> value.
    default_sampling_params, origin = generation_config.default_sampling_params(
        os.fspath(args.generation_config), model_path, args.override_generation_config, reader)
    generation_eos = () if reader is not None else generation_config.generation_eos_token_ids(
        os.fspath(args.generation_config), model_path)
    if default_sampling_params:
        logger.info("default sampling parameters from %s: %s (a request's own values win; "
                    "--generation-config vllm ignores the model's)", origin,
                    default_sampling_params)
    dtype = resolve_dtype(args.dtype)
    # a data-parallel replica: its own slice of this host's devices
    mesh = make_mesh(args.tensor_parallel_size,
                     devices=args.parallel_config().replica_devices(jax.devices()))
    model_config, weights = load_model(model_path, dtype, gguf_reader=reader,
                                            mesh=mesh, load_format=args.load_format,
                                            seed=args.seed,
                                            quantization=args.load_quantization(model_path),
                                            expert_parallel=args.enable_expert_parallel,
                                            hf_overrides=args.model_overrides(),
                                            fp8_activations=args.fp8_activations)
    gguf = args.load_quantization(model_path) == "gguf"
    # a GGUF file computes as llama.cpp does (int8 activations); int4 checkpoints (W4A16) as their
    # dequantized weights unless --q8-activations asks otherwise
    weights = cpu_matmuls_for(weights, args.dtype, mesh.size, batch_invariant=args.batch_invariant,
                              q8=args.q8_activations if gguf else bool(args.q8_activations), donate=True,
                              w4a16=not gguf)
    args = _real_size_gguf_kv(args, gguf, weights, mesh)
    tokenizer = load_tokenizer(args, model_path, reader, model_config)
    # A pooling model (runner "pooling") computes embeddings: prefill-only requests whose
    # runner pools hidden states instead of sampling (engine/pooling.py).
    pooler = resolve_pooler(args.runner, args.convert, args.pooler_config, model_path)
    if pooler is not None:
        args = engine_args_for_pooling(args, pooler)
    del reader
    cfg = model_config
    max_model_len = cfg.resolve_max_model_len(args.max_model_len)
    # the served length is part of the model for LongRoPE (short or long factors, vLLM's rule)
    cfg = model_config = dataclasses.replace(cfg, max_model_len=max_model_len)
    kv_quantize, kv_dtype = kv_quantization(args.kv_cache_dtype, dtype)
    if args.kv_offloading_size and pooler is not None:
        raise ValueError("kv_offloading_size: a pooling model keeps no prefix cache to offload")
    if args.enable_lora and pooler is not None:
        raise ValueError("enable_lora: LoRA adapters are not supported with a pooling model")
    weights, lora = setup_lora(args, cfg, weights, dtype, mesh)
    plan = plan_for(cfg, mesh, args.enable_expert_parallel)
    if args.cpu_offload_gb:
        weights, moved = offload_layer_weights(weights, args.cpu_offload_gb)
        logger.info("--cpu-offload-gb %g: %.2f GiB of layer weights per device in host memory%s",
                    args.cpu_offload_gb, moved / 2**30,
                    "" if moved else " (none: every stacked layer weight is larger, or quantized)")
    # Speculative decoding with a draft model: its own pool of the same blocks.
    spec = args.spec_config()
    draft = draft_plan = None
    if spec is not None and spec.method == "draft_model":
        try:
            draft_path = resolve_model(spec.model, download_dir=args.download_dir,
                                       weights=args.load_format != "dummy")
        except ModelLoadError as e:     # name the field, as every config error does
            raise ModelLoadError(f"speculative_config.model: {e}") from None
        draft = load_draft(draft_path, cfg, tokenizer, dtype=dtype, mesh=mesh,
                           load_format=args.load_format, seed=args.seed,
                           quantization=args.load_quantization(draft_path),
                           expert_parallel=args.enable_expert_parallel)
        draft = (draft[0], cpu_matmuls_for(draft[1], args.dtype, mesh.size,
                                           batch_invariant=args.batch_invariant))
        draft_plan = plan_for(draft[0], mesh, args.enable_expert_parallel)
    head = None         # (module, config, weights, plan or None) of an EAGLE-3 head or an MTP layer
    if spec is not None and spec.method == "eagle3":
        from jaxserve.models import eagle3
        head = (eagle3, *load_eagle3_head(args, spec, cfg, dtype, mesh.size, weights), None)
    elif spec is not None and spec.method == "mtp":
        from jaxserve.models import mtp
        head = (mtp, *load_mtp_layer(args, spec, cfg, model_path, dtype, mesh))
    # Sized per device: a block costs its heads on one device, the budget is one device's.
    per_block = sum(kvc.bytes_per_block(c.num_layers, args.block_size,
                                        plan.kv_heads_per_device(c.num_kv_heads),
                                        c.head_dim, kv_dtype, kv_quantize is not None,
                                        latent=c.mla is not None)
                    for c, plan in [(cfg, plan)] + ([(draft[0], draft_plan)] if draft
                                                         else []))
    if head is not None:    # the head's one-layer pool (EAGLE-3's whole on every device)
        c, head_plan = head[1].model, head[3]
        kv_heads = c.num_kv_heads if head_plan is None else head_plan.kv_heads_per_device(c.num_kv_heads)
        per_block += kvc.bytes_per_block(1, args.block_size, kv_heads, c.head_dim, kv_dtype,
                                         kv_quantize is not None, latent=c.mla is not None)
    # One device's share, from the sharding (no per-shard array objects: on CPU those would
    # stay alive beside the weights and count twice in jax.live_arrays()).
    weight_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                       for x in jax.tree_util.tree_leaves((weights, draft and draft[1], head and head[2]))
                       if x.sharding.memory_kind != "pinned_host")    # --cpu-offload-gb's
    # Simulated CPU devices share the host's memory: there a budget covers all of them.
    host_copies = mesh.size if jax.default_backend() == "cpu" else 1
    scheduler_config = args.scheduler_config(max_model_len)
    case = AttentionCase.of(cfg, dtype, kv_dtype, args.block_size)
    selected = cpu_backend(select_backend(args.attention_backend, case), args.attention_backend, args.dtype,
                           mesh.size, case)
    if args.batch_invariant and selected != "cpu":
        raise ValueError(f"batch_invariant needs the CPU attention kernel (attention backend 'cpu'); this "
                         f"engine would run {selected!r} (an fp8/int8 KV cache, latent attention, an asked "
                         f"backend, or no kernel build), whose sums depend on the batch")
    if args.fp8_kernel != "auto":
        weights = with_kernel(weights, args.fp8_kernel)
    fp8_kernels = kernels_in(weights)
    fp8 = "pallas" if "pallas" in fp8_kernels else ("xla" if fp8_kernels else None)

    def make_runner(num_blocks: int, choice: Choice, weights,
                    drafter: DraftRunner | None = None) -> ModelRunner:
        cache_config = dataclasses.replace(args.cache_config(), num_blocks=num_blocks)
        pooling = {} if pooler is None else {"pooler": pooler}
        return (ModelRunner if pooler is None else PoolingRunner)(
            cfg, weights, cache_config, scheduler_config, **pooling, dtype=dtype,
            backend=choice.attention, max_logprobs=args.max_logprobs,
            kv_quantize=kv_quantize, kv_dtype=kv_dtype, plan=plan,
            num_speculative_tokens=scheduler_config.num_speculative_tokens,
            drafter=drafter, **({} if lora is None else {"lora": lora}))

    def make_drafter(num_blocks: int, choice: Choice, w) -> DraftRunner | HeadRunner | None:
        if head is not None:
            module, hcfg, hweights, head_plan = head
            return HeadRunner(module, hcfg, hweights, w.embed, target_plan=plan, head_plan=head_plan,
                              num_blocks=num_blocks, block_size=args.block_size,
                              max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                              num_speculative_tokens=spec.num_speculative_tokens, dtype=dtype,
                              backend=choice.attention, kv_quantize=kv_quantize, kv_dtype=kv_dtype)
        if draft is None:
            return None
        dcfg, dweights = draft
        backend = choice.attention if choice.attention != selected else select_backend(
            args.attention_backend, AttentionCase.of(dcfg, dtype, kv_dtype, args.block_size))
        return DraftRunner(dcfg, dweights, num_blocks=num_blocks, block_size=args.block_size,
                           max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                           num_speculative_tokens=spec.num_speculative_tokens, dtype=dtype,
                           backend=backend, kv_quantize=kv_quantize, kv_dtype=kv_dtype,
                           plan=draft_plan)

    def build(choice: Choice):
        """Size the pool (a profile run compiles the largest programs), then the runner and
        its warm-up: everything that compiles a kernel happens here (`build_with_fallback`).
        With a compiled directory whose programs were built for this backend, the pool is the
        size they were compiled for (no profile run: it would compile) and the runner loads
        them (`aot.store.open_matching`; a mismatch is logged and compiles)."""
        w = weights if choice.fp8 == fp8 else with_kernel(weights, choice.fp8)
        blocks = compiled_pool_blocks(args.compiled_dir, choice.attention, per_block, weight_bytes)
        if blocks is None:
            blocks = num_kv_blocks(args, per_block * host_copies, weight_bytes,
                                   profile=lambda n: profile_peak_bytes(make_runner(n, choice, w)),
                                   probe_num_blocks=probe_blocks(args, max_model_len), max_model_len=max_model_len)
        if group is not None:      # one pool size for all (profiles differ per process)
            blocks = group.agree_min("kv_blocks", blocks)
        runner = make_runner(blocks, choice, w, make_drafter(blocks, choice, w))
        if args.compiled_dir:
            runner.programs = open_matching(args.compiled_dir, runner)
        elif args.program_cache_dir:
            runner.programs = open_cache(args.program_cache_dir, runner)
        if not warmup:
            return blocks, runner, 0.0
        # A background warm-up only where one process schedules alone (followers of a
        # multi-host job must hold the same programs at the same step).
        background = warmup == "background" and group is None and pooler is None
        return blocks, runner, (runner.warmup(background=True) if background else runner.warmup())

    choice, (blocks, runner, warmup_seconds) = build_with_fallback(
        fallback_plan(selected, fp8), build)
    attention_backend = choice.attention
    logger.info("attention backend: %s (asked: %s)%s", attention_backend, args.attention_backend,
                "" if choice.fp8 is None else f"; fp8 matmul: {choice.fp8} (asked: {args.fp8_kernel})")
    host_tier = getattr(runner, "host_tier", None)
    cache_config = dataclasses.replace(args.cache_config(), num_blocks=blocks,
                                       num_host_blocks=host_tier.num_slots if host_tier else 0)
    tokens = blocks * args.block_size
    logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB); maximum concurrency "
                "for %d tokens per request: %.2fx", blocks, args.block_size, tokens,
                blocks * per_block / 2**30, max_model_len, tokens / max_model_len)
    logger.info("memory: weights %.2f GiB, KV cache %.2f GiB, this process in all %s", weight_bytes / 2**30,
                blocks * per_block / 2**30, _process_memory())
    if host_tier is not None:
        logger.info("host KV tier: %d blocks (%.2f GiB of host memory)", host_tier.num_slots,
                    host_tier.num_slots * host_tier.block_bytes / 2**30)
    kernels = kernel_table(args, runner.weights, attention_backend, selected)
    logger.info("kernels:\n%s", kernels)
    if group is not None:
        # No step before every process holds its programs: the first step's collectives would
        # otherwise time out (gloo gives 30 s) on a process still compiling.
        t0 = time.perf_counter()
        logger.info("process %d of %d: built; waiting for the others", group.rank, group.size)
        group.barrier("engine-built")
        logger.info("every process of the engine is built (waited %.1f s)", time.perf_counter() - t0)
    return EngineParts(
        args=args, model_path=model_path, model_name=model_name, group=group,
        default_sampling_params=default_sampling_params, generation_eos=generation_eos, mesh=mesh,
        model_config=model_config, tokenizer=tokenizer, pooler=pooler, max_model_len=max_model_len, lora=lora,
        plan=plan, scheduler_config=scheduler_config, runner=runner, warmup_seconds=warmup_seconds,
        attention_backend=attention_backend, cache_config=cache_config, kernels=kernels)


def load_eagle3_head(args: EngineArgs, spec, cfg: ModelConfig, dtype, tp: int, target_weights=None):
    """speculative_config method "eagle3": (Eagle3Config, weights) of the head at spec.model (a
    local directory or a Hub name), checked against the target. Raises ValueError naming the
    field. Where the target's matmuls of a few rows take the fused CPU kernel (`--dtype auto` on
    one CPU device), the head's matrices are rounded to int8 and take it too: a step's drafts
    read a quarter of the f32 bytes (the head's program 4.2-4.9 -> 2.0-2.3 ms at batch 1 on the
    default model, benchmarks/RESULTS.md); the verification keeps the output exact either way."""
    import inspect

    from jaxserve.models import eagle3, get_model
    if "aux_layers" not in inspect.signature(get_model(cfg.architecture).forward).parameters:
        raise ValueError(f"speculative_config.method 'eagle3': {cfg.architecture} does not return the "
                         "hidden states an EAGLE-3 head reads; EAGLE-3 runs on the Llama family "
                         "(Llama, Mistral, Qwen2, Qwen3)")
    if spec.draft_tensor_parallel_size not in (None, 1, tp):
        raise ValueError(f"speculative_config.draft_tensor_parallel_size must be 1 or the target's "
                         f"tensor_parallel_size ({tp}), got {spec.draft_tensor_parallel_size}")
    try:
        path = resolve_model(spec.model, download_dir=args.download_dir, weights=True)
    except ModelLoadError as e:
        raise ModelLoadError(f"speculative_config.model: {e}") from None
    ecfg = eagle3.read_config(path, cfg)
    weights = eagle3.load(path, ecfg, dtype)
    int8 = target_weights is not None and fused_kernel_rows(target_weights) > 0
    if int8:
        weights = cpu_matmuls_for(dense_as_int8(weights), args.dtype, tp, batch_invariant=args.batch_invariant)
    logger.info("EAGLE-3 head %s: features from layers %s, draft vocabulary %d of %d%s", spec.model,
                list(ecfg.aux_layer_ids), ecfg.draft_vocab_size, cfg.vocab_size,
                ", matrices in int8 on the fused CPU kernel" if int8 else "")
    return ecfg, weights


def load_mtp_layer(args: EngineArgs, spec, cfg: ModelConfig, model_path: str, dtype, mesh):
    """speculative_config method "mtp": (MtpConfig, weights, plan) of the multi-token prediction
    layer in spec.model (default: the target's checkpoint), placed on the target's mesh. Raises
    ValueError naming the field."""
    from jaxserve.models import mtp
    mtp.check_target(cfg)         # before the checkpoint's format is looked at
    tp = mesh.shape["tp"]
    if spec.draft_tensor_parallel_size not in (None, tp):
        raise ValueError(f"speculative_config.draft_tensor_parallel_size: the MTP layer runs split as the "
                         f"target's layers (tensor_parallel_size {tp}), got {spec.draft_tensor_parallel_size}")
    if args.load_format == "dummy":
        raise ValueError("speculative_config.method 'mtp' reads the MTP layer from the checkpoint; "
                         "load_format 'dummy' has none")
    if spec.model is None:
        path = model_path
    else:
        try:
            path = resolve_model(spec.model, download_dir=args.download_dir, weights=True)
        except ModelLoadError as e:
            raise ModelLoadError(f"speculative_config.model: {e}") from None
    if str(path).endswith(".gguf"):
        raise ValueError("speculative_config.method 'mtp' reads the MTP layer from a safetensors "
                         "checkpoint; a GGUF file drops it")
    mcfg = mtp.read_config(path, cfg)
    weights = mtp.load(path, mcfg, dtype, mesh, quantization=args.load_quantization(path),
                       expert_parallel=args.enable_expert_parallel)
    logger.info("MTP: the multi-token prediction layer %d of %s drafts", mcfg.layer_index, path)
    return mcfg, weights, plan_for(mcfg.model, mesh, args.enable_expert_parallel)


def enable_compilation_cache(directory: str | None) -> str | None:
    """JAX's persistent compilation cache, so a second start loads programs instead of compiling.
    Process-wide (jax.config, so every jitted function of the process is cached there): the
    `jaxserve` CLI turns it on (default directory DEFAULT_COMPILATION_CACHE_DIR), which owns its
    process; `LLM` and an engine only when given `compilation_cache_dir`.
    None: the default directory; "": do nothing."""
    if directory == "":
        return None
    directory = os.path.expanduser(directory or DEFAULT_COMPILATION_CACHE_DIR)
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return directory


def load_tokenizer(args: EngineArgs, model_path: str, reader, cfg) -> Tokenizer:
    """The model's tokenizer; a dummy-weights directory without tokenizer files gets the
    synthetic word-level one ("t17 t42" <-> [17, 42]) so the whole engine path still runs."""
    if args.tokenizer is None and reader is not None:
        return Tokenizer.from_gguf(reader)
    source = resolve_model(args.tokenizer, download_dir=args.download_dir, weights=False) \
        if args.tokenizer else model_path
    if args.load_format == "dummy" and args.tokenizer is None and os.path.isdir(source) and \
            not any(os.path.exists(os.path.join(source, f))
                    for f in ("tokenizer.json", "tokenizer_config.json")):
        logger.info("no tokenizer files in %s: using a synthetic word-level tokenizer of %d "
                    "tokens", source, cfg.vocab_size)
        return Tokenizer.synthetic(cfg.vocab_size, cfg.eos_token_ids[0] if cfg.eos_token_ids
                                   else None)
    return Tokenizer.from_model(source)


def _process_memory() -> str:
    """This process's resident memory now and at its peak (Linux), in words; the rest of what
    the weights and the pool do not account for is the runtime and the compiled programs."""
    import resource
    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return "(unknown)"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return f"{now / 2**30:.2f} GiB resident (peak {peak / 2**30:.2f} GiB)"


def _real_size_gguf_kv(args: EngineArgs, gguf: bool, weights, mesh) -> EngineArgs:
    """`--kv-cache-dtype auto` for a GGUF model of 1B parameters or more on the CPU (f32 activations):
    bf16 pages, llama.cpp's 16-bit KV cache (half f32's memory, half the bytes decode attention
    reads), as `--q8-activations` is on there (`loader.Q8_AUTO_PARAMS`); `args` unchanged elsewhere
    and with an explicit `--dtype float32` (f32 everything, as its matmuls)."""
    if (not gguf or args.kv_cache_dtype != "auto" or args.dtype != "auto"         # "auto" on the CPU: f32
            or mesh.devices.flat[0].platform != "cpu" or parameter_count(weights) < loader.Q8_AUTO_PARAMS):
        return args
    logger.info("--kv-cache-dtype auto: bfloat16 pages for a GGUF model of 1B parameters or more on the CPU "
                "(llama.cpp's 16-bit KV cache; --dtype float32 keeps f32 pages)")
    return dataclasses.replace(args, kv_cache_dtype="bfloat16")


def kv_quantization(kv_cache_dtype: str, model_dtype):
    """(quantize function or None, storage dtype) for --kv-cache-dtype: None for an unquantised
    storage dtype ("auto", "bfloat16": pages cast as written, no scales)."""
    if kv_cache_dtype == "auto":
        return None, model_dtype
    from functools import partial

    from jaxserve.attention import kv_quant
    storage = kv_quant.kv_storage_dtype(kv_cache_dtype, model_dtype)
    if not kv_quant.is_quantized(storage):
        return None, storage
    return partial(kv_quant.quantize_kv, storage_dtype=storage), storage


def _weight_kind(w) -> str:
    """One weight's kernel, in words."""
    if isinstance(w, LoraWeight):
        return _weight_kind(w.base) + " + LoRA"
    if isinstance(w, ExpertWeight):
        how = ("grouped matmul kernel, read in place" if experts_read_in_place(w)
               else f"{default_layout(w)} layout")
        return f"experts of {_weight_kind(w.w)} ({how})"
    if isinstance(w, Fp8Weight):
        return f"fp8 ({w.kernel})"
    if isinstance(w, Int4Weight):
        kernel = (f"fused CPU kernel up to {w.fused_max_rows} rows, dequantised tiles above"
                  if w.fused_max_rows is not None else "dequantised tiles")
        if w.amx_min_rows is not None:
            kernel = (f"fused CPU kernel below {w.amx_min_rows} rows, AMX kernel up to {int4_cpu.AMX_MAX_ROWS}, "
                      "dequantised tiles above")
        return f"int{w.bits} ({kernel})"
    if isinstance(w, DenseWeight):
        return f"dense {jax.numpy.dtype(w.w.dtype).name} (XLA dot)"
    return type(w).__name__


def kernel_table(args: EngineArgs, weights, attention: str, first_choice: str) -> str:
    """Every kernel the engine's step runs, as an aligned two-column table: the attention backend
    (and what it fell back from), the KV cache, and each kind of weight with its matmul."""
    kinds = (DenseWeight, Fp8Weight, Int4Weight, ExpertWeight, LoraWeight)
    leaves = jax.tree_util.tree_leaves(weights, is_leaf=lambda x: isinstance(x, kinds))
    counts = collections.Counter(_weight_kind(w) for w in leaves if isinstance(w, kinds))
    other = [type(w).__name__ for w in leaves if not isinstance(w, kinds + (jax.Array,))]
    counts.update(f"{name} (its registered linear kernel)" for name in other)
    rows = [("attention", attention + (f" (fell back from {first_choice})" if attention != first_choice else "")
             + f"; asked {args.attention_backend}"),
            ("KV cache", args.kv_cache_dtype),
            ("async scheduling", "on" if args.uses_async_scheduling() else "off")]
    rows += [("weights", f"{n} x {kind}") for kind, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"  {name:<{width}}  {what}" for name, what in rows)
