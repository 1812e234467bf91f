"""An EAGLE-3 head on the default model at batch 1: mean acceptance length and decode tokens/s with
and without drafts, in one sitting (A B A B).

    python benchmarks/bench_eagle3.py HEAD [--k 3] [--max-tokens 96] [--repeats 2] [--prompts held-out|train]
        [--adaptive]

HEAD: a head directory (`jaxserve train-eagle3 --out HEAD`). One engine (default model, greedy,
the head as `speculative_config`) runs every prompt with the proposer on and off (swapped, so both
share compiled programs), alternating, after a warm-up that compiles every bucket the runs use.
Drafts run whenever offered (`min_expected_accepted` 0, the runner's step-cost model pinned), so
the figure is the head's, not the opt-out's; `--adaptive` leaves both at the engine's defaults
(what a user serving the head gets: drafts only where the measured step times say they pay).
Prompts: held-out chat prompts (none of them in the training set of `train-eagle3`), or the
first training prompts. Mean acceptance length = 1 +
accepted / verification steps with drafts (vLLM's). Greedy outputs are checked to be identical.
Prints a Markdown row and one JSON line.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("head")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", choices=["held-out", "train"], default="held-out")
    ap.add_argument("--adaptive", action="store_true",
                    help="the engine's own draft opt-outs and step-cost model (default: drafts always)")
    a = ap.parse_args()
    prompts = HELD_OUT if a.prompts == "held-out" else default_prompts()[:6]
    llm = LLM(max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=4, num_gpu_blocks_override=256,
              enable_prefix_caching=False,
              speculative_config={"method": "eagle3", "model": a.head, "num_speculative_tokens": a.k,
                                  **({} if a.adaptive else {"min_expected_accepted": 0})})
    engine = llm.llm_engine
    if not a.adaptive:
        engine.runner.step_cost = lambda num_tokens: 1.0
    proposer = engine.proposer
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)

    def chat(prompt: str, on: bool):
        engine.proposer = proposer if on else None
        before = engine.stats()
        t0 = time.perf_counter()
        out = llm.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)[0].outputs[0]
        seconds = time.perf_counter() - t0
        after = engine.stats()
        return out.token_ids, seconds, (after.spec_num_drafts - before.spec_num_drafts,
                                        after.spec_num_accepted_tokens - before.spec_num_accepted_tokens)

    for p in prompts:       # warm-up: every program both modes use
        chat(p, True)
        chat(p, False)
    best = {True: None, False: None}
    drafts = accepted = 0
    identical = True
    for _ in range(a.repeats):
        totals = {True: [0, 0.0], False: [0, 0.0]}
        ids = {}
        for p in prompts:
            for on in (False, True):
                tokens, seconds, (d, acc) = chat(p, on)
                totals[on][0] += len(tokens)
                totals[on][1] += seconds
                ids.setdefault(p, {})[on] = tokens
                if on:
                    drafts, accepted = drafts + d, accepted + acc
        identical &= all(v[True] == v[False] for v in ids.values())
        for on in (True, False):
            tok_s = totals[on][0] / totals[on][1]
            best[on] = tok_s if best[on] is None else max(best[on], tok_s)
    mal = 1 + accepted / max(1, drafts)
    ratio = best[True] / best[False]
    mode = " adaptive" if a.adaptive else ""
    print(f"| eagle3 k={a.k}{mode} | {a.prompts} | {mal:.2f} | {best[False]:.1f} | {best[True]:.1f} | "
          f"**{ratio:.2f}x** | {identical} |")
    print(json.dumps(dict(machine=platform.machine(), head=a.head, k=a.k, prompts=a.prompts,
                          adaptive=a.adaptive,
                          mean_acceptance_length=mal, tok_s_off=best[False], tok_s_on=best[True],
                          ratio=ratio, identical=identical,
                          per_pos=list(engine.stats().spec_num_accepted_tokens_per_pos))))
    llm.shutdown()


if __name__ == "__main__":
    main()
