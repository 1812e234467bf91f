"""The jitted sampler on this machine's CPU: the sorting filters (the sampler at git HEAD, or
`--old REV`) against the working tree's, in one process, at [256 rows, 128256 vocab] f32.

    python benchmarks/bench_sampler.py [--rows 256] [--vocab 128256] [--runs 5] [--old HEAD] [--only CASE]

Cases: every row top_p 0.9 and top_k 50 (temperature 0.7); every row top_p 0.9 alone on peaked
logits (the candidates settle it) and on flat ones (the exact search runs); greedy only; plain
temperature (no filter). Each case alternates old and new `runs` times (A B A B, so drift on a
shared machine hits both alike) after one compiling call each, and reports medians. Both
versions sample the same tokens (checked). Prints a Markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jaxserve.sample import penalties  # noqa: E402
from jaxserve.sample import sampler as new  # noqa: E402


def load_old(rev: str):
    """jaxserve/sample/sampler.py at `rev`, imported as a module of its own."""
    root = pathlib.Path(__file__).resolve().parents[1]
    text = subprocess.run(["git", "show", f"{rev}:jaxserve/sample/sampler.py"], cwd=root,
                          check=True, capture_output=True, text=True).stdout
    path = pathlib.Path(tempfile.mkdtemp()) / "sampler_old.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("sampler_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tensors(mod, R, temperature, top_k=0, top_p=1.0):
    full = lambda v, dt: np.full(R, v, dt)   # noqa: E731
    return mod.SamplingTensors(
        full(temperature, np.float32), full(top_k, np.int32), full(top_p, np.float32),
        full(0.0, np.float32), np.arange(R, dtype=np.uint32), full(3, np.int32),
        slots=full(R, np.int32), penalised=full(False, bool), min_tokens_active=full(False, bool),
        presence=full(0, np.float32), frequency=full(0, np.float32),
        repetition=full(1, np.float32), logprobs=full(False, bool))


def logits_of(kind, R, V, rng):
    """peaked: 8 likely tokens 15-25 above a normal(0, 1.5) background (a chat model's typical
    step: the top 64 hold over 0.9 of the mass); flat: normal(0, 0.5) logits, where top_p 0.9
    needs ~half the vocabulary."""
    x = rng.normal(0, 0.5 if kind == "flat" else 1.5, (R, V)).astype(np.float32)
    if kind == "peaked":
        x[np.arange(R)[:, None], rng.integers(0, V, (R, 8))] += rng.uniform(15, 25, (R, 8))
    return x


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--old", default="HEAD")
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    args = ap.parse_args()
    R, V = args.rows, args.vocab
    old = load_old(args.old)
    rng = np.random.default_rng(0)
    state = penalties.zeros(1, V)
    cases = [("top_p 0.9 + top_k 50", "peaked", dict(temperature=0.7, top_k=50, top_p=0.9)),
             ("top_p 0.9, peaked", "peaked", dict(temperature=0.7, top_p=0.9)),
             ("top_p 0.9, flat (search)", "flat", dict(temperature=0.7, top_p=0.9)),
             ("greedy", "peaked", dict(temperature=0.0)),
             ("temperature 1.0", "peaked", dict(temperature=1.0))]
    rows = []
    for name, kind, params in [c for c in cases if args.only in c[0]]:
        x = jax.device_put(logits_of(kind, R, V, rng))
        fns = {}
        for label, mod in (("old", old), ("new", new)):
            t = tensors(mod, R, **params)
            fn = jax.jit(lambda x, t, mod=mod: mod.sample(x, t, state).token_ids)
            ids = np.asarray(fn(x, t))                        # compile and warm
            fns[label] = (fn, t, ids)
        same = bool((fns["old"][2] == fns["new"][2]).all())
        times = {"old": [], "new": []}
        for _ in range(args.runs):
            for label in ("old", "new"):
                fn, t, _ = fns[label]
                t0 = time.perf_counter()
                jax.block_until_ready(fn(x, t))
                times[label].append(time.perf_counter() - t0)
        o, n = (statistics.median(times[k]) * 1e3 for k in ("old", "new"))
        rows.append(dict(case=name, old_ms=round(o, 1), new_ms=round(n, 1), speedup=round(o / n, 2),
                         same_tokens=same))
        print(f"{name}: old {o:.1f} ms, new {n:.1f} ms ({o / n:.2f}x), same tokens: {same}", flush=True)
    print(f"\n[{R} rows, {V} vocab] f32, jax {jax.__version__}, {jax.default_backend()}, "
          f"median of {args.runs} alternating runs\n")
    print("| case | old ms | new ms | speedup | same tokens |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['old_ms']} | {r['new_ms']} | {r['speedup']}x | {r['same_tokens']} |")
    print(json.dumps(dict(bench="sampler", rows=R, vocab=V, runs=args.runs, results=rows)))


if __name__ == "__main__":
    main()
