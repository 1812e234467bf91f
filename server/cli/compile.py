"""`jaxserve compile [MODEL flags] --target h100|h200|cpu --out DIR`: the engine's step programs
compiled ahead of time for a GPU (from any machine, no GPU needed) or this CPU, with a report
(jaxserve/aot). `serve`/`run-batch`/`LLM` start from DIR with `--compiled-dir DIR`."""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from jaxserve.server.cli.flags import add_engine_args
    add_engine_args(p)
    p.add_argument("--target", required=True, choices=("h100", "h200", "cpu"),
                   help="What to compile for: an H100 SXM or H200 (compile-only devices: needs the "
                        "jax-cuda13-plugin and jax-cuda13-pjrt wheels of jax's version, no GPU), or this CPU.")
    p.add_argument("--out", required=True, metavar="DIR", help="Where the executables, HLO and report go.")
    p.add_argument("--programs", choices=("all", "ci"), default="all",
                   help="all: every program the engine builds at start-up; ci: the smallest and largest "
                        "decode buckets and the largest bucket (default: all).")
    p.add_argument("--no-hlo", action="store_true", help="Do not write each program's optimized HLO text.")
    p.add_argument("--kernels", action="store_true",
                   help="Also compile every shipped GPU kernel configuration alone and report its registers, "
                        "spill bytes, shared memory and CTAs per SM (GPU targets).")


def run(ns: argparse.Namespace) -> int:
    # The CUDA plugin checks for CUDA libraries when jax starts unless told not to: a compile-only
    # target needs none. (Before anything touches a jax backend.)
    if ns.target != "cpu":
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jaxserve.aot.compiler import compile_engine
    from jaxserve.aot.report import markdown
    from jaxserve.server.cli.flags import engine_args_from
    args = engine_args_from(ns, compilation_cache_dir="")
    try:
        report = compile_engine(args, ns.target, ns.out, programs=ns.programs, hlo=not ns.no_hlo,
                                kernels=ns.kernels)
    except (OSError, ValueError) as e:
        print(f"jaxserve compile: {e}", file=sys.stderr)
        return 2
    print(markdown(report))
    failed = [p["name"] for p in report["programs"] if not p["compiled"]]
    if failed:
        print(f"jaxserve compile: {len(failed)} program(s) failed to compile: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"wrote {len(report['programs'])} programs and report.md to {ns.out}; start from them with "
          f"--compiled-dir {ns.out}")
    return 0
