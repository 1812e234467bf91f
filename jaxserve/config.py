"""Frozen configuration dataclasses, validated once where they are built.

Host side: never imports jax. `ModelConfig` describes the network (from HF `config.json` or GGUF
metadata); `CacheConfig`, `SchedulerConfig` and `ParallelConfig` (`parallel_config.py`, re-exported
here) are what the cache manager, scheduler and mesh builder receive; `EngineArgs` is the
kwargs/CLI surface that builds them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from jaxserve.json_configs import (  # noqa: F401  (re-exported: the engine's config surface)
    KVEventsConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from jaxserve.loader.generation_config import check_overrides
from jaxserve.loader.hf_overrides import merge_overrides
from jaxserve.model_config import (  # noqa: F401  (re-exported: the engine's config surface)
    HIDDEN_ACTS,
    LAYER_TYPES,
    SUPPORTED_ROPE_TYPES,
    ModelConfig,
    MoeConfig,
)
from jaxserve.parallel_config import ParallelConfig
from jaxserve.pooling_params import CONVERTS, RUNNERS, PoolerConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
EXECUTOR_BACKENDS = (None, "mp", "uni", "external_launcher", "ray")
# --quantization values: fp8 quantises on load; the others name an int4 checkpoint's method (vLLM's
# names, its *_marlin kernels' included), which is detected from config.json anyway; gguf keeps a
# .gguf file's quantized tensors (every type llama.cpp's presets write) quantized in memory
# (loader/gguf_quant.py), which is
# what a .gguf model gets when none is named (as in vLLM); "none" (jaxserve's) reads them into
# --dtype instead.
QUANTIZATIONS = (None, "fp8", "awq", "gptq", "compressed-tensors", "awq_marlin", "gptq_marlin", "gguf",
                 "none")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
ATTENTION_BACKENDS = ("auto", "reference", "pallas", "triton", "mosaic", "cpu")
# The FP8 matmul (jaxserve/layers/fp8.py): "pallas" is the Mosaic GPU kernel ("mosaic" its alias).
FP8_KERNELS = ("auto", "xla", "pallas", "mosaic")
FP8_ACTIVATIONS = ("auto", "w8a8", "w8a16")     # an FP8 checkpoint's (loader.fp8.served_activations)
# `<think>` markers the engine knows (structured_output/reasoning.py; the server's parsers)
REASONING_PARSERS = ("deepseek_r1", "qwen3")


# --prefix-caching-hash-algo: jaxserve's own, then vLLM's (core/block_hash.py)
PREFIX_CACHING_HASH_ALGOS = ("builtin", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


@dataclass(frozen=True)
class CacheConfig:
    """What the KV cache manager and the device cache need."""

    block_size: int = 16
    num_blocks: int | None = None          # resolved at start-up from the memory budget
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    prefix_caching_hash_algo: str = "builtin"
    # The host KV tier (`--kv-offloading-size`, GiB across all tensor-parallel ranks, as vLLM's);
    # its size in blocks is resolved at start-up from the pool's bytes per block.
    kv_offloading_size: float | None = None
    num_host_blocks: int = 0

    def __post_init__(self):
        if self.prefix_caching_hash_algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ValueError("prefix_caching_hash_algo must be one of "
                             f"{', '.join(PREFIX_CACHING_HASH_ALGOS)}, got "
                             f"{self.prefix_caching_hash_algo!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be a power of two in [1, 256], got "
                             f"{self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.kv_offloading_size is not None:
            if not self.kv_offloading_size > 0:
                raise ValueError(f"kv_offloading_size must be > 0 (GiB), got {self.kv_offloading_size}")
            if not self.enable_prefix_caching:
                raise ValueError("kv_offloading_size: the host KV tier holds prefix-cache blocks; it "
                                 "needs prefix caching (drop --no-enable-prefix-caching)")


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs: the per-step budgets and the policy."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"                  # or "priority"
    enable_chunked_prefill: bool = True
    # Room in the token budget reserved per running request for speculative tokens (0 = none).
    num_speculative_tokens: int = 0
    # KV slots allocated past a sampling row's tokens (a draft model writes its proposals'
    # K/V there before the next step; 0 = none).
    num_lookahead_tokens: int = 0
    # Distinct LoRA adapters one step may hold (the device slots); 0: LoRA disabled.
    max_loras: int = 0
    # Async scheduling: a request's num_computed_tokens advances when it is scheduled and a
    # sampling row leaves an output placeholder, so the next step can be scheduled (and run)
    # before this one's tokens are back (core/scheduler.py).
    async_scheduling: bool = False

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got "
                             f"{self.max_num_batched_tokens}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got "
                             f"{self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller "
                             f"than max_model_len ({self.max_model_len}) and chunked prefill is "
                             "disabled, so long prompts could never be scheduled")


DEFAULT_COMPILATION_CACHE_DIR = "~/.cache/jaxserve/xla"   # the CLI's; see EngineArgs
DEFAULT_PROGRAM_CACHE_DIR = "~/.cache/jaxserve/programs"  # the offline LLM's; see EngineArgs


@dataclass(frozen=True)
class EngineArgs:
    """Every engine knob, named as vLLM names it. `LLM(**kwargs)` and the CLI both build this."""

    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # vLLM's data parallelism (ParallelConfig): replicas behind one server, or with a rank, one
    # replica per process behind an external balancer.
    data_parallel_size: int = 1
    data_parallel_rank: int | None = None
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int | None = None     # a headless host's first rank
    data_parallel_address: str | None = None        # the server's host, for headless ranks
    data_parallel_rpc_port: int | None = None       # where the server waits for them (29550)
    # Several processes (one per node) as one engine (jaxserve/engine/multihost.py): process 0
    # serves; every process runs with the same flags but its own --node-rank.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    # "ray": Ray places the other nnodes - 1 processes (engine/ray_hosts.py); mp / uni /
    # external_launcher (vLLM's other values) and None: each process is started by hand.
    distributed_executor_backend: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # vLLM's --prefix-caching-hash-algo (core/block_hash.py): "builtin" (xxh3-128, jaxserve's) or
    # vLLM's sha256 / sha256_cbor / xxhash / xxhash_cbor with vLLM's definitions.
    prefix_caching_hash_algo: str = "builtin"
    # vLLM's native KV offloading: GiB of host memory for prefix-cache blocks the device pool
    # evicts (`core/host_tier.py`); backend "native" is the only one.
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None
    # vLLM's --cpu-offload-gb: GiB per device of the stacked layer weights kept in host memory
    # and copied in a layer at a time inside the step (`layers/host_weights.py`).
    cpu_offload_gb: float = 0.0
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    attention_backend: str = "auto"
    fp8_kernel: str = "auto"
    # An FP8 checkpoint's activations: "auto" = its own scheme (W8A8) where the device has FP8 tensor
    # cores, W8A16 elsewhere (vLLM's rule); "w8a8" / "w8a16" force one (loader.fp8.served_activations).
    fp8_activations: str = "auto"
    speculative_config: dict | None = None
    seed: int = 0
    load_format: str = "auto"   # "dummy": seeded random weights of config.json's shapes
    # A Hub name (org/name) for `model` is downloaded (jaxserve/loader/hub.py): into download_dir
    # (Hugging Face cache layout; None: the HF cache) at `revision` (None: the default branch).
    download_dir: str | None = None
    revision: str | None = None
    # JAX's persistent compilation cache (process-wide jax.config): None or "" leaves jax.config
    # alone; the jaxserve CLI passes ~/.cache/jaxserve/xla unless --compilation-cache-dir says.
    compilation_cache_dir: str | None = None
    # A directory `jaxserve compile` wrote (serialized step programs and their key): programs whose
    # key matches this engine's are loaded instead of compiled; a mismatch is logged (naming the
    # fields) and the engine compiles as without it.
    compiled_dir: str | None = None
    # vLLM's --gguf-file: the .gguf file inside `model` (a local directory or a Hub repo), the same
    # as naming `model` "DIR/FILE.gguf" or "org/name/FILE.gguf" (`model_location`).
    gguf_file: str | None = None
    # The engine's own store of serialized step programs, a directory per key under this root
    # (jaxserve.aot.store.open_cache), loaded by later engines of the same model, flags, devices and
    # versions. `LLM` passes DEFAULT_PROGRAM_CACHE_DIR unless told ("" or None: off).
    program_cache_dir: str | None = None
    max_logprobs: int = 20
    # One answer per prompt whatever shares its step (vLLM's VLLM_BATCH_INVARIANT): on CPU every
    # quantized matmul, of any row count, takes the fused kernel, and attention the CPU kernel
    # (`loader.cpu_matmuls_for`); refused, with the reason, where that cannot be (a GPU, dense
    # weights, several devices, an fp8 KV cache, ...).
    batch_invariant: bool = False
    # A GGUF file on the CPU: every int4 and 8-bit matmul takes the fused kernel with activations
    # rounded to one int8 part a block, llama.cpp's arithmetic (1.3-2x XLA's bf16 tiles on prefill
    # and large batches; a row's result independent of its step's size; `layers.int4.with_q8_rows`).
    # None (auto): on for models of 1B parameters or more (`loader.Q8_AUTO_PARAMS`), where those
    # steps are int8 compute; below, two int8 parts to 16 rows (x to 1.6e-5, perplexity ratio 1.0000
    # on the default model against one part's 1.0048) and bf16 tiles above.
    q8_activations: bool | None = None
    # vLLM's --async-scheduling: step N + 1 launched before step N's results are read, the host's
    # work overlapping the device's (engine/llm_engine.py). None: on, but not with a model drafter.
    async_scheduling: bool | None = None
    # vLLM's --stream-interval: a streamed (DELTA) request's output is handed over once it has this
    # many tokens not yet sent (its first token and its finish at once), so the server writes a
    # chunk per N tokens: less host work per token for a burstier stream.
    stream_interval: int = 1
    # vLLM's structured_outputs_config.reasoning_parser (--reasoning-parser): a request's
    # structured output applies after its <think>...</think> reasoning (None: from its start).
    reasoning_parser: str | None = None
    # vLLM's --generation-config: where requests' default sampling parameters come from ("auto":
    # the model's generation_config.json or GGUF general.sampling.*; "vllm": none; or a folder)
    # and --override-generation-config (Hugging Face names, merged over it).
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # vLLM's --structured-outputs-config (StructuredOutputsConfig keys): the JSON whitespace rule.
    structured_outputs_config: dict | None = None
    # vLLM's kv_events_config (--kv-events-config): KV-cache events over ZeroMQ (KVEventsConfig).
    kv_events_config: dict | None = None
    # vLLM's --hf-overrides and --rope-scaling: JSON merged into config.json (loader/hf_overrides.py).
    hf_overrides: dict | None = None
    rope_scaling: dict | None = None
    # vLLM's --runner / --convert / --pooler-config: "pooling" serves embeddings (LLM.embed,
    # /v1/embeddings) instead of generating; "auto" picks it for sentence-transformers
    # checkpoints or --convert embed (jaxserve/loader/pooling_config.py).
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: dict | None = None
    # Multi-LoRA (jaxserve/lora/): adapters in max_loras device slots of rank up to
    # max_lora_rank, max_cpu_loras host copies (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.fp8_activations not in FP8_ACTIVATIONS:
            raise ValueError(f"fp8_activations must be one of {', '.join(FP8_ACTIVATIONS)}, "
                             f"got {self.fp8_activations!r}")
        if self.fp8_kernel not in FP8_KERNELS:
            raise ValueError(f"fp8_kernel must be one of {', '.join(FP8_KERNELS)}, got {self.fp8_kernel!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got "
                             f"{self.load_format!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be None or one of {', '.join(QUANTIZATIONS[1:])}, "
                             f"got {self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {self.stream_interval!r}")
        if not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise ValueError(f"nnodes must be a positive integer, got {self.nnodes!r}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank!r}")
        if not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port (1..65535), got {self.master_port!r}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be None or one of "
                             f"{', '.join(EXECUTOR_BACKENDS[1:])}, got "
                             f"{self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" and self.node_rank != 0:
            raise ValueError("node_rank with distributed_executor_backend 'ray': start only process "
                             "0; Ray places the other nnodes - 1")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be None or one of "
                             f"{', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}")
        if not isinstance(self.generation_config, str | os.PathLike) or \
                not os.fspath(self.generation_config):
            raise ValueError("generation_config must be 'auto', 'vllm' or a folder holding "
                             f"generation_config.json, got {self.generation_config!r}")
        check_overrides(self.override_generation_config)
        self.model_overrides()
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.convert not in CONVERTS:
            raise ValueError(f"convert must be one of {', '.join(CONVERTS)} (classify and reward "
                             f"models are not supported), got {self.convert!r}")
        PoolerConfig.from_dict(self.pooler_config)
        self.lora_limits()
        self.model_location()
        # The sub-configs validate their own fields; build them once here so errors surface early.
        self.cache_config()
        spec = self.spec_config()
        if spec is not None and spec.method in ("eagle3", "mtp") and self.nnodes > 1:
            raise ValueError(f"speculative_config.method {spec.method!r} with nnodes > 1: the head is "
                             "placed on one process's devices; serve it on one node")
        self.structured_config()
        self.kv_events()
        self._check_kv_offloading()
        parallel = self.parallel_config()
        if parallel.data_parallel_size > 1 and self.nnodes > 1:
            raise ValueError("data_parallel_size > 1 with nnodes > 1: a multi-node replica with data "
                             "parallelism is not supported; run one replica per node group, each "
                             "with --data-parallel-rank, behind a balancer")

    def _check_kv_offloading(self) -> None:
        if not (isinstance(self.cpu_offload_gb, int | float) and self.cpu_offload_gb >= 0):
            raise ValueError(f"cpu_offload_gb must be >= 0 (GiB per device), got {self.cpu_offload_gb!r}")
        if self.kv_offloading_backend not in (None, "native"):
            raise ValueError(f"kv_offloading_backend must be 'native' (jaxserve's host KV tier; "
                             f"LMCache is not supported), got {self.kv_offloading_backend!r}")
        if self.kv_offloading_size is None:
            if self.kv_offloading_backend is not None:
                raise ValueError("kv_offloading_backend needs kv_offloading_size (GiB of host memory)")
            return
        if self.nnodes > 1:
            raise ValueError("kv_offloading_size with nnodes > 1: the host KV tier is for one "
                             "process's devices")
        spec = self.spec_config()
        if spec is not None and spec.method in spec.MODEL_METHODS:
            raise ValueError(f"kv_offloading_size with speculative method {spec.method!r}: the host KV "
                             "tier does not keep the draft's KV; use an n-gram speculative method or "
                             "no offloading")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, num_blocks=self.num_gpu_blocks_override,
                           kv_cache_dtype=self.kv_cache_dtype,
                           enable_prefix_caching=self.enable_prefix_caching,
                           gpu_memory_utilization=self.gpu_memory_utilization,
                           kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                           prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                           kv_offloading_size=self.kv_offloading_size)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        budget = self.max_num_batched_tokens or max(2048, 0 if self.enable_chunked_prefill
                                                    else max_model_len)
        spec = self.spec_config()
        return SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=budget,
                               max_model_len=max_model_len, policy=self.scheduling_policy,
                               enable_chunked_prefill=self.enable_chunked_prefill,
                               num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                               num_lookahead_tokens=(spec.num_speculative_tokens
                                                     if spec and spec.method in spec.MODEL_METHODS
                                                     else 0),
                               max_loras=self.max_loras if self.enable_lora else 0,
                               async_scheduling=self.uses_async_scheduling())

    def uses_async_scheduling(self) -> bool:
        """`async_scheduling` resolved (None: on, except with a draft model, EAGLE-3 head or MTP
        layer, whose drafts follow each step's tokens; with ngram / suffix see `LLMEngine.step`)."""
        spec = self.spec_config()
        if spec is not None and spec.method in spec.MODEL_METHODS:
            if self.async_scheduling:
                raise ValueError(f"async_scheduling is not supported with speculative_config method "
                                 f"{spec.method!r}: its drafts need each step's tokens before the next "
                                 "step is scheduled; leave it unset (ngram and suffix support it)")
            return False
        return self.async_scheduling is not False

    def load_quantization(self, model_path) -> str | None:
        """What `load_model` is asked for `model_path`: a .gguf file's quantized tensors stay
        quantized unless `quantization` says otherwise ("none": dequantized to the dtype;
        dummy weights are never quantized); "none" is None elsewhere."""
        if self.quantization == "none":
            return None
        if self.quantization is None and self.load_format != "dummy" and \
                os.fspath(model_path).endswith(".gguf") and os.path.isfile(model_path):
            return "gguf"
        return self.quantization

    def lora_limits(self) -> tuple[int, int, int]:
        """(max_loras, max_lora_rank, max_cpu_loras), checked (vLLM's rules)."""
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        cpu = self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras:
            raise ValueError(f"max_cpu_loras ({cpu!r}) must be an int >= max_loras ({self.max_loras})")
        return self.max_loras, self.max_lora_rank, cpu

    def spec_config(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.from_dict(self.speculative_config)

    def model_location(self) -> str | None:
        """`model`, with `gguf_file` joined as the file inside it: a local directory's path, or a
        Hub repo's "org/name/FILE.gguf" (None: the embedded default model)."""
        if not self.gguf_file:
            return self.model
        if not str(self.gguf_file).endswith(".gguf") or "/" in str(self.gguf_file):
            raise ValueError(f"gguf_file must be a .gguf file name inside the model's directory or repo, "
                             f"got {self.gguf_file!r}")
        if self.model is None or str(self.model).endswith(".gguf"):
            raise ValueError(f"gguf_file {self.gguf_file!r} names a file inside model, which must then be a "
                             f"directory or a Hub repo (org/name), got model {self.model!r}")
        model = os.fspath(self.model)
        if os.path.isdir(os.path.expanduser(model)):
            return os.path.join(model, self.gguf_file)
        return f"{model.rstrip('/')}/{self.gguf_file}"

    def model_overrides(self) -> dict | None:
        """hf_overrides with rope_scaling merged in: what load_model merges into config.json."""
        return merge_overrides(self.hf_overrides, self.rope_scaling)

    def structured_config(self) -> StructuredOutputsConfig:
        return StructuredOutputsConfig.from_dict(self.structured_outputs_config)

    def kv_events(self) -> KVEventsConfig:
        return KVEventsConfig.from_dict(self.kv_events_config)

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.enable_expert_parallel,
                              self.data_parallel_size, self.data_parallel_rank,
                              self.data_parallel_size_local, self.data_parallel_start_rank,
                              self.data_parallel_address, self.data_parallel_rpc_port)

    def replace(self, **changes) -> EngineArgs:
        return dataclasses.replace(self, **changes)

