"""An EAGLE-3 head on the default model at batch 1: mean acceptance length and decode tokens/s with
and without drafts, in one sitting (A B A B).

    python benchmarks/bench_eagle3.py HEAD [--k 3] [--max-tokens 96] [--repeats 2] [--prompts held-out|train]
        [--adaptive] [--f32-head]

HEAD: a head directory (`jaxserve train-eagle3 --out HEAD`). One engine (default model, greedy,
the head as `speculative_config`) runs every prompt with the proposer on and off (swapped, so both
share compiled programs), alternating, after a warm-up that compiles every bucket the runs use.
Drafts run whenever offered (`min_expected_accepted` 0, the runner's step-cost model pinned), so
the figure is the head's, not the opt-out's; `--adaptive` leaves both at the engine's defaults
(what a user serving the head gets: drafts only where the measured step times say they pay).
Prompts: held-out chat prompts (none of them in the training set of `train-eagle3`), or the
first training prompts. Mean acceptance length = 1 +
accepted / verification steps with drafts (vLLM's). Greedy outputs are checked to be identical.
`--f32-head`: a second engine whose head keeps its f32 matrices (`--dtype auto` on one CPU device
rounds them to int8 for the fused CPU kernel), its runs in the same rotation (off, int8, f32 per
prompt). Prints a Markdown row per head and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from jaxserve import LLM, SamplingParams
from jaxserve.training.eagle3 import default_prompts

HELD_OUT = ["Write a short story about a lighthouse keeper.", "Explain why the sky is blue to a child.",
            "What are three good habits for staying healthy?", "Describe your ideal weekend.",
            "What is a good recipe for pancakes?", "How do airplanes stay in the air?"]


def _engine(a, f32_head: bool = False) -> LLM:
    """The default model with the head as `speculative_config`. `f32_head`: the head's matrices
    kept as loaded (f32), not rounded to int8 for the fused CPU kernel as `--dtype auto` does on
    one CPU device (engine/builder.py's `load_eagle3_head`; its switch patched for this engine)."""
    from jaxserve.engine import builder
    saved = builder.fused_kernel_rows
    if f32_head:
        builder.fused_kernel_rows = lambda weights: 0
    try:
        llm = LLM(max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=4, num_gpu_blocks_override=256,
                  enable_prefix_caching=False,
                  speculative_config={"method": "eagle3", "model": a.head, "num_speculative_tokens": a.k,
                                      **({} if a.adaptive else {"min_expected_accepted": 0})})
    finally:
        builder.fused_kernel_rows = saved
    if not a.adaptive:
        llm.llm_engine.runner.step_cost = lambda num_tokens: 1.0
    return llm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("head")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", choices=["held-out", "train"], default="held-out")
    ap.add_argument("--adaptive", action="store_true",
                    help="the engine's own draft opt-outs and step-cost model (default: drafts always)")
    ap.add_argument("--f32-head", action="store_true",
                    help="also a second engine whose head stays f32 (before int8 heads), in the same rotation")
    a = ap.parse_args()
    prompts = HELD_OUT if a.prompts == "held-out" else default_prompts()[:6]
    llm = _engine(a)
    # mode -> (engine, drafts on)
    modes = {"off": (llm, False), "on": (llm, True)}
    if a.f32_head:
        modes["f32"] = (_engine(a, f32_head=True), True)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)

    def chat(prompt: str, mode: str):
        engine_llm, on = modes[mode]
        engine = engine_llm.llm_engine
        proposer = engine.proposer
        engine.proposer = proposer if on else None
        before = engine.stats()
        t0 = time.perf_counter()
        try:
            out = engine_llm.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)[0].outputs[0]
        finally:
            engine.proposer = proposer
        seconds = time.perf_counter() - t0
        after = engine.stats()
        return out.token_ids, seconds, (after.spec_num_drafts - before.spec_num_drafts,
                                        after.spec_num_accepted_tokens - before.spec_num_accepted_tokens)

    for p in prompts:       # warm-up: every program each mode uses
        for mode in modes:
            chat(p, mode)
    best = dict.fromkeys(modes)
    counts = {mode: [0, 0] for mode in modes}       # drafts, accepted
    identical = True
    for _ in range(a.repeats):
        totals = {mode: [0, 0.0] for mode in modes}
        ids = {}
        for p in prompts:
            for mode in modes:
                tokens, seconds, (d, acc) = chat(p, mode)
                totals[mode][0] += len(tokens)
                totals[mode][1] += seconds
                ids.setdefault(p, {})[mode] = tokens
                counts[mode][0] += d
                counts[mode][1] += acc
        identical &= all(all(t == v["off"] for t in v.values()) for v in ids.values())
        for mode in modes:
            tok_s = totals[mode][0] / totals[mode][1]
            best[mode] = tok_s if best[mode] is None else max(best[mode], tok_s)
    mal = {mode: 1 + acc / max(1, d) for mode, (d, acc) in counts.items() if mode != "off"}
    ratio = {mode: best[mode] / best["off"] for mode in mal}
    adaptive = " adaptive" if a.adaptive else ""
    for mode in mal:
        head = " (f32 head)" if mode == "f32" else ""
        print(f"| eagle3 k={a.k}{adaptive}{head} | {a.prompts} | {mal[mode]:.2f} | {best['off']:.1f} | "
              f"{best[mode]:.1f} | **{ratio[mode]:.2f}x** | {identical} |")
    print(json.dumps(dict(machine=platform.machine(), head=a.head, k=a.k, prompts=a.prompts,
                          adaptive=a.adaptive,
                          mean_acceptance_length=mal["on"], tok_s_off=best["off"], tok_s_on=best["on"],
                          ratio=ratio["on"], identical=identical,
                          per_pos=list(llm.llm_engine.stats().spec_num_accepted_tokens_per_pos),
                          **({"f32_head": dict(mean_acceptance_length=mal["f32"], tok_s=best["f32"],
                                               ratio=ratio["f32"])} if "f32" in mal else {}))))
    for engine_llm in {id(m[0]): m[0] for m in modes.values()}.values():
        engine_llm.shutdown()


if __name__ == "__main__":
    main()
