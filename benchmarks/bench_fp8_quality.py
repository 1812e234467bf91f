"""FP8 weight quality on the default model: `--quantization fp8` and its variants against the
unquantised weights, in one run (CPU is fine; f32 activations).

GPTQ-calibrated variants (`jaxserve quantize`, jaxserve/loader/fp8_calibrate.py) are calibrated on
the model's own samples from its BOS token (`--calibration-samples` x `--calibration-tokens`,
none of the evaluation text), made once and timed.

Per variant: held-out perplexity and its ratio to unquantised, greedy agreement teacher-forced
(the unquantised engine's 32-token greedy continuations of tests/test_kv_cache_dtypes.py's prompts
fed back; fraction of positions whose argmax is the same token, as in that test), and the linear
layers' device bytes against the same matrices in bf16. Variants are made from the loaded weights
(jaxserve.loader.fp8.quantize_weights) and swapped into one engine, so the model loads once.

    python benchmarks/bench_fp8_quality.py [--calibration-samples 64 --calibration-tokens 256]

`--heldout benchmarks/data/heldout_fp8.jsonl` measures instead the weight granularities of
`--quantization fp8` (per-tensor, per-channel, 1 x 128 groups, 128 x 128 blocks; W8A16 and W8A8)
on a broad held-out set (one {"name", "text"} per line, text written for the purpose and never
tuned on): per-text and overall perplexity ratios to unquantised (overall: all the set's tokens'
mean log-likelihood). `--grid-shifts 1.19,1.41,1.68` adds, per variant, draws with the scales
multiplied by those factors: the same format with other rounding errors, to tell differences
between granularities from chance.

    python benchmarks/bench_fp8_quality.py --heldout benchmarks/data/heldout_fp8.jsonl \
        [--granularities channel,tensor --activations none,dynamic --grid-shifts 1.19,1.41,1.68]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_kv_cache_dtypes import HELD_OUT, PROMPTS  # noqa: E402  (one fixed prompt set)

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.layers.linear import DenseWeight  # noqa: E402
from jaxserve.loader.fp8 import (  # noqa: E402
    SKIP_ON_THE_FLY,
    fp8_weight,
    linear_weight_bytes,
    quantize_weights,
    replace_dense,
)
from jaxserve.loader.fp8_calibrate import calibrate_fp8  # noqa: E402
from jaxserve.pallas.fp8_matmul import FP8, expand_scale, quantize_weight  # noqa: E402
from jaxserve.quantize import calibration_sequences  # noqa: E402

SETTINGS = dict(max_model_len=256, max_num_batched_tokens=128, max_num_seqs=16, kv_cache_memory_bytes=96 << 20,
                enable_prefix_caching=False, warmup=False)
VARIANTS = {   # name -> quantize_weights kwargs
    "per-channel, W8A16 (--quantization fp8 on CPU)": dict(activations="none"),
    "per-channel, W8A8 dynamic per-token (--quantization fp8 on Hopper)": dict(activations="dynamic"),
    "128x128 blocks, W8A16": dict(granularity="block", activations="none"),
    "128x128 blocks, W8A8 per-1x128-group": dict(granularity="block", activations="dynamic"),
    "per-tensor, W8A16": dict(granularity="tensor", activations="none"),
    "per-channel, W8A16, attention only (MLP kept)": dict(activations="none", skip=SKIP_ON_THE_FLY + (
        "layers.w_gate", "layers.w_up", "layers.w_down")),
    "per-channel, W8A16, MLP only (attention kept)": dict(activations="none", skip=SKIP_ON_THE_FLY + (
        "layers.wq", "layers.wk", "layers.wv", "layers.wo")),
}


GRANULARITIES = ("channel", "group", "block", "tensor")      # --heldout
ACTIVATIONS = {"none": "W8A16", "dynamic": "W8A8"}


def text_nll(llm, texts: list[str]) -> list[tuple[float, int]]:
    """(summed negative log-likelihood, scored tokens) of each text, the first token unscored."""
    outs = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [(-sum(e[t].logprob for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])),
             len(o.prompt_token_ids) - 1) for o in outs]


def shifted_grid(base, granularity: str, activations: str, factor: float):
    """`--quantization fp8` weights of `granularity` whose scales are `factor` x amax / 448
    (1 < factor < 2): the same format, but another draw of rounding errors (the largest weight no
    longer lands on 448). How much the perplexity moves from draw to draw says which differences
    between granularities are more than chance."""
    def one(path, w):
        if path in SKIP_ON_THE_FLY:
            return w
        _, scale = quantize_weight(w.w, granularity)
        scale = scale * factor
        codes = (w.w / expand_scale(scale, *w.w.shape[-2:])).astype(FP8)
        return fp8_weight(codes, scale, like=w.w, activations=activations)
    return replace_dense(base, one)


def heldout(path: str, granularities=GRANULARITIES, activations=tuple(ACTIVATIONS), shifts=()) -> None:
    """Per-text and overall perplexity ratio on the held-out set at `path` of each granularity
    and activation scheme (and, with `shifts`, of each again with its rounding grid shifted)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    names, texts = [r["name"] for r in rows], [r["text"] for r in rows]
    llm = LLM(**dict(SETTINGS, max_model_len=1024, max_num_batched_tokens=512))
    runner = llm.llm_engine.runner
    base, base_nll = runner.weights, text_nll(llm, texts)
    total = sum(n for _, n in base_nll)

    def ppl(nll):
        return math.exp(sum(s for s, _ in nll) / total)
    print(f"{len(texts)} texts, {total} scored tokens; unquantised perplexity {ppl(base_nll):.3f} ("
          + ", ".join(f"{n} {math.exp(s / c):.2f}" for n, (s, c) in zip(names, base_nll)) + ")\n")
    print("| variant | overall ppl | overall ratio | worst text | " + " | ".join(names) + " |")
    print("|---|---:|---:|---|" + "---:|" * len(names))
    made = {}
    for g in granularities:
        for act in activations:
            made[f"{g}, {ACTIVATIONS[act]}"] = lambda g=g, a=act: quantize_weights(base, granularity=g, activations=a)
            made.update({f"{g}, {ACTIVATIONS[act]}, scales x{f}": (lambda g=g, a=act, f=f: shifted_grid(base, g, a, f))
                         for f in shifts})
    for name, make in made.items():
        runner.weights = make()
        runner._executables.clear()          # a new weights pytree: compile its programs afresh
        nll = text_nll(llm, texts)
        ratios = [math.exp((s - b) / c) for (s, c), (b, _) in zip(nll, base_nll)]
        worst = max(range(len(ratios)), key=ratios.__getitem__)
        print(f"| {name} | {ppl(nll):.3f} | {ppl(nll) / ppl(base_nll):.4f} | {names[worst]} "
              f"{ratios[worst]:.4f} | " + " | ".join(f"{r:.4f}" for r in ratios) + " |", flush=True)
    llm.shutdown()


def perplexity(llm) -> float:
    held = llm.generate(HELD_OUT, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return math.exp(-np.mean([e[t].logprob for e, t in zip(held.prompt_logprobs[1:], held.prompt_token_ids[1:])]))


CALIBRATED = {   # name -> calibrate_fp8 kwargs
    "GPTQ-calibrated per-channel, W8A16 (jaxserve quantize --activations none)": dict(activations="none"),
    "GPTQ-calibrated per-channel, W8A8 dynamic per-token (jaxserve quantize)": dict(activations="dynamic"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration-samples", type=int, default=64)
    ap.add_argument("--calibration-tokens", type=int, default=256)
    ap.add_argument("--damp", type=float, default=0.01)
    ap.add_argument("--heldout", help="a JSONL held-out set: measure the granularities on it instead")
    ap.add_argument("--granularities", default=",".join(GRANULARITIES), help="--heldout: which to measure")
    ap.add_argument("--activations", default=",".join(ACTIVATIONS), help="--heldout: none (W8A16), dynamic (W8A8)")
    ap.add_argument("--grid-shifts", default="", help="--heldout: comma-separated scale factors in (1, 2) "
                    "for extra draws of each variant's rounding errors")
    ns = ap.parse_args()
    if ns.heldout:
        return heldout(ns.heldout, ns.granularities.split(","), ns.activations.split(","),
                       tuple(float(f) for f in ns.grid_shifts.split(",") if f))
    llm = LLM(**SETTINGS)
    runner = llm.llm_engine.runner
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    runs = [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs]
    base_ppl, base = perplexity(llm), runner.weights
    bf16_bytes = sum(x.size * 2 for w in jax.tree_util.tree_leaves(base, is_leaf=lambda x: isinstance(x, DenseWeight))
                     if isinstance(w, DenseWeight) and w is not base.lm_head for x in [w.w])
    print(f"unquantised perplexity {base_ppl:.3f}; linear weights in bf16 would be {bf16_bytes} bytes\n")
    print("| variant | perplexity | ratio | teacher-forced agreement | linear bytes / bf16 |")
    print("|---|---:|---:|---:|---:|")
    t0 = time.perf_counter()
    seqs = calibration_sequences(llm, ns.calibration_samples, ns.calibration_tokens)
    t_sample = time.perf_counter() - t0
    made = {name: (lambda kw=kw: quantize_weights(base, **kw)) for name, kw in VARIANTS.items()}
    made.update({name: (lambda kw=kw: calibrate_fp8(llm.llm_engine.model_config, base, seqs, damp=ns.damp, **kw))
                 for name, kw in CALIBRATED.items()})
    t_calibrate = {}
    for name, make in made.items():
        t0 = time.perf_counter()
        runner.weights = make()
        t_calibrate[name] = time.perf_counter() - t0
        runner._executables.clear()          # a new weights pytree: compile its programs afresh
        forced = llm.generate([{"prompt_token_ids": p + g} for p, g in runs],
                              SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        ppl = perplexity(llm)
        agree = sum(step[tok].rank == 1 for (p, g), o in zip(runs, forced)
                    for step, tok in zip(o.prompt_logprobs[len(p):], g))
        total = sum(len(g) for _, g in runs)
        ratio = linear_weight_bytes(runner.weights) / bf16_bytes
        print(f"| {name} | {ppl:.3f} | {ppl / base_ppl:.4f} | {agree / total:.3f} | {ratio:.3f} |", flush=True)
    print(f"\ncalibration: {len(seqs)} of the model's own samples x {ns.calibration_tokens} tokens "
          f"(sampling {t_sample:.0f} s), damp {ns.damp}; GPTQ "
          + ", ".join(f"{t_calibrate[n]:.0f} s" for n in CALIBRATED))
    llm.shutdown()


if __name__ == "__main__":
    main()
