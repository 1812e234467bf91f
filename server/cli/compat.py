"""vLLM command lines as vLLM users write them, for `jaxserve serve` (and the other engine subcommands).

- Underscore spellings (`--max_model_len`, `--speculative_config`) are the dashed flags: vLLM's
  FlexibleArgumentParser reads them so.
- Flags that do nothing here are accepted with one warning each saying why (`NOOP_FLAGS`):
  `--trust-remote-code`, `--enforce-eager`, `-O`/`--compilation-config`, `--disable-log-requests`,
  `--uvicorn-log-level`, ... and `--max-model-len auto`. Aliases that do something are mapped
  silently: `--dtype half|float`, `--load-format safetensors|gguf`, `--allowed-origins '["..."]'`.
- Flags of features jaxserve does not have are refused at once, naming the flag and why
  (`REFUSED_FLAGS`), never silently dropped; values that only some spellings allow (`--pipeline-parallel-size 1`,
  `--preemption-mode recompute`) are accepted as no-ops.
- An unknown flag is an error that suggests the closest known one, as argparse does from 3.14.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
from typing import Any

logger = logging.getLogger("jaxserve")

_EAGER = "there are no CUDA graphs to disable: XLA compiles each padded step shape once"
_STORE_TRUE = dict(action="store_true", default=None)

# (flags, argparse kwargs, why it does nothing here). Engine flags: every subcommand that builds an engine.
NOOP_FLAGS: list[tuple[tuple[str, ...], dict[str, Any], str]] = [
    (("--trust-remote-code",), _STORE_TRUE,
     "jaxserve runs no code from model repositories; the families it serves are built in"),
    (("--enforce-eager",), _STORE_TRUE, _EAGER),
    (("-O", "--compilation-config"), dict(nargs="?", const="", default=None, metavar="LEVEL|JSON"),
     "vLLM's torch.compile levels do not apply: XLA compiles every step"),
    (("--enable-reasoning",), _STORE_TRUE,
     "reasoning is parsed whenever --reasoning-parser is given (vLLM dropped this flag too)"),
    (("--enable-eplb",), _STORE_TRUE,
     "experts stay where --enable-expert-parallel places them (no load rebalancing); outputs are the same"),
    (("--disable-cascade-attn",), _STORE_TRUE, "jaxserve has no cascade attention to disable"),
    (("--calculate-kv-scales",), _STORE_TRUE,
     "quantised KV caches always compute their scales, per token and head, as the K/V is written"),
    (("--kv-sharing-fast-prefill",), _STORE_TRUE,
     "it applies to models that share KV across layers, which jaxserve does not serve"),
    (("--num-scheduler-steps",), dict(type=int, default=None),
     "every step is scheduled (vLLM V1 removed multi-step scheduling too)"),
    (("--scheduler-delay-factor",), dict(type=float, default=None),
     "waiting requests are scheduled at the next step (vLLM V1 removed this flag too)"),
    (("--tokenizer-pool-size",), dict(type=int, default=None), "tokenization runs in the server process"),
    (("--tokenizer-pool-type",), dict(default=None), "tokenization runs in the server process"),
    (("--guided-decoding-backend",), dict(default=None),
     "structured output always uses llguidance (vLLM's --structured-outputs-config backend 'guidance')"),
    (("--pipeline-parallel-size", "-pp"), dict(type=int, default=None),
     "1 is the only pipeline size: devices are split by tensor parallelism"),
    (("--preemption-mode",), dict(default=None),
     "preempted requests are always recomputed"),
]
# Server-only (not engine) flags that do nothing here.
FRONTEND_NOOP_FLAGS: list[tuple[tuple[str, ...], dict[str, Any], str]] = [
    (("--disable-log-requests",), _STORE_TRUE,
     "request contents are never logged (the one access-log line per request: --disable-access-log)"),
    (("--uvicorn-log-level",), dict(choices=["critical", "error", "warning", "info", "debug", "trace"], default=None),
     "the HTTP server is aiohttp, logging through the 'jaxserve' logger"),
]
# flag -> (value check or None: any value is refused, reason)
REFUSED_FLAGS: dict[str, tuple[Any, str]] = {
    "--limit-mm-per-prompt": (None, "multimodal inputs are not supported; jaxserve serves text-only decoders"),
    "--speculative-model": (None, "vLLM removed it; use --speculative-config "
                                  "'{\"model\": PATH, \"num_speculative_tokens\": N}'"),
    "--num-speculative-tokens": (None, "vLLM removed it; use --speculative-config "
                                       "'{\"method\": ..., \"num_speculative_tokens\": N}'"),
    "--swap-space": (None, "preempted requests are recomputed, never swapped to host memory (with "
                           "--kv-offloading-size their full blocks come back from the host KV tier)"),
}
_NOOP_VALUES = {"--pipeline-parallel-size": ("1",), "--preemption-mode": ("recompute",)}
_NOOP_REFUSALS = {"--pipeline-parallel-size": "pipeline parallelism is not supported; split the devices with "
                                              "--tensor-parallel-size (or several nodes with --nnodes)",
                  "--preemption-mode": "preempted requests are recomputed, never swapped"}

DTYPE_ALIASES = {"half": "float16", "float": "float32"}
LOAD_FORMAT_ALIASES = {"safetensors": ("auto", None), "gguf": ("auto", None),
                       "fastsafetensors": ("auto", "safetensors are read by jaxserve's own loader")}


def _dest(flags: tuple[str, ...]) -> str:
    return "_compat_" + next(f for f in flags if f.startswith("--")).lstrip("-").replace("-", "_")


def _refuse(reason: str):
    class Refuse(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            raise argparse.ArgumentError(self, reason)
    return Refuse


def _checked_noop(allowed: tuple[str, ...], reason: str):
    class Checked(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            if str(values) not in allowed:
                raise argparse.ArgumentError(self, f"{values!r}: {reason}")
            setattr(namespace, self.dest, values)
    return Checked


def _add(group, flags, kwargs, why):
    kwargs = dict(kwargs)
    flag = next(f for f in flags if f.startswith("--"))
    if flag in _NOOP_VALUES:
        kwargs["action"] = _checked_noop(_NOOP_VALUES[flag], _NOOP_REFUSALS[flag])
        kwargs.pop("type", None)
    if kwargs.get("action") != "store_true" and "choices" not in kwargs:
        kwargs.setdefault("metavar", flag.lstrip("-").replace("-", "_").upper())
    group.add_argument(*flags, dest=_dest(flags), help=f"Accepted for vLLM command lines; no effect: {why}.",
                       **kwargs)


def add_engine_compat_arguments(parser: argparse.ArgumentParser) -> None:
    """The vLLM engine flags that do nothing here (a warning) or are refused (an error naming why)."""
    g = parser.add_argument_group("vLLM compatibility", "vLLM flags accepted with a warning (no effect here) "
                                                        "or refused with the reason.")
    for flags, kwargs, why in NOOP_FLAGS:
        _add(g, flags, kwargs, why)
    for flag, (_, reason) in REFUSED_FLAGS.items():
        g.add_argument(flag, nargs="*", action=_refuse(reason), dest=_dest((flag,)), default=None,
                       metavar="VALUE",
                       help=f"Refused: {reason}.")


def add_frontend_compat_arguments(parser: argparse.ArgumentParser) -> None:
    g = next((a for a in parser._action_groups if a.title == "vLLM compatibility"), None) or \
        parser.add_argument_group("vLLM compatibility")
    for flags, kwargs, why in FRONTEND_NOOP_FLAGS:
        _add(g, flags, kwargs, why)


def max_model_len(text: str) -> int | str:
    """--max-model-len: a token count (1k, 32K, ...), or 'auto' / -1 (the model's own length)."""
    from jaxserve.server.cli.flags import _bytes
    if str(text).strip().lower() in ("auto", "-1"):
        return "auto"
    return _bytes(text)


def normalize_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--max_model_len 8` -> `--max-model-len 8` where the dashed flag exists in `parser` or one of its
    subcommands (an unknown underscore flag is left as typed, so the error shows it); vLLM's dotted
    `-O.level 3` / `--compilation-config.level=3` -> `-O .level=3`."""
    known = set(_option_strings(parser))
    out: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        for prefix in ("-O.", "--compilation-config."):     # vLLM's dotted -O.level=3 / -O.level 3
            if token.startswith(prefix):
                key = token[len(prefix) - 1:]
                if "=" not in key:
                    key += "=" + next(tokens, "")
                out += ["-O", key]
                break
        else:
            out.append(_dashed(token, known))
    return out


def _dashed(token: str, known: set[str]) -> str:
    if token.startswith("--") and "_" in token:
        name, eq, value = token.partition("=")
        if name.replace("_", "-") in known:
            return name.replace("_", "-") + eq + value
    return token


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    out = []
    for action in parser._actions:
        out.extend(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.extend(_option_strings(sub))
    return out


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, with vLLM's spellings normalised and an unknown flag named with the closest known
    one. `apply` (after --config has filled in) then warns and maps the aliases."""
    ns, extra = parser.parse_known_args(normalize_argv(argv, parser))
    sub = getattr(ns, "_subparser", None) or parser
    if extra:
        known = [o for o in _option_strings(sub) if o.startswith("--")]
        parts = []
        for token in extra:
            name = token.split("=", 1)[0]
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6) if name.startswith("-") else []
            parts.append(f"{token} (did you mean {close[0]}?)" if close else token)
        sub.error("unrecognized arguments: " + " ".join(parts))
    return ns


def apply(ns: argparse.Namespace) -> None:
    """Warn once for each no-op flag given; map vLLM's aliases onto jaxserve's values (in place). A
    ValueError names a refused flag that came from a --config file (on the command line argparse refuses
    it)."""
    for flag, (_, reason) in REFUSED_FLAGS.items():
        if getattr(ns, _dest((flag,)), None) is not None:
            raise ValueError(f"argument {flag}: {reason}")
    for flags, _, why in NOOP_FLAGS + FRONTEND_NOOP_FLAGS:
        dest = _dest(flags)
        if getattr(ns, dest, None) is not None:
            value = getattr(ns, dest)
            shown = "/".join(flags) + ("" if value is True or value == "" else f" {value}")
            logger.warning("%s is accepted for vLLM command lines and does nothing here: %s", shown, why)
    if getattr(ns, "max_model_len", None) == "auto":
        logger.warning("--max-model-len auto is accepted for vLLM command lines and does nothing here: the "
                       "model's own context length is used, as without the flag")
        ns.max_model_len = None
    if getattr(ns, "dtype", None) in DTYPE_ALIASES:
        ns.dtype = DTYPE_ALIASES[ns.dtype]
    if getattr(ns, "load_format", None) in LOAD_FORMAT_ALIASES:
        value, why = LOAD_FORMAT_ALIASES[ns.load_format]
        if why:
            logger.warning("--load-format %s is accepted for vLLM command lines and does nothing here: %s",
                           ns.load_format, why)
        ns.load_format = value
    origins = getattr(ns, "allowed_origins", None)
    if origins and len(origins) == 1 and origins[0].lstrip().startswith("["):
        ns.allowed_origins = json_list("allowed_origins", origins[0])


def apply_or_exit(ns: argparse.Namespace) -> None:
    """`apply`, a ValueError being the subcommand's usage error (exit 2)."""
    try:
        apply(ns)
    except ValueError as e:
        ns._subparser.error(str(e))


def json_list(field: str, text: str) -> list[str]:
    """vLLM's JSON-list flag values ('["https://a.example", "https://b.example"]')."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--{field.replace('_', '-')}: not a valid JSON list: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"--{field.replace('_', '-')} must be a JSON list of strings, got {text!r}")
    return value
