"""`jaxserve` command line: `serve`, `generate` and any registered subcommand (`run-batch`).

Engine flags are built from `EngineArgs` with vLLM's names and help groups, so every subcommand
that builds an engine shares them:

    parser = argparse.ArgumentParser()
    add_engine_args(parser)                       # --max-model-len, --dtype, ... (grouped)
    args = parser.parse_args()
    engine_args = engine_args_from(args)          # an EngineArgs; only flags given override

Each subcommand is registered in this file with `register_subcommand(name, help, add_arguments,
run)`; `run(namespace) -> int` is the exit code.
`--config config.yaml` takes flag names as keys (dashes or underscores); the command line wins.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from jaxserve.config import (
    ATTENTION_BACKENDS,
    DEFAULT_COMPILATION_CACHE_DIR,
    DTYPES,
    FP8_ACTIVATIONS,
    FP8_KERNELS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    REASONING_PARSERS,
    EngineArgs,
)
from jaxserve.pooling_params import CONVERTS, RUNNERS
from jaxserve.server.cli import compat, help_search
from jaxserve.server.openai.lora import parse_lora_module

logger = logging.getLogger("jaxserve")


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
    ("max_num_seqs", "SchedulerConfig", dict(type=int, help="Most sequences in one step.")),
    ("max_num_batched_tokens", "SchedulerConfig", dict(type=_bytes, help="Token budget of one "
                                                       "step.", shown_default="2048; at least "
                                                       "--max-model-len without chunked prefill")),
    ("scheduling_policy", "SchedulerConfig", dict(choices=["fcfs", "priority"],
                                                  help="Waiting-queue order.")),
    ("enable_chunked_prefill", "SchedulerConfig", dict(action=argparse.BooleanOptionalAction,
                                                       help="Split long prompts over steps.")),
    ("tensor_parallel_size", "ParallelConfig", dict(type=int, help="Tensor-parallel devices.")),
    ("enable_expert_parallel", "ParallelConfig", dict(action=argparse.BooleanOptionalAction,
                                                      help="Expert parallelism for MoE layers.")),
    ("nnodes", "ParallelConfig", dict(type=int, help="Processes (one per node) running this "
                                      "engine together; every one gets the same flags and its "
                                      "own --node-rank.")),
    ("node_rank", "ParallelConfig", dict(type=int, help="This process's rank; 0 serves the API, "
                                         "the others follow its steps.")),
    ("master_addr", "ParallelConfig", dict(help="Address of process 0 (the JAX coordinator).")),
    ("master_port", "ParallelConfig", dict(type=int, help="Coordinator port on process 0.")),
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
_SHORT = {"tensor_parallel_size": ["-tp"]}


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


def apply_config_file(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fill flags not given on the command line from --config (YAML: flag name -> value)."""
    path = getattr(ns, "config", None)
    if not path:
        return
    import yaml
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values")
    known = {a.dest: a for a in parser._actions}
    by_flag = {o: a.dest for a in parser._actions for o in a.option_strings}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        dest = by_flag.get("--" + dest.replace("_", "-"), dest)     # compatibility flags' own dests
        if dest == "model":
            dest = "model_tag" if "model_tag" in known else "model"
        if dest not in known:
            parser.error(f"--config {path}: unknown flag {key!r}")
        if getattr(ns, dest, None) is None:
            action = known[dest]
            if isinstance(value, str) and action.type is not None:
                value = action.type(value)
            if action.nargs == "+" and not isinstance(value, list):
                value = [value]
            setattr(ns, dest, value)


# -- subcommand registry ------------------------------------------------------------------------
@dataclasses.dataclass
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS: dict[str, Subcommand] = {}


def register_subcommand(name: str, help: str, add_arguments: Callable, run: Callable) -> None:
    SUBCOMMANDS[name] = Subcommand(name, help, add_arguments, run)


# -- serve ------------------------------------------------------------------------------------
_FRONTEND_DEFAULTS = {"host": "127.0.0.1", "port": 8000}


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    fe = p.add_argument_group("Frontend")
    fe.add_argument("--host", default=None, help="Address to listen on (default: 127.0.0.1).")
    fe.add_argument("--port", type=int, default=None, help="Port (default: 8000).")
    fe.add_argument("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on "
                                                    "/v1 routes.")
    fe.add_argument("--max-waiting-requests", type=int, default=None,
                    help="Answer 503 when more requests than this are waiting (default: no "
                         "limit).")
    fe.add_argument("--response-role", default=None, help="Role of chat responses (default: "
                                                          "assistant).")
    fe.add_argument("--max-request-body-bytes", type=int, default=None,
                    help="Answer 413 to larger request bodies (default: 8 MiB).")
    fe.add_argument("--shutdown-timeout", type=float, default=None,
                    help="On SIGTERM/SIGINT, seconds to let in-flight requests finish before "
                         "aborting them (default: 30).")
    fe.add_argument("--disable-access-log", "--disable-uvicorn-access-log", action="store_true",
                    help="No log line per request.")
    fe.add_argument("--disable-log-stats", action="store_true",
                    help="No periodic throughput / KV cache usage line while serving.")
    fe.add_argument("--metrics-prefix", type=_metrics_prefixes, default=None, metavar="PREFIX[,PREFIX]",
                    help="Prefix(es) of /metrics names: 'vllm' for vLLM's dashboards, "
                         "'jaxserve,vllm' for both (default: jaxserve).")
    fe.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                    help="Browser origins allowed by CORS ('*' for any; default: none, CORS off).")
    fe.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                    help="Accepted for vLLM command lines: GET /tokenizer_info is always served "
                         "(behind --api-key when one is set).")
    fe.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None,
                    metavar="NAME=PATH",
                    help="LoRA adapters served as models (with --enable-lora): name=path or "
                         "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'.")
    fe.add_argument("--allow-runtime-lora-updating", action="store_true",
                    help="Answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind "
                         "--api-key; vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).")
    fe.add_argument("--config", default=None, help="YAML file of flag values; the command line "
                                                   "wins.")
    add_tool_arguments(p)
    compat.add_frontend_compat_arguments(p)


def _metrics_prefixes(text: str) -> tuple[str, ...]:
    from jaxserve.server.http.metrics import check_prefixes
    try:
        return check_prefixes(text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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


def describe_config(engine_args: EngineArgs, server_args) -> str:
    """The settings this server runs with that differ from the CLI's defaults, one `name: value`
    line each (indented, each name once, the model left to the line it follows), or " none"."""
    from jaxserve.server.http.api_server import ServerArgs
    defaults = {**dataclasses.asdict(engine_args_from({})), **dataclasses.asdict(ServerArgs())}
    values = dataclasses.asdict(engine_args)
    for k, v in dataclasses.asdict(server_args).items():
        if k not in values or v != defaults.get(k):
            values[k] = v           # a name both have: the front end's (every served name)
    settings: dict[str, Any] = {}
    for k, v in values.items():
        if k == "model" or v == defaults.get(k):
            continue
        if k == "api_key":
            v = "***"
        elif k == "chat_template" and ("{{" in v or "{%" in v):   # the text, not a file path
            v = f"<template text, {len(v)} chars>"
        elif isinstance(v, (list, tuple)):
            v = " ".join(map(str, v))
        settings[k] = v
    return "".join(f"\n    {k}: {v}" for k, v in settings.items()) or " none"


def _serve(ns: argparse.Namespace) -> int:
    import asyncio

    from jaxserve.server.http.api_server import ServerArgs, serve
    engine_args = engine_args_from(ns)
    check_tool_arguments(ns)
    server_args = ServerArgs(host=ns.host or _FRONTEND_DEFAULTS["host"],
                             port=ns.port if ns.port is not None else _FRONTEND_DEFAULTS["port"],
                             api_key=ns.api_key, served_model_name=ns.served_model_name,
                             max_waiting_requests=ns.max_waiting_requests,
                             response_role=ns.response_role or "assistant",
                             access_log=not ns.disable_access_log,
                             allowed_origins=tuple(ns.allowed_origins or ()),
                             log_stats_interval=0.0 if ns.disable_log_stats else 10.0,
                             chat_template=ns.chat_template,
                             enable_auto_tool_choice=bool(ns.enable_auto_tool_choice),
                             tool_call_parser=ns.tool_call_parser,
                             reasoning_parser=ns.reasoning_parser,
                             metrics_prefix=ns.metrics_prefix or ("jaxserve",),
                             lora_modules=tuple(ns.lora_modules or ()),
                             allow_runtime_lora_updating=ns.allow_runtime_lora_updating,
                             **({} if ns.max_request_body_bytes is None else
                                {"max_request_body_bytes": ns.max_request_body_bytes}),
                             **({} if ns.shutdown_timeout is None else
                                {"shutdown_timeout": ns.shutdown_timeout}))
    logger.info("jaxserve serve %s; settings other than the defaults:%s",
                engine_args.model or "(the default model)", describe_config(engine_args, server_args))
    if engine_args.node_rank > 0:
        return _follow(engine_args)
    code = asyncio.run(serve(engine_args, server_args))
    if engine_args.nnodes > 1:
        # A step left waiting on a lost process would block the interpreter's exit (it joins
        # the engine thread): leave now, everything is flushed.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)
    return code


def _follow(engine_args: EngineArgs) -> int:
    """node_rank > 0: no HTTP server; build the same engine and run process 0's steps."""
    from jaxserve.engine.llm_engine import LLMEngine
    engine = LLMEngine(engine_args)
    code = engine.follow()
    logging.shutdown()
    os._exit(code)          # as above: nothing may wait on a peer's collective at exit


# -- generate (quick offline check) -----------------------------------------------------------
def _generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="+", metavar="PROMPT",
                   help="Prompt text; several prompts (each quoted) are generated together. "
                        "The model is --model, never a positional.")
    p.add_argument("--chat", action="store_true", help="Wrap each prompt in the chat template.")
    p.add_argument("--max-tokens", type=int, default=64, help="(default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="(default: 1)")
    p.add_argument("--top-k", type=int, default=0, help="(default: 0, off)")
    p.add_argument("--config", default=None, help="YAML file of flag values.")
    add_engine_args(p, model_positional=False)


def _looks_like_a_model(text: str) -> bool:
    path = os.path.expanduser(text)
    return (path.endswith(".gguf") and os.path.isfile(path)) or \
        os.path.isfile(os.path.join(path, "config.json"))


def generate_inputs(ns: argparse.Namespace) -> tuple[EngineArgs, list[str]]:
    """`generate [--model MODEL] PROMPT...`: every positional is a prompt. A first positional
    that names a model on disk (the old `generate MODEL PROMPT` form) is refused, not generated
    from as text."""
    if not ns.model and _looks_like_a_model(ns.prompts[0]):
        ns._subparser.error(f"{ns.prompts[0]!r} is a model: pass it as --model, e.g. jaxserve generate "
                            f"--model {ns.prompts[0]} \"Once upon a time\"")
    return engine_args_from(ns), list(ns.prompts)


def _generate(ns: argparse.Namespace) -> int:
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams
    args, prompts = generate_inputs(ns)
    llm = LLM(**dataclasses.asdict(args))
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature,
                            top_p=ns.top_p, top_k=ns.top_k)
    if ns.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    if len(prompts) == 1:
        print(outs[0].outputs[0].text)
    else:                   # vLLM's offline examples print the same
        for prompt, out in zip(prompts, outs):
            print(f"Prompt: {prompt!r}, Generated text: {out.outputs[0].text!r}")
    llm.shutdown()
    return 0


register_subcommand("serve", "Start the OpenAI-compatible HTTP server.", _serve_arguments, _serve)
register_subcommand("generate", "Generate completions for one or more prompts (offline).",
                    _generate_arguments, _generate)


# -- export-model -------------------------------------------------------------------------------
def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", metavar="DIR", help="Where to write the Hugging Face files.")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="HF directory, .gguf file or Hub name org/name (default: the embedded "
                        "SmolLM2-135M-Instruct).")
    p.add_argument("--no-weights", action="store_true",
                   help="Write config, generation config and tokenizer files only.")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype of model.safetensors (default: float32, exact for GGUF).")


def _export(ns: argparse.Namespace) -> int:
    from jaxserve.default_model import default_model_path
    from jaxserve.loader.export import export_model
    from jaxserve.loader.gguf import read_gguf
    from jaxserve.loader.loader import load_model
    from jaxserve.tokenizer.tokenizer import Tokenizer
    path = ns.model_tag or str(default_model_path())
    reader = read_gguf(path) if path.endswith(".gguf") else None
    tokenizer = Tokenizer.from_gguf(reader) if reader is not None else Tokenizer.from_model(path)
    cfg, weights = load_model(path, "float32", gguf_reader=reader)
    files = export_model(ns.directory, cfg, tokenizer, None if ns.no_weights else weights,
                         dtype=ns.dtype)
    print(f"wrote {', '.join(files)} to {ns.directory}")
    return 0


register_subcommand("export-model", "Write a model (default: the embedded one) as a Hugging Face "
                    "directory for other tools.", _export_arguments, _export)


# -- quantize ---------------------------------------------------------------------------------
def _quantize_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", metavar="DIR", help="Where to write the FP8 checkpoint.")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct).")
    p.add_argument("--calibration-samples", type=int, default=64,
                   help="Sequences to calibrate on (default: 64).")
    p.add_argument("--calibration-tokens", type=int, default=256,
                   help="Tokens per calibration sequence (default: 256).")
    p.add_argument("--calibration-file", default=None,
                   help="Calibration text: .jsonl with a \"text\" field per line, or plain text with samples "
                        "separated by blank lines (default: the model's own samples from its BOS token).")
    p.add_argument("--activations", choices=["dynamic", "none"], default="dynamic",
                   help="dynamic: W8A8 with per-token e4m3 activations (FP8 GPUs); none: W8A16, weights "
                        "only (default: dynamic).")
    p.add_argument("--damp", type=float, default=0.01,
                   help="GPTQ dampening, a fraction of the Hessian's mean diagonal (default: 0.01).")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype of the tensors left unquantised: embeddings, norms, lm_head.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto")


def _quantize(ns: argparse.Namespace) -> int:
    from jaxserve.quantize import quantize_model, read_calibration_file
    try:
        texts = read_calibration_file(ns.calibration_file) if ns.calibration_file else None
        files = quantize_model(ns.directory, ns.model_tag, num_samples=ns.calibration_samples,
                               num_tokens=ns.calibration_tokens, texts=texts, activations=ns.activations,
                               damp=ns.damp, seed=ns.seed, dtype=ns.dtype, load_format=ns.load_format)
    except (OSError, ValueError) as e:
        print(f"jaxserve quantize: {e}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(files)} to {ns.directory}; serve it with: jaxserve serve {ns.directory}")
    return 0


register_subcommand("quantize", "Write a calibrated FP8 checkpoint (GPTQ rounding, compressed-tensors) of a "
                    "model (default: the embedded one).", _quantize_arguments, _quantize)


def register_module(name: str, help: str, module: str) -> None:
    """A subcommand whose `add_arguments(parser)` and `run(namespace) -> int` live in `module`
    (imported when the parser is built, not when this file is)."""
    register_subcommand(name, help, lambda p: importlib.import_module(module).add_arguments(p),
                        lambda ns: importlib.import_module(module).run(ns))


register_module("run-batch", "Run an OpenAI Batch JSONL file through the engine offline.",
                "jaxserve.server.batch.runner")
register_module("compile", "Compile the engine's programs ahead of time for an H100/H200 (on any machine) "
                "or this CPU, with a report; serve them with --compiled-dir.", "jaxserve.server.cli.compile")
register_module("bench", "Benchmark a server (serve) or the offline engine (throughput, latency), "
                "as vllm bench does.", "jaxserve.server.bench.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="jaxserve: LLM serving in JAX")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for cmd in SUBCOMMANDS.values():
        # no abbreviations: a mistyped flag must not be taken for a longer one
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help, allow_abbrev=False)
        cmd.add_arguments(p)
        p.set_defaults(_subparser=p)
    return parser


def _version() -> str:
    from jaxserve import __version__
    return f"jaxserve {__version__}"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    # jax's backend probing ("Unable to initialize backend 'tpu' ... libtpu.so") is INFO noise.
    logging.getLogger("jax").setLevel(logging.WARNING)
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    query = next((t.split("=", 1)[1] for t in argv if t.startswith("--help=")), None)
    if query is not None and argv and argv[0] in SUBCOMMANDS:      # vLLM's --help=GROUP|FLAG|KEYWORD
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return help_search.print_help(sub.choices[argv[0]], query)
    ns = compat.parse_command_line(parser, argv)
    if not ns.command:
        parser.print_help()
        return 2
    apply_config_file(ns, ns._subparser)
    compat.apply_or_exit(ns)
    ns._argv = argv    # as typed (run-batch's --resume hint)
    try:
        return int(SUBCOMMANDS[ns.command].run(ns) or 0)
    except ValueError as e:     # EngineArgs validation: a usage error, not a crash
        ns._subparser.error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())
