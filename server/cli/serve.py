"""`jaxserve serve`: its flags (the engine's, the front end's, the chat and tool ones), the
start-up line of settings that differ from the defaults, and starting the HTTP server (process 0)
or following process 0's steps (the other processes of a multi-node engine)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Any

from jaxserve.config import EngineArgs
from jaxserve.server.cli import compat
from jaxserve.server.cli.flags import add_engine_args, add_tool_arguments, check_tool_arguments, engine_args_from
from jaxserve.server.openai.lora import parse_lora_module

logger = logging.getLogger("jaxserve")

_FRONTEND_DEFAULTS = {"host": "127.0.0.1", "port": 8000}


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    fe.add_argument("--headless", action="store_true",
                    help="Run data-parallel ranks --data-parallel-start-rank .. + "
                         "--data-parallel-size-local - 1 for the server at "
                         "--data-parallel-address:--data-parallel-rpc-port, with no HTTP server.")
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


def _headless(engine_args) -> int:
    """--headless: this host's data-parallel ranks for a server elsewhere (engine/dp_remote.py)."""
    import asyncio

    from jaxserve.engine.dp_remote import serve_headless
    p = engine_args.parallel_config()
    if p.data_parallel_size < 2 or p.data_parallel_rank is not None or not p.data_parallel_start_rank \
            or p.data_parallel_size_local is None:
        raise ValueError("--headless runs ranks of a data-parallel group for a server elsewhere: it "
                         "needs --data-parallel-size N, --data-parallel-size-local L and "
                         "--data-parallel-start-rank S >= 1 (no --data-parallel-rank)")
    return asyncio.run(serve_headless(engine_args))


def run(ns: argparse.Namespace) -> int:
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
    if ns.headless:
        return _headless(engine_args)
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
