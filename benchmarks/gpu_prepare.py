"""Everything benchmarks/gpu_suite.sh needs on the GPU machine that can be made here, so that the
lent machine's 15 minutes go to measuring: the wheels the image lacks (gpu_wheels.sh), the
engine's step programs compiled ahead of time for each configuration the suite runs (jaxserve.aot
`compile_engine`, for an H100 and an H200: the lent machine may be either, and a program's key
holds the device kind), and the CPU reference of the parity stage. Run it HERE, in the Python 3.12
venv with jax 0.11.2 + jax-cuda13-plugin/pjrt 0.11.2 (the GPU image's versions: the key holds them):

    PYTHON=~/.cache/jaxserve-ci/py312/bin/python
    $PYTHON benchmarks/gpu_prepare.py                 # .whl/ and .gpu/bundle.tar.xz (~30 min on 2 cores)
    $PYTHON benchmarks/gpu_prepare.py --dry-run --out DIR --work DIR2   # CPU targets, tiny shapes (CI)

Output (git-ignored): `.gpu-build/<config>-<target>/` (each a `jaxserve compile` directory plus
engine.json: the exact engine arguments; a directory whose engine.json and manifest are current is
reused), `.gpu-build/parity_ref.json`, and what the device call carries: `.gpu/bundle.tar.xz` (the
executables, engine.json files and the reference; xz halves the executables) and
`.gpu/bundle.json` (what it holds, the budget figures).

The programs' key holds a fingerprint of jaxserve's source (`jaxserve.aot.store.code_fingerprint`):
run this right before the device call, with no change to jaxserve/ in between (the suite's env
stage compares the fingerprints and says so; a mismatch means every engine compiles). It fails
loudly when the working tree, .whl and .gpu together exceed CARRY_LIMIT_MIB (the device tool
sends at most 64 MiB).

The configurations (CONFIGS) keep the bucket list short: max_num_batched_tokens 256 with
max_num_seqs 256 gives token buckets 1, 2, 16, ..., 256: 12 step programs per configuration (7
plain, 5 with prompt logprobs), 0.3-0.55 MB each for the 8B model; an 8B configuration takes ~130 s
to compile for one target alone, 240-420 s two at a time beside another job (2026-11-27).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

# This machine's CPU only (a GPU target is compile-only devices; the CUDA plugin needs no CUDA).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
REPO = Path(__file__).resolve().parent.parent
TINY = "tests/data/tiny-llama"
L8B = "benchmarks/configs/llama-3.1-8b"
L8B_2 = "benchmarks/configs/llama-3.1-8b-2layer"
CARRY_LIMIT_MIB = 60          # the device tool's 64 MiB, less a margin for what the tree gains meanwhile
BUNDLE = "bundle.tar.xz"

# name -> (parity reference it is checked against or None, engine arguments). Context 1024 + 16
# timed steps + slack for the decode stages, 512 + 256 for the throughput stage: 1056 tokens.
_PARITY = dict(load_format="dummy", dtype="bfloat16", seed=0, max_model_len=256, max_num_seqs=4,
               max_num_batched_tokens=64, num_gpu_blocks_override=64)
# The pool is fixed (num_gpu_blocks_override), not sized from the target's memory: a pool compiled for
# 0.9 x the card would not fit jax's default allocation (0.75 of it) on the lent machine, and the
# engine would then size its own pool, miss the key and compile everything. 17408 blocks of 16
# tokens hold 256 requests of 1056 tokens (36.5 GB in bf16): fits beside the 16 GB of weights on an
# H100 and an H200 alike, the same programs for both.
_8B = dict(model=L8B, load_format="dummy", dtype="bfloat16", seed=0, max_model_len=1056, max_num_seqs=256,
           max_num_batched_tokens=256, num_gpu_blocks_override=17408)
CONFIGS = {
    "tiny-auto": ("tiny", dict(model=TINY, **_PARITY)),
    "tiny-mosaic": ("tiny", dict(model=TINY, **_PARITY, attention_backend="mosaic")),
    "8b2l-auto": ("8b2l", dict(model=L8B_2, **_PARITY)),
    "8b2l-mosaic": ("8b2l", dict(model=L8B_2, **_PARITY, attention_backend="mosaic")),
    "8b-bf16-auto": (None, dict(_8B)),
    "8b-fp8-auto": (None, dict(_8B, quantization="fp8")),
    "8b-bf16-mosaic": (None, dict(_8B, attention_backend="mosaic")),
    "8b-fp8-mosaic": (None, dict(_8B, quantization="fp8", attention_backend="mosaic")),
}
# DRY_RUN (CPU, CI): the same names, tiny shapes, a handful of buckets (1, 2, 16: 4 programs);
# Mosaic becomes the reference path (interpreting Mosaic GPU on CPU takes minutes a step).
_DRY = dict(model=TINY, load_format="dummy", dtype="float32", seed=0, max_model_len=128, max_num_seqs=4,
            max_num_batched_tokens=16, num_gpu_blocks_override=64)
DRY_CONFIGS = {
    name: (parity, dict(_DRY, **({"quantization": "fp8"} if "fp8" in name else {}),
                        **({"attention_backend": "reference"} if "mosaic" in name else {})))
    for name, (parity, _) in CONFIGS.items()
}
PARITY_MODELS = {"tiny": TINY, "8b2l": L8B_2}


def configs(dry: bool) -> dict:
    return DRY_CONFIGS if dry else CONFIGS


def compile_one(name: str, target: str, out: Path, dry: bool) -> dict:
    """One configuration for one target (run in a process of its own: JAX_PLATFORMS=cpu)."""
    from jaxserve.aot.compiler import compile_engine
    from jaxserve.config import EngineArgs
    parity, kwargs = configs(dry)[name]
    engine = dict(kwargs, model=str(kwargs["model"]))
    t0 = time.perf_counter()
    report = compile_engine(EngineArgs(**{**engine, "model": str(REPO / engine["model"])}), target, out,
                            programs="all", hlo=False)
    failed = [p["name"] for p in report["programs"] if not p["compiled"]]
    if failed:
        raise SystemExit(f"{name} for {target}: programs failed to compile: {', '.join(failed)}")
    # engine.json last: its presence says the directory is complete
    (out / "engine.json").write_text(json.dumps({"config": name, "target": target, "parity": parity,
                                                 "engine": engine}, indent=1))
    return {"seconds": round(time.perf_counter() - t0, 1), "programs": len(report["programs"]),
            "num_blocks": report["num_blocks"], "attention_backend": report["attention_backend"]}


def _current(out: Path, name: str, target: str, dry: bool) -> bool:
    try:
        meta = json.loads((out / "engine.json").read_text())
        manifest = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    if meta.get("engine") != dict(configs(dry)[name][1]) or meta.get("target") != target:
        return False
    key = manifest["key"]
    import jax  # noqa: PLC0415 - the versions the key must hold

    from jaxserve.aot.store import code_fingerprint
    try:
        programs = [p["name"] for p in json.loads((out / "report.json").read_text())["programs"]]
    except (OSError, ValueError, KeyError):
        return False
    # the key holds jaxserve's source fingerprint: programs compiled by other code are never loaded
    return (key.get("jax") == jax.__version__ and key.get("jaxserve") == code_fingerprint()
            and all((out / f"{p}.exe").is_file() for p in programs))


def parity_reference(work: Path, dry: bool) -> Path:
    """The parity requests on this CPU: bf16 (what the GPU runs, the reference) and f32 (the
    tolerance: a GPU figure may differ from the bf16 reference by up to 4x what bf16 rounding
    alone moves it here, and at least 0.02)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_gpu_e2e import PARITY_LENS, PARITY_NEW_TOKENS, parity_compare, parity_run

    from jaxserve import LLM
    path = work / "parity_ref.json"
    refs, by_args = {}, {}
    for model_name in PARITY_MODELS:
        parity_cfg = next(kw for p, kw in configs(dry).values() if p == model_name)
        base = {k: v for k, v in parity_cfg.items() if k not in ("attention_backend", "dtype")}
        key = json.dumps(base, sort_keys=True)
        if key in by_args:          # the dry run's models are one tiny model
            refs[model_name] = by_args[key]
            continue
        runs = {}
        for dtype in ("bfloat16", "float32"):
            t0 = time.perf_counter()
            llm = LLM(**dict(base, model=str(REPO / base["model"]), dtype=dtype))
            runs[dtype] = parity_run(llm)
            llm.shutdown()
            print(f"parity reference {model_name} {dtype}: {time.perf_counter() - t0:.0f} s", flush=True)
        m = parity_compare(runs["bfloat16"], runs["float32"])
        tol = max(4 * max(m["max_prompt_lp_diff"], m["max_gen_lp_diff"]), 0.02)
        refs[model_name] = by_args[key] = {"rows": runs["bfloat16"], "tolerance": round(tol, 4), "bf16_vs_f32": m}
    about = (f"this CPU's engine, bf16 (dummy weights, seed 0), {len(PARITY_LENS)} prompts of "
             f"{'/'.join(map(str, PARITY_LENS))} tokens + {PARITY_NEW_TOKENS} greedy tokens; tolerance 4x the "
             "bf16-vs-f32 difference on the CPU (at least 0.02)")
    from jaxserve.aot.store import code_fingerprint
    path.write_text(json.dumps({"about": about, "configs": refs, "code_fingerprint": code_fingerprint()}))
    return path


def tree_bytes() -> int:
    """What the device call sends besides the carried paths: tracked and untracked-not-ignored files."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.split(b"\0")
    return sum((REPO / f.decode()).stat().st_size for f in files if f and (REPO / f.decode()).is_file())


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="h100,h200", help="comma list of h100, h200 (cpu with --dry-run)")
    ap.add_argument("--dry-run", action="store_true", help="CPU target, tiny shapes: what DRY_RUN=1 runs")
    ap.add_argument("--out", default=str(REPO / ".gpu"), help="what the device call carries (bundle)")
    ap.add_argument("--work", default=str(REPO / ".gpu-build"), help="compiled directories (not carried)")
    ap.add_argument("--jobs", type=int, default=2, help="compiles at a time (one process each)")
    ap.add_argument("--only", default=None, help="comma list of configuration names")
    ap.add_argument("--no-wheels", action="store_true", help="do not run gpu_wheels.sh (.whl/ as it is)")
    ap.add_argument("--compile-one", nargs=3, metavar=("NAME", "TARGET", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.compile_one:
        name, target, out = args.compile_one
        print(json.dumps(compile_one(name, target, Path(out), args.dry_run)))
        return 0

    t_start = time.perf_counter()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    targets = ["cpu"] if args.dry_run else [t for t in args.targets.split(",") if t]
    names = list(configs(args.dry_run)) if not args.only else args.only.split(",")
    if not args.dry_run and not args.no_wheels:
        subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_wheels.sh")], check=True,
                       env=dict(os.environ, PYTHON=os.environ.get("WHEELS_PYTHON", sys.executable)))

    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", PYTHONUNBUFFERED="1")
    jobs, done, copies = [], {}, []
    first = {}              # identical engine arguments (the dry run's) compile once, then are copied
    for name in names:
        for target in targets:
            d = work / f"{name}-{target}"
            if _current(d, name, target, args.dry_run):
                done[d.name] = {"reused": True}
                continue
            same = first.setdefault((json.dumps(configs(args.dry_run)[name][1], sort_keys=True), target), d)
            if same is d:
                jobs.append((name, target, d))
            else:
                copies.append((name, target, d, same))

    def run(job):
        name, target, d = job
        cmd = [sys.executable, __file__, "--compile-one", name, target, str(d)]
        cmd += ["--dry-run"] if args.dry_run else []
        t0 = time.perf_counter()
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            return d.name, {"error": (p.stderr or p.stdout)[-2000:]}
        info = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"compiled {d.name}: {info['programs']} programs in {time.perf_counter() - t0:.0f} s "
              f"({info['attention_backend']}, {info['num_blocks']} KV blocks)", flush=True)
        return d.name, info

    print(f"compiling {len(jobs)} configuration(s) x target ({len(done)} current, reused), {args.jobs} at a time",
          flush=True)
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for key, info in pool.map(run, jobs):
            done[key] = info
    for name, _target, d, same in copies:
        if "error" not in done.get(same.name, {}):
            shutil.rmtree(d, ignore_errors=True)
            shutil.copytree(same, d)
            meta = json.loads((d / "engine.json").read_text())
            (d / "engine.json").write_text(json.dumps(dict(meta, config=name, parity=configs(args.dry_run)[name][0]),
                                                      indent=1))
            done[d.name] = {"copy_of": same.name}
    failed = {k: v["error"] for k, v in done.items() if "error" in v}
    for k, e in failed.items():
        print(f"FAILED {k}:\n{e}", file=sys.stderr)
    if failed:
        return 1
    t_compiled = time.perf_counter()

    ref = work / "parity_ref.json"
    from jaxserve.aot.store import code_fingerprint
    try:
        stale = json.loads(ref.read_text()).get("code_fingerprint") != code_fingerprint()
    except (OSError, ValueError):
        stale = True
    if stale:                   # the CPU engine's figures of this source
        ref = parity_reference(work, args.dry_run)
    t_ref = time.perf_counter()

    bundle = out / BUNDLE
    tmp = bundle.with_suffix(".tmp")
    with tarfile.open(tmp, "w:xz", preset=6) as tar:
        tar.add(ref, arcname="parity_ref.json")
        for name in names:
            for target in targets:
                d = work / f"{name}-{target}"
                for f in sorted(d.iterdir()):
                    if f.suffix in (".exe", ".json") or f.name == "report.md":
                        tar.add(f, arcname=f"{d.name}/{f.name}")
    tmp.replace(bundle)
    sizes = {"tree": tree_bytes(), "whl": dir_bytes(REPO / ".whl"), "bundle": bundle.stat().st_size,
             "executables_unpacked": sum(dir_bytes(work / f"{n}-{t}") for n in names for t in targets)}
    total = sizes["tree"] + sizes["whl"] + sizes["bundle"]
    meta = {"configs": names, "targets": targets, "dry_run": args.dry_run, "code_fingerprint": code_fingerprint(),
            "sizes": sizes, "carried_bytes": total,
            "carry_limit_bytes": CARRY_LIMIT_MIB << 20,
            "seconds": {"compile": round(t_compiled - t_start, 1), "parity_reference": round(t_ref - t_compiled, 1),
                        "bundle": round(time.perf_counter() - t_ref, 1)},
            "compiled": done}
    (out / "bundle.json").write_text(json.dumps(meta, indent=1))
    mib = {k: round(v / 2**20, 1) for k, v in sizes.items()}
    print(f"bundle {bundle}: {mib['bundle']} MiB ({mib['executables_unpacked']} MiB unpacked); carried in all: "
          f"tree {mib['tree']} + .whl {mib['whl']} + bundle {mib['bundle']} = {total / 2**20:.1f} MiB "
          f"(limit {CARRY_LIMIT_MIB} MiB); {time.perf_counter() - t_start:.0f} s")
    if total > CARRY_LIMIT_MIB << 20:
        print(f"gpu_prepare: what the device call carries is {total / 2**20:.1f} MiB, over {CARRY_LIMIT_MIB} MiB: "
              "fewer configurations or targets (--only, --targets)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
