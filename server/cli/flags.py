"""The flags several subcommands share: the engine's, and the chat template / tool calling ones.

Engine flags are built from `EngineArgs` with vLLM's names and help groups, so every subcommand
that builds an engine (serve, generate, run-batch, compile, bench) shares them:

    parser = argparse.ArgumentParser()
    add_engine_args(parser)                       # --max-model-len, --dtype, ... (grouped)
    args = parser.parse_args()
    engine_args = engine_args_from(args)          # an EngineArgs; only flags given override

`add_tool_arguments` / `check_tool_arguments`: --chat-template, --enable-auto-tool-choice and
--tool-call-parser (serve and run-batch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from jaxserve.config import (
    ATTENTION_BACKENDS,
    DEFAULT_COMPILATION_CACHE_DIR,
    DTYPES,
    FP8_ACTIVATIONS,
    FP8_KERNELS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    PREFIX_CACHING_HASH_ALGOS,
    QUANTIZATIONS,
    REASONING_PARSERS,
    EngineArgs,
)
from jaxserve.pooling_params import CONVERTS, RUNNERS
from jaxserve.server.cli import compat


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _bytes(text: str) -> int:
    """An int, optionally with a suffix as vLLM reads them: k/m/g = 10^3.., K/M/G = 2^10.."""
    s = str(text).strip()
    decimal = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
    binary = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if s and s[-1] in decimal:
        return int(float(s[:-1]) * decimal[s[-1]])
    if s and s[-1] in binary:
        return int(float(s[:-1]) * binary[s[-1]])
    return int(s)


# (EngineArgs field, group, argparse kwargs). Every EngineArgs field except `model` appears once.
# `shown_default`: what --help says the flag's absence means, where EngineArgs' value (often None)
# does not say it.
_ENGINE_FLAGS: list[tuple[str, str, dict[str, Any]]] = [
    ("tokenizer", "ModelConfig", dict(help="Tokenizer path.", shown_default="the model's")),
    ("served_model_name", "ModelConfig",
     dict(nargs="+", help="Model name(s) used in the API; the first is reported back.",
          shown_default="the model's name")),
    ("dtype", "ModelConfig", dict(choices=(*DTYPES, *compat.DTYPE_ALIASES), help="Weights and activations "
                                  "dtype (vLLM's half = float16, float = float32).")),
    ("max_model_len", "ModelConfig", dict(type=compat.max_model_len, help="Context length (prompt + "
                                          "output); 'auto': the model's.", shown_default="the model's")),
    ("hf_overrides", "ModelConfig", dict(type=_json_dict, help="JSON merged into the model's config.json, "
                                         "e.g. '{\"max_position_embeddings\": 65536}'.", shown_default="none")),
    ("rope_scaling", "ModelConfig", dict(type=_json_dict, help="JSON replacing config.json's rope_scaling, "
                                         "e.g. Qwen3's 131K YaRN: '{\"rope_type\": \"yarn\", \"factor\": 4.0, "
                                         "\"original_max_position_embeddings\": 32768}'.",
                                         shown_default="the model's")),
    ("quantization", "ModelConfig", dict(choices=[q for q in QUANTIZATIONS if q],
                                         help="Weight quantization: fp8 quantises on load; awq, gptq, "
                                         "compressed-tensors name an int4 checkpoint's format (detected anyway); "
                                         "gguf keeps a .gguf file's Q4_0/Q4_1/Q8_0/Q4_K tensors quantized (the "
                                         "default for .gguf files); none reads them into --dtype.",
                                         shown_default="gguf for a .gguf file, else none")),
    ("seed", "ModelConfig", dict(type=int, help="Random seed of the engine (and of dummy "
                                 "weights).")),
    ("runner", "ModelConfig", dict(choices=RUNNERS, help="'pooling': serve embeddings "
                                   "(/v1/embeddings, LLM.embed) instead of generating; 'auto': pooling "
                                   "for sentence-transformers checkpoints or --convert embed.")),
    ("convert", "ModelConfig", dict(choices=CONVERTS, help="'embed': run a generative checkpoint "
                                    "as an embedding model (with --runner auto or pooling).")),
    ("pooler_config", "ModelConfig", dict(type=_json_dict, help="JSON, e.g. '{\"pooling_type\": "
                                          "\"MEAN\", \"normalize\": true}' (LAST, MEAN or CLS).",
                                          shown_default="LAST, normalized, or the checkpoint's "
                                          "sentence-transformers config")),
    ("gguf_file", "LoadConfig", dict(help="The .gguf file inside MODEL (a directory or Hub repo): "
                                     "the same as MODEL/FILE.gguf.", shown_default="none")),
    ("load_format", "LoadConfig", dict(choices=(*LOAD_FORMATS, *compat.LOAD_FORMAT_ALIASES),
                                       help="'dummy': seeded random "
                                       "weights of the shapes in MODEL/config.json, no "
                                       "checkpoint files (benchmarks).")),
    ("revision", "ModelConfig", dict(help="Hub model revision (branch, tag or commit) to "
                                     "download.", shown_default="the default branch")),
    ("download_dir", "LoadConfig", dict(help="Where Hub models are downloaded (Hugging Face "
                                        "cache layout).", shown_default="the Hugging Face cache")),
    ("max_logprobs", "ModelConfig", dict(type=int, help="Largest logprobs / top_logprobs a "
                                         "request may ask for.")),
    ("generation_config", "ModelConfig", dict(help="Default sampling parameters of requests "
                                              "that leave them unset: 'auto' (the model's "
                                              "generation_config.json or GGUF "
                                              "general.sampling.*), 'vllm' (none: vLLM's "
                                              "defaults) or a folder holding "
                                              "generation_config.json.")),
    ("override_generation_config", "ModelConfig",
     dict(type=_json_dict, help="JSON merged over the generation config, e.g. "
          "'{\"temperature\": 0.5, \"max_new_tokens\": 256}'.", shown_default="none")),
    ("block_size", "CacheConfig", dict(type=int, help="Tokens per KV block.")),
    ("gpu_memory_utilization", "CacheConfig", dict(type=float, help="Fraction of device memory "
                                                   "for weights, activations and KV cache.")),
    ("kv_cache_dtype", "CacheConfig", dict(choices=KV_CACHE_DTYPES, help="KV cache dtype.")),
    ("kv_cache_memory_bytes", "CacheConfig", dict(type=_bytes, help="KV cache size in bytes "
                                                  "(overrides --gpu-memory-utilization).",
                                                  shown_default="from --gpu-memory-utilization")),
    ("num_gpu_blocks_override", "CacheConfig", dict(type=int, help="Number of KV blocks.",
                                                    shown_default="from the KV cache size")),
    ("enable_prefix_caching", "CacheConfig", dict(action=argparse.BooleanOptionalAction,
                                                  help="Reuse KV blocks of shared prefixes.")),
    ("kv_offloading_size", "CacheConfig", dict(type=float, help="GiB of host memory (all "
                                               "tensor-parallel ranks together) holding prefix-cache "
                                               "blocks the device pool evicts; a later prefix hit "
                                               "there is copied back instead of recomputed.",
                                               shown_default="off")),
    ("cpu_offload_gb", "CacheConfig", dict(type=float, help="GiB of layer weights per device kept in "
                                           "host memory and copied in a layer at a time inside each "
                                           "step (a larger KV pool for a slower step).",
                                           shown_default="0: none")),
    ("kv_offloading_backend", "CacheConfig", dict(choices=["native"], help="KV offloading "
                                                  "backend (with --kv-offloading-size).",
                                                  shown_default="native")),
    ("max_num_seqs", "SchedulerConfig", dict(type=int, help="Most sequences in one step.")),
    ("max_num_batched_tokens", "SchedulerConfig", dict(type=_bytes, help="Token budget of one "
                                                       "step.", shown_default="2048; at least "
                                                       "--max-model-len without chunked prefill")),
    ("scheduling_policy", "SchedulerConfig", dict(choices=["fcfs", "priority"],
                                                  help="Waiting-queue order.")),
    ("enable_chunked_prefill", "SchedulerConfig", dict(action=argparse.BooleanOptionalAction,
                                                       help="Split long prompts over steps.")),
    ("async_scheduling", "SchedulerConfig", dict(action=argparse.BooleanOptionalAction,
                                                 help="Launch each step before the last one's tokens are read, so the "
                                                 "host's work overlaps the device's.",
                                                 shown_default="on; off with a draft model, EAGLE-3 or MTP")),
    ("stream_interval", "SchedulerConfig", dict(type=int, help="Tokens a streamed request gathers "
                                                "before its next chunk is sent (its first token and "
                                                "its end go at once): fewer, larger chunks, less host "
                                                "work per token.", shown_default="1: every token")),
    ("tensor_parallel_size", "ParallelConfig", dict(type=int, help="Tensor-parallel devices.")),
    ("enable_expert_parallel", "ParallelConfig", dict(action=argparse.BooleanOptionalAction,
                                                      help="Expert parallelism for MoE layers.")),
    ("data_parallel_size", "ParallelConfig", dict(type=int, help="Engine replicas, each on its "
                                                  "own --tensor-parallel-size devices, behind "
                                                  "this server's load balancer (or, with "
                                                  "--data-parallel-rank, behind yours).")),
    ("data_parallel_rank", "ParallelConfig", dict(type=int, help="External load balancing: this "
                                                  "process is replica RANK alone, on its rank's "
                                                  "devices, with its own endpoint.",
                                                  shown_default="none: every replica here")),
    ("data_parallel_size_local", "ParallelConfig", dict(type=int, help="Replicas on this host "
                                                        "(a rank takes the devices of rank mod "
                                                        "this).", shown_default="--data-parallel-size")),
    ("data_parallel_start_rank", "ParallelConfig", dict(type=int, help="With --headless: the "
                                                        "first rank this host runs.",
                                                        shown_default="0")),
    ("data_parallel_address", "ParallelConfig", dict(help="The server's host, which headless "
                                                     "ranks dial.", shown_default="127.0.0.1")),
    ("data_parallel_rpc_port", "ParallelConfig", dict(type=int, help="Where the server waits "
                                                      "for its headless ranks "
                                                      "(--data-parallel-size-local below "
                                                      "--data-parallel-size).",
                                                      shown_default="29550")),
    ("nnodes", "ParallelConfig", dict(type=int, help="Processes (one per node) running this "
                                      "engine together; every one gets the same flags and its "
                                      "own --node-rank.")),
    ("node_rank", "ParallelConfig", dict(type=int, help="This process's rank; 0 serves the API, "
                                         "the others follow its steps.")),
    ("master_addr", "ParallelConfig", dict(help="Address of process 0 (the JAX coordinator).")),
    ("master_port", "ParallelConfig", dict(type=int, help="Coordinator port on process 0.")),
    ("distributed_executor_backend", "ParallelConfig",
     dict(choices=["mp", "uni", "external_launcher", "ray"],
          help="ray: with --nnodes N, start only process 0, on a node of a Ray cluster; Ray "
               "places the other N - 1 (one actor per host, a placement-group bundle each). "
               "The others: one process drives every local device through JAX; several nodes "
               "are started by hand (--node-rank).", shown_default="none")),
    ("speculative_config", "SpeculativeConfig", dict(type=_json_dict, help="JSON, e.g. "
                                                     "'{\"method\": \"ngram\", "
                                                     "\"num_speculative_tokens\": 4}' or, with a "
                                                     "draft model, '{\"model\": PATH, "
                                                     "\"num_speculative_tokens\": 4}'.",
                                                     shown_default="off")),
    ("reasoning_parser", "StructuredOutputsConfig",
     dict(choices=REASONING_PARSERS, help="Put <think>...</think> text in a chat message's "
          "`reasoning` field (deepseek_r1: the start tag may be in the prompt; qwen3); "
          "structured output then applies after the reasoning.", shown_default="none")),
    ("structured_outputs_config", "StructuredOutputsConfig",
     dict(type=_json_dict, help="JSON: '{\"disable_any_whitespace\": true}' (no whitespace in "
          "JSON outputs) or '{\"whitespace_pattern\": REGEX}' (whitespace allowed between JSON "
          "tokens; vLLM's unbounded rule is \"[\\\\x20\\\\x0A\\\\x0D\\\\x09]+\").",
          shown_default="one space, or a line break and up to 32 spaces of indentation")),
    ("prefix_caching_hash_algo", "CacheConfig",
     dict(choices=PREFIX_CACHING_HASH_ALGOS, help="The prefix cache's block hash: builtin "
          "(jaxserve's xxh3-128, fastest) or vLLM's, with vLLM's definitions (an indexer that "
          "computes block keys from token ids as vLLM does, with the same PYTHONHASHSEED, finds "
          "jaxserve's).", shown_default="builtin")),
    ("kv_events_config", "KVEventsConfig",
     dict(type=_json_dict, help="KV-cache events for an external indexer (llm-d), vLLM's wire "
          "format over ZeroMQ. JSON, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": "
          "\"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", "
          "\"topic\": \"kv-events\"}'.", shown_default="off")),
    ("enable_lora", "LoRAConfig", dict(action="store_true", help="Serve LoRA adapters (PEFT "
                                       "checkpoints) beside the base model.")),
    ("max_loras", "LoRAConfig", dict(type=int, help="Distinct adapters one step may hold (device "
                                     "slots).")),
    ("max_lora_rank", "LoRAConfig", dict(type=int, help="Largest adapter rank served.")),
    ("max_cpu_loras", "LoRAConfig", dict(type=int, help="Adapters kept in host memory.",
                                         shown_default="--max-loras")),
    ("attention_backend", "CompilationConfig", dict(choices=ATTENTION_BACKENDS,
                                                    help="Attention implementation (auto: on a GPU, "
                                                    "only kernels measured on that GPU class).")),
    ("fp8_kernel", "CompilationConfig", dict(choices=FP8_KERNELS, help="FP8 matmul: xla, or "
                                             "pallas/mosaic (the Mosaic GPU kernel, one device); auto "
                                             "picks a kernel only where it was measured.")),
    ("fp8_activations", "CompilationConfig", dict(choices=FP8_ACTIVATIONS, help="An FP8 checkpoint's "
                                                  "activations: auto = W8A8 where the GPU has FP8 tensor cores "
                                                  "(compute capability >= 8.9), W8A16 elsewhere (the CPU).")),
    ("batch_invariant", "CompilationConfig", dict(action="store_true", help="One answer per prompt whatever "
                                                  "shares its step: on the CPU every quantized matmul takes one "
                                                  "kernel at every batch size (vLLM's VLLM_BATCH_INVARIANT). "
                                                  "CPU only.")),
    ("q8_activations", "CompilationConfig", dict(action=argparse.BooleanOptionalAction,
                                                 help="A GGUF file on the CPU: every matmul takes int8 "
                                                 "activations, one part a block, as llama.cpp computes them "
                                                 "(faster prefill and large batches; off: two int8 parts to 16 "
                                                 "rows, bf16 tiles above).",
                                                 shown_default="on for models of 1B parameters or more")),
    ("compilation_cache_dir", "CompilationConfig", dict(help="Persistent XLA compilation cache "
                                                        "directory ('' disables).",
                                                        shown_default=DEFAULT_COMPILATION_CACHE_DIR)),
    ("program_cache_dir", "CompilationConfig", dict(help="The engine's own store of compiled step programs "
                                                    "(one directory per model/flags/devices/version key); the "
                                                    "offline LLM defaults to ~/.cache/jaxserve/programs.",
                                                    shown_default="off (the CLI uses --compilation-cache-dir)")),
    ("compiled_dir", "CompilationConfig", dict(help="Load the step programs from a directory `jaxserve "
                                               "compile` wrote (same model and flags) instead of "
                                               "compiling them; a mismatch is logged and compiles.",
                                               shown_default="none")),
]
_SHORT = {"tensor_parallel_size": ["-tp"], "data_parallel_size": ["-dp"],
          "data_parallel_rank": ["-dpr"], "data_parallel_size_local": ["-dpl"],
          "data_parallel_address": ["-dpa"], "data_parallel_rpc_port": ["-dpp"]}


def add_engine_args(parser: argparse.ArgumentParser, *, model_positional: bool = True) -> None:
    """Add every EngineArgs flag (vLLM names, grouped as vLLM's --help). All default to None so
    that `engine_args_from` can tell given flags from defaults (and --config can fill in)."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    if model_positional:
        parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                            help="HF directory, .gguf file or Hub name org/name (default: the embedded "
                                 "SmolLM2-135M-Instruct).")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, group, kwargs in _ENGINE_FLAGS:
        if group not in groups:
            groups[group] = parser.add_argument_group(group)
        g = groups[group]
        if group == "ModelConfig" and name == "tokenizer":
            g.add_argument("--model", dest="model", default=None,
                           help="Same as the positional MODEL." if model_positional else
                           "HF directory, .gguf file or Hub name org/name (default: the embedded "
                           "SmolLM2-135M-Instruct).")
        kwargs = dict(kwargs)
        help_text = kwargs.pop("help", "")
        # what the flag's absence means, said once (the argparse default is None, see above)
        shown = kwargs.pop("shown_default", defaults[name])
        flag = "--" + name.replace("_", "-")
        g.add_argument(*_SHORT.get(name, []), flag, dest=name, default=None,
                       help=f"{help_text} (default: {shown})", **kwargs)
    compat.add_engine_compat_arguments(parser)


def engine_args_from(ns: argparse.Namespace | dict, **overrides) -> EngineArgs:
    """EngineArgs from parsed flags: only values that were given (not None) override."""
    values = vars(ns) if isinstance(ns, argparse.Namespace) else dict(ns)
    kwargs = {}
    model = values.get("model") or values.get("model_tag")
    if model:
        kwargs["model"] = model
    for name, _, _ in _ENGINE_FLAGS:
        if values.get(name) is not None:
            kwargs[name] = values[name]
    names = kwargs.get("served_model_name")
    if isinstance(names, (list, tuple)):
        kwargs["served_model_name"] = names[0] if names else None
    # The CLI turns JAX's persistent compilation cache on (a process of its own); the Python
    # API leaves jax.config alone unless asked.
    kwargs.setdefault("compilation_cache_dir", DEFAULT_COMPILATION_CACHE_DIR)
    kwargs.update(overrides)
    return EngineArgs(**kwargs)


def add_tool_arguments(p: argparse.ArgumentParser) -> None:
    """--chat-template, --enable-auto-tool-choice, --tool-call-parser (serve and run-batch;
    --reasoning-parser is an engine flag: the engine gates structured output with it)."""
    from jaxserve.server.openai.tool_parsers import TOOL_PARSERS
    g = p.add_argument_group("Chat: templates, tool calling and reasoning")
    g.add_argument("--chat-template", default=None,
                   help="Chat template for /v1/chat/completions: a file path or the template "
                        "text (default: the model's).")
    g.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                   help="Let the model decide to call tools (tool_choice \"auto\", the default "
                        "when a request has tools); needs --tool-call-parser.")
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="How to read tool calls out of the model's text: hermes (Hermes, "
                        "Qwen2.5/3 <tool_call>), llama3_json (Llama 3.x JSON), mistral "
                        "([TOOL_CALLS]), pythonic ([f(x=1)]).")


def check_tool_arguments(ns: argparse.Namespace) -> None:
    if ns.enable_auto_tool_choice and not ns.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
