"""The compile gate (.ci/gpu_compile): the engine's programs compiled for an H100 on this CPU machine.

  (a) every shipped GPU kernel configuration compiles alone, with 0 spill bytes (a configuration
      that spills leaves its kernel's table);
  (b) the step programs of the representative configurations compile (CI's subset: the smallest
      and largest decode buckets and the largest bucket; `jaxserve compile` does all of them), fit an
      H100 at --gpu-memory-utilization 0.9 with KV for a max_model_len sequence, and the report is
      written.

  (c) the GPU-step issue's targets: 0 host synchronisation points in every program, and the
      modeled HBM bytes of Llama-3.1-8B bf16 decode at batch 1 and 256 within 1.15x of the minimum
      (`TARGETS`); at TP 8 (70B) the collectives of decode at batch 1 and 256 within 1.1x of
      their bf16 minimum (`COLLECTIVE_TARGETS`).
Run with Python 3.12, jax 0.11.2 and the jax-cuda13-plugin / jax-cuda13-pjrt wheels:
    python tools/gpu_compile_gate.py --out DIR [--only NAME ...] [--programs all] [--jobs N]
--jobs N compiles N parts at once, each in its own process (CI: 2, one per core).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")                  # before jax starts
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "benchmarks" / "configs"
MAX_MODEL_LEN = 8192

# name -> (model config directory, EngineArgs overrides)
CONFIGURATIONS = {
    "llama-3.1-8b-bf16": ("llama-3.1-8b", {}),
    "llama-3.1-8b-fp8": ("llama-3.1-8b", {"quantization": "fp8"}),
    # the XLA reference attention (the fallback: gpt-oss, MLA, head dims the kernels do not take)
    "llama-3.1-8b-reference": ("llama-3.1-8b", {"attention_backend": "reference"}),
    "llama-3.1-8b-awq": ("llama-3.1-8b-awq", {}),
    # --cpu-offload-gb: the MLP stacks in host memory, each layer's copied in a layer ahead
    "llama-3.1-8b-offload8": ("llama-3.1-8b", {"cpu_offload_gb": 8.0}),
    "qwen3-30b-a3b-ep2": ("qwen3-30b-a3b", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    "llama-3.1-70b-tp8": ("llama-3.1-70b", {"tensor_parallel_size": 8}),
}

# (configuration, program) -> the largest modeled / minimum HBM bytes allowed
TARGETS = {("llama-3.1-8b-bf16", "step_1"): 1.15, ("llama-3.1-8b-bf16", "step_256"): 1.15}
# (configuration, program) -> the largest collective bytes / their bf16 minimum allowed
COLLECTIVE_TARGETS = {("llama-3.1-70b-tp8", "step_1"): 1.1, ("llama-3.1-70b-tp8", "step_256"): 1.1}


def check_targets(reports: dict) -> list[str]:
    """(c): each program's host syncs, and the ratios `TARGETS` and `COLLECTIVE_TARGETS` name."""
    problems = []
    for name, r in reports.items():
        for p in r["programs"]:
            if not p["compiled"]:
                continue
            if p["host_syncs"]:
                problems.append(f"{name}/{p['name']}: {p['host_syncs']} host synchronisation points: "
                                f"{p['host_sync_points']}")
            limit = TARGETS.get((name, p["name"]))
            if limit is not None and p["bytes_ratio"] > limit:
                problems.append(f"{name}/{p['name']}: modeled HBM bytes {p['bytes_ratio']}x the minimum "
                                f"(target <= {limit}x); its largest: {p['top'][:3]}")
            limit = COLLECTIVE_TARGETS.get((name, p["name"]))
            if limit is not None and (p.get("collective_ratio") or 0) > limit:
                problems.append(f"{name}/{p['name']}: collectives move {p['collective_ratio']}x their bf16 minimum "
                                f"(target <= {limit}x): {p['collectives']}")
    return problems


def gate_kernels(out: Path) -> list[str]:
    from jaxserve.aot.kernels import format_report, kernel_report
    from jaxserve.aot.targets import get_target
    t0 = time.perf_counter()
    rows = kernel_report(get_target("h100"))
    (out / "kernels.json").write_text(json.dumps(rows, indent=1, default=str))
    (out / "kernels.md").write_text(format_report(rows))
    print(format_report(rows))
    print(f"kernels: {len(rows)} configurations in {time.perf_counter() - t0:.0f} s")
    problems = []
    for r in rows:
        where = f"{r['name']} {r['config']}"
        if not r["compiled"]:
            problems.append(f"{where}: did not compile: {r['error']}")
        elif r.get("registers") is None:
            problems.append(f"{where}: no register figures ({r.get('error')})")
        elif r.get("spill_bytes"):
            problems.append(f"{where}: spills {r['spill_bytes']} bytes")
    return problems


def gate_configuration(name: str, out: Path, programs: str) -> tuple[list[str], dict]:
    from jaxserve.aot.compiler import compile_engine
    from jaxserve.config import EngineArgs
    model, overrides = CONFIGURATIONS[name]
    args = EngineArgs(model=str(CONFIGS / model), load_format="dummy", max_model_len=MAX_MODEL_LEN, **overrides)
    report = compile_engine(args, "h100", out / name, programs=programs, hlo=False)
    problems = [f"{name}/{p['name']}: {p['error']}" for p in report["programs"] if not p["compiled"]]
    mc = report["memory_check"]
    if not mc.get("fits"):
        problems.append(f"{name}: does not fit an H100 at 0.9 ({mc})")
    if not (out / name / "report.json").is_file():
        problems.append(f"{name}: no report written")
    return problems, report


def summary(reports: dict) -> str:
    lines = ["| configuration | program | args GB | temp GB | host syncs | modeled / min bytes | "
             "collectives / bf16 min |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in reports.items():
        for p in r["programs"]:
            if p["compiled"]:
                lines.append(f"| {name} | {p['name']} | {p['memory']['argument'] / 1e9:.2f} | "
                             f"{p['memory']['temp'] / 1e9:.2f} | {p['host_syncs']} | {p['bytes_ratio']} | "
                             f"{p.get('collective_ratio') or '-'} |")
    return "\n".join(lines) + "\n"


def _gate_part(name: str, out: Path, programs: str) -> tuple[list[str], dict | None, str]:
    """One part of the gate ("kernels" or a configuration), in a worker process when --jobs > 1."""
    t1 = time.perf_counter()
    if name == "kernels":
        return gate_kernels(out), None, ""
    found, report = gate_configuration(name, out, programs)
    return found, report, f"{name}: {len(report['programs'])} programs in {time.perf_counter() - t1:.0f} s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="*", help=f"configurations (default all): {', '.join(CONFIGURATIONS)}, kernels")
    ap.add_argument("--programs", choices=("ci", "all"), default="ci")
    ap.add_argument("--jobs", type=int, default=1, help="parts compiled at once, each in its own process")
    ns = ap.parse_args(argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = ns.only or ["kernels", *CONFIGURATIONS]
    problems, reports = [], {}
    t0 = time.perf_counter()
    if ns.jobs > 1:       # spawned workers: each starts its own jax (XLA compiles mostly on one core)
        import concurrent.futures
        import multiprocessing
        with concurrent.futures.ProcessPoolExecutor(
                ns.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = [pool.submit(_gate_part, name, out, ns.programs) for name in wanted]
            results = [part.result() for part in parts]
    else:
        results = [_gate_part(name, out, ns.programs) for name in wanted]
    for name, (found, report, line) in zip(wanted, results):
        problems += found
        if report is not None:
            reports[name] = report
            print(line)
    problems += check_targets(reports)
    table = summary(reports)
    (out / "summary.md").write_text(table)
    print(table)
    print(f"compile gate: {time.perf_counter() - t0:.0f} s")
    for p in problems:
        print("FAIL:", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
