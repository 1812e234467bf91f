"""`jaxserve` command line: `serve`, `generate` and any registered subcommand (`run-batch`).

Each subcommand is registered in this file with `register_subcommand(name, help, add_arguments,
run)` (or `register_module(name, help, module)`); `run(namespace) -> int` is the exit code. The
subcommands live in their own modules: serve.py, offline.py (generate, export-model, quantize),
compile.py; the flags they share (the engine's) in flags.py.
`--config config.yaml` takes flag names as keys (dashes or underscores); the command line wins.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
from collections.abc import Callable

from jaxserve.server.cli import compat, help_search, offline, serve


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


def register_module(name: str, help: str, module: str) -> None:
    """A subcommand whose `add_arguments(parser)` and `run(namespace) -> int` live in `module`
    (imported when the parser is built, not when this file is)."""
    register_subcommand(name, help, lambda p: importlib.import_module(module).add_arguments(p),
                        lambda ns: importlib.import_module(module).run(ns))


register_subcommand("serve", "Start the OpenAI-compatible HTTP server.", serve.add_arguments, serve.run)
register_subcommand("generate", "Generate completions for one or more prompts (offline).",
                    offline.generate_arguments, offline.generate)
register_subcommand("export-model", "Write a model (default: the embedded one) as a Hugging Face "
                    "directory for other tools.", offline.export_arguments, offline.export)
register_subcommand("quantize", "Write a calibrated FP8 checkpoint (GPTQ rounding, compressed-tensors) of a "
                    "model (default: the embedded one).", offline.quantize_arguments, offline.quantize)
register_module("run-batch", "Run an OpenAI Batch JSONL file through the engine offline.",
                "jaxserve.server.batch.runner")
register_module("compile", "Compile the engine's programs ahead of time for an H100/H200 (on any machine) "
                "or this CPU, with a report; serve them with --compiled-dir.", "jaxserve.server.cli.compile")
register_module("train-eagle3", "Train an EAGLE-3 speculative decoding head for a model (default: the embedded "
                "one) on its own answers, with optax; serve it with --speculative-config.",
                "jaxserve.server.cli.train_eagle3")
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
