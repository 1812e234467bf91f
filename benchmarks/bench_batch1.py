"""Batch 1 on CPU: greedy tokens/s of one request on the default model (SmolLM2-135M GGUF, f32),
and where a decode step's time goes.

    python benchmarks/bench_batch1.py                         # this tree
    python benchmarks/bench_batch1.py --against REV           # also the tree at git REV, A B A B

For each tree (a subprocess with that tree on PYTHONPATH; `--against` extracts REV with
`git archive` into a temporary folder) it loads `LLM()` with default flags (warm-up off: only the
programs used get compiled), generates `--tokens` greedy tokens (EOS ignored) from a short prompt
once to compile, then `--repeats` timed times, and reports the best tokens/s. With `--profile` the
decode step is split: one recorded batch-1 decode StepInputs is replayed through jitted pieces of
the step (the layer stack, the lm_head on the sampler rows, the sampler) and the whole step, and
the engine's host time per token is what the end-to-end time adds on top of the whole step.
The generated tokens of both trees are compared (greedy must not change).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "The history of the printing press begins in the fifteenth century, when"

_CHILD = r"""
import json, sys, time
import jax, numpy as np
from jaxserve import LLM, SamplingParams
cfg = json.loads(sys.argv[1])
llm = LLM(warmup=False)
sp = SamplingParams(temperature=0.0, max_tokens=cfg["tokens"], ignore_eos=True)
llm.generate(cfg["prompt"], sp, use_tqdm=False)         # compiles what batch 1 uses
best, tokens = 0.0, None
for _ in range(cfg["repeats"]):
    t0 = time.perf_counter()
    out = llm.generate(cfg["prompt"], sp, use_tqdm=False)[0]
    s = time.perf_counter() - t0
    n = len(out.outputs[0].token_ids)
    best, tokens = max(best, n / s), out.outputs[0].token_ids
res = {"tok_s": best, "tokens": list(tokens), "ms_per_token": 1e3 / best}
runner = llm.llm_engine.runner
if cfg["profile"]:
    # One decode step's inputs at batch 1: record them while generating.
    seen = []
    orig = runner.prepare
    def prepare(*a, **k):
        out = orig(*a, **k)
        seen.append(out[0])
        return out
    runner.prepare = prepare
    llm.generate(cfg["prompt"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    del runner.prepare
    x = seen[-1]
    model, mc = runner._model, runner.cfg
    def timeit(fn, *a, n=20):
        jax.block_until_ready(fn(*a))
        ts = []
        for _ in range(n):
            t0 = time.perf_counter(); jax.block_until_ready(fn(*a)); ts.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(ts))
    # The cache is donated and threaded through, as in the step (else each call copies it).
    fwd = jax.jit(lambda w, c, x: model.forward(w, c, x.tokens, x.positions, x.meta, cfg=mc,
                                                backend="reference", plan=runner.plan),
                  donate_argnums=(1,))
    def layers():
        hidden, runner.cache = fwd(runner.weights, runner.cache, x)
        return hidden
    hidden = layers()
    rows = hidden[np.asarray(x.logit_rows)]
    head = jax.jit(lambda w, h: model.compute_logits(w, h))
    logits = head(runner.weights, rows)
    from jaxserve.sample.sampler import sample
    smp = jax.jit(lambda l, t, p, b: sample(l, t, p, k=runner.max_logprobs, bitmask=b))
    bitmask = x.bitmask if x.bitmask is not None else runner._all_allowed_mask(len(x.logit_rows))
    exe = runner._executable(len(x.tokens), False)
    def whole():
        out, scores, runner.cache, runner.penalties = exe(runner.weights, runner.cache, runner.penalties, x)
        return out
    res["profile"] = {
        "token bucket T": len(x.tokens), "sampler rows": len(x.logit_rows),
        "whole step (ms)": timeit(whole),
        "layers: forward [T] (ms)": timeit(layers),
        "lm_head on the sampler rows (ms)": timeit(head, runner.weights, rows),
        "sampler, greedy (ms)": timeit(smp, logits, x.sampling, runner.penalties, bitmask),
    }
print("RESULT " + json.dumps(res))
"""


def run_tree(tree: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    cfg = dict(tokens=args.tokens, repeats=args.repeats, prompt=PROMPT, profile=args.profile)
    p = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cfg)], env=env, cwd=tree,
                       capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{tree}: no result (exit {p.returncode}):\n{p.stderr[-3000:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", help="git revision to compare with (A B A B)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two trees")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    here = str(Path(__file__).resolve().parent.parent)
    trees = {"this tree": here}
    if args.against:
        tmp = tempfile.mkdtemp(prefix="bench_batch1_")
        archive = subprocess.run(["git", "-C", here, "archive", args.against], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        (Path(tmp) / "jaxserve" / "server").unlink(missing_ok=True)
        os.symlink(os.path.join(here, "server"), os.path.join(tmp, "jaxserve", "server"))
        trees = {f"git {args.against}": tmp, "this tree": here}
    results = {name: [] for name in trees}
    for r in range(args.rounds if args.against else 1):
        for name, tree in trees.items():
            t0 = time.perf_counter()
            res = run_tree(tree, args)
            results[name].append(res)
            print(f"round {r} {name}: {res['tok_s']:.1f} tok/s ({res['ms_per_token']:.1f} ms/token; "
                  f"{time.perf_counter() - t0:.0f} s with start-up)", flush=True)
            if "profile" in res:
                res["profile"]["engine host time per token (ms)"] = \
                    res["ms_per_token"] - res["profile"]["whole step (ms)"]
                for k, v in res["profile"].items():
                    print(f"    {k}: {v:.2f}" if isinstance(v, float) else f"    {k}: {v}", flush=True)
    best = {n: max(x["tok_s"] for x in v) for n, v in results.items()}
    print(f"\n| tree | best tok/s (batch 1, {args.tokens} greedy tokens) |")
    print("|---|---|")
    for n, v in best.items():
        print(f"| {n} | {v:.1f} |")
    if args.against:
        a, b = (results[n][-1]["tokens"] for n in trees)
        print(f"\nthis tree / {args.against}: {best['this tree'] / best[f'git {args.against}']:.2f}x; "
              f"greedy tokens identical: {a == b}")


if __name__ == "__main__":
    main()
