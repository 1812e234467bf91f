"""Batch 1 (or `--batch B` sequences) on CPU: greedy tokens/s on the default model (SmolLM2-135M
GGUF, f32), and where a decode step's time goes.

    python benchmarks/bench_batch1.py                         # this tree
    python benchmarks/bench_batch1.py --against REV           # also the tree at git REV, A B A B
    python benchmarks/bench_batch1.py --xla-flags no-ynn=--xla_cpu_experimental_ynn_fusion_type=
                                                              # also this tree under other XLA flags
    python benchmarks/bench_batch1.py --batch 64 --llama-cpp /tmp/peer/venv/bin/python:/tmp/peer/smol-f32.gguf
                                                              # and llama.cpp (peers/batched.py), A B A B
    python benchmarks/bench_batch1.py --batch 64 --engine-args 'invariant={"batch_invariant": true}'
                                                              # also this tree with other LLM() args
    python benchmarks/bench_batch1.py --context 4000 --against REV
                                                              # decode after a 4000-token prompt

For each tree (a subprocess with that tree on PYTHONPATH; `--against` extracts REV with
`git archive` into a temporary folder) it loads `LLM()` with default flags (warm-up off: only the
programs used get compiled), generates `--tokens` greedy tokens (EOS ignored) from a short prompt
once to compile, then `--repeats` timed times, and reports the best tokens/s. With `--batch B`
(or `--llama-cpp`) the prompts are the peer harness's B prompts ("Once upon a time, in a kingdom
by the sea number {i}, there lived", /work/shared/peers/batched.py), all generated together, and
tokens/s counts every sequence's tokens (prefill included, as batched.py times it); `--llama-cpp
PYTHON:GGUF` runs batched.py on that GGUF with B sequences in the same rounds. With `--profile`
the decode step is split: one recorded decode StepInputs (B sequences) is replayed through jitted
pieces of the step (the layer stack, the same with attention skipped, the lm_head on the sampler
rows, the sampler) and the whole step, and the engine's host time per step is what the
end-to-end time adds on top of the whole step. The generated tokens of both trees are compared
(greedy must not change).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "The history of the printing press begins in the fifteenth century, when"
PEER = Path("/work/shared/peers/batched.py")


def peer_prompts(b: int) -> list[str]:
    return [f"Once upon a time, in a kingdom by the sea number {i}, there lived" for i in range(b)]

_CHILD = r"""
import json, sys, time
import jax, numpy as np
from jaxserve import LLM, SamplingParams
cfg = json.loads(sys.argv[1])
llm = LLM(warmup=False, **cfg.get("engine_args", {}))
sp = SamplingParams(temperature=0.0, max_tokens=cfg["tokens"], ignore_eos=True)
prompts = cfg["prompts"]
llm.generate(prompts, sp, use_tqdm=False)         # compiles what this batch uses
best, tokens = 0.0, None
for _ in range(cfg["repeats"]):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    s = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    best, tokens = max(best, n / s), [list(o.outputs[0].token_ids) for o in outs]
res = {"tok_s": best, "tokens": tokens, "ms_per_token": 1e3 * len(prompts) / best}
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
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
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
    def layers_fn():
        fwd = jax.jit(lambda w, c, x: model.forward(w, c, x.tokens, x.positions, x.meta, cfg=mc,
                                                    backend=getattr(runner, "backend", "reference"),
                                                    plan=runner.plan),
                      donate_argnums=(1,))
        def layers():
            hidden, runner.cache = fwd(runner.weights, runner.cache, x)
            return hidden
        return layers
    import jaxserve.attention as attention_pkg
    kept = attention_pkg.paged_attention
    attention_pkg.paged_attention = lambda q, cache, *a, **k: (q, cache)   # the KV write stays
    t_no_attention = timeit(layers_fn())
    attention_pkg.paged_attention = kept
    layers = layers_fn()
    hidden = layers()
    rows = hidden[np.asarray(x.logit_rows)]
    head = jax.jit(lambda w, h: model.compute_logits(w, h))
    logits = head(runner.weights, rows)
    from jaxserve.sample.sampler import sample
    smp = jax.jit(lambda l, t, p, b: sample(l, t, p, k=runner.max_logprobs, bitmask=b))
    bitmask = x.bitmask if x.bitmask is not None else runner._all_allowed_mask(len(x.logit_rows))
    exe = runner._executable(len(x.tokens), False)
    packed = runner.device_inputs(x)
    def whole():
        out, scores, runner.cache, runner.penalties = exe(runner.weights, runner.cache, runner.penalties,
                                                          *packed)
        return out
    res["profile"] = {
        "token bucket T": len(x.tokens), "sampler rows": len(x.logit_rows),
        "whole step (ms)": timeit(whole),
        "layers: forward [T] (ms)": timeit(layers),
        "layers with attention skipped (ms)": t_no_attention,
        "lm_head on the sampler rows (ms)": timeit(head, runner.weights, rows),
        "sampler, greedy (ms)": timeit(smp, logits, x.sampling, runner.penalties, bitmask),
    }
print("RESULT " + json.dumps(res))
"""


def run_tree(tree: str, args, xla_flags: str | None = None, engine_args: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    if xla_flags is not None:       # a variant: these XLA flags after the environment's own
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}".strip()
    prompts = peer_prompts(args.batch) if args.batch > 1 or args.llama_cpp else [PROMPT]
    if args.context:      # token ids from the middle of the vocabulary, different per sequence
        prompts = [{"prompt_token_ids": [(i * 7919 + 31 * b) % 40000 + 100 for i in range(args.context)]}
                   for b in range(args.batch)]
    cfg = dict(tokens=args.tokens, repeats=args.repeats, prompts=prompts, profile=args.profile,
               engine_args=engine_args or {})
    p = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cfg)], env=env, cwd=tree,
                       capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{tree}: no result (exit {p.returncode}):\n{p.stderr[-3000:]}")


def run_llama_cpp(spec: str, batch: int) -> dict:
    """peers/batched.py (64 greedy tokens per sequence, 2 threads) with `spec` = PYTHON:GGUF."""
    python, gguf = spec.split(":", 1)
    out = subprocess.run([python, str(PEER), gguf, str(batch)], capture_output=True, text=True,
                         timeout=1800)
    m = re.search(r"([\d.]+) output tok/s", out.stdout)
    if m is None:
        raise RuntimeError(f"llama.cpp run failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return {"tok_s": float(m.group(1))}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", help="git revision to compare with (A B A B)")
    ap.add_argument("--batch", type=int, default=1, help="sequences generated together")
    ap.add_argument("--llama-cpp", metavar="PYTHON:GGUF",
                    help="also llama.cpp: a venv's python with llama-cpp-python, and a GGUF file")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the systems")
    ap.add_argument("--context", type=int, default=0, metavar="N",
                    help="prompts of N token ids each (a long context for decode attention) in place of the text")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--xla-flags", action="append", default=[], metavar="NAME=FLAGS",
                    help="also this tree with these XLA_FLAGS added (repeatable), A B A B")
    ap.add_argument("--engine-args", action="append", default=[], metavar="NAME=JSON",
                    help="also this tree with these LLM() arguments (repeatable), A B A B; e.g. "
                         "'invariant={\"batch_invariant\": true}'")
    args = ap.parse_args()
    if args.llama_cpp and (args.tokens != 64 or ":" not in args.llama_cpp or args.context):
        ap.error("--llama-cpp takes PYTHON:GGUF, and batched.py generates 64 tokens (--tokens 64) "
                 "from its own prompts (no --context)")
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
    systems = {name: (lambda tree=tree: run_tree(tree, args)) for name, tree in trees.items()}
    for variant in args.xla_flags:
        name, _, flags = variant.partition("=")
        systems[f"this tree, {name}"] = lambda flags=flags: run_tree(here, args, flags)
    for variant in args.engine_args:
        name, _, kwargs = variant.partition("=")
        systems[f"this tree, {name}"] = lambda kw=json.loads(kwargs): run_tree(here, args, engine_args=kw)
    if args.llama_cpp:
        systems["llama.cpp"] = lambda: run_llama_cpp(args.llama_cpp, args.batch)
    results = {name: [] for name in systems}
    for r in range(args.rounds if len(systems) > 1 else 1):
        for name, run in systems.items():
            t0, load = time.perf_counter(), os.getloadavg()[0]
            res = run()
            results[name].append(res)
            print(f"round {r} {name}: {res['tok_s']:.1f} tok/s ({time.perf_counter() - t0:.0f} s with "
                  f"start-up; load average {load:.1f})", flush=True)
            if "profile" in res:
                res["profile"]["engine host time per step (ms)"] = \
                    res["ms_per_token"] - res["profile"]["whole step (ms)"]
                for k, v in res["profile"].items():
                    print(f"    {k}: {v:.2f}" if isinstance(v, float) else f"    {k}: {v}", flush=True)
    print(f"\n| system | tok/s, batch {args.batch}, {args.tokens} greedy tokens: median (rounds) |")
    print("|---|---|")
    med = {}
    for n, v in results.items():
        med[n] = statistics.median(x["tok_s"] for x in v)
        rounds = ", ".join(f"{x['tok_s']:.1f}" for x in v)
        print(f"| {n} | {med[n]:.1f} ({rounds}) |")
    for n in trees:
        if "llama.cpp" in med:
            print(f"{n} / llama.cpp (medians): {med[n] / med['llama.cpp']:.2f}x")
    if args.against:
        a, b = (results[n][-1]["tokens"] for n in trees)
        print(f"this tree / {args.against} (medians): {med['this tree'] / med[f'git {args.against}']:.2f}x; "
              f"greedy tokens identical: {a == b}")
    for n in (n for n in results if n.startswith("this tree, ")):
        same = results[n][-1]["tokens"] == results["this tree"][-1]["tokens"]
        print(f"{n} / this tree (medians): {med[n] / med['this tree']:.2f}x; "
              f"greedy tokens identical: {same}")


if __name__ == "__main__":
    main()
