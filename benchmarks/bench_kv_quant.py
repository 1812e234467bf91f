"""KV cache quantisation quality on the default model: fp8 (e4m3), fp8_e5m2 and int8 against the
unquantised cache, in one run.

Reports, per KV dtype: greedy agreement teacher-forced (the unquantised continuation fed back,
fraction of positions where the quantised argmax is the same token), free-running identical
tokens (position-wise, and the mean matching prefix), identical sequences, perplexity of a
held-out text and its ratio to the unquantised one, and the KV pool size in blocks for the same
memory budget.

    python benchmarks/bench_kv_quant.py [--max-tokens 32] [--append]
"""
from __future__ import annotations

import argparse
import datetime
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_kv_cache_dtypes import HELD_OUT, PROMPTS  # noqa: E402  (one fixed prompt set)

from jaxserve import LLM, SamplingParams  # noqa: E402

SETTINGS = dict(max_model_len=512, max_num_batched_tokens=256, max_num_seqs=32,
                kv_cache_memory_bytes=256 << 20, warmup=False)


def measure(kv: str, max_tokens: int, forced_from=None):
    with LLM(kv_cache_dtype=kv, **SETTINGS) as llm:
        tok = llm.get_tokenizer()
        chats = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        t0 = time.perf_counter()
        outs = llm.generate(PROMPTS + chats, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                            ignore_eos=True), use_tqdm=False)
        seconds = time.perf_counter() - t0
        runs = [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs]
        forced = None
        if forced_from is not None:
            forced = llm.generate([{"prompt_token_ids": p + g} for p, g in forced_from],
                                  SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        held = llm.generate(HELD_OUT, SamplingParams(max_tokens=1, prompt_logprobs=0),
                            use_tqdm=False)[0]
        lps = [e[t].logprob for e, t in zip(held.prompt_logprobs[1:], held.prompt_token_ids[1:])]
        return dict(runs=runs, forced=forced, ppl=math.exp(-np.mean(lps)), seconds=seconds,
                    blocks=llm.llm_engine.cache_config.num_blocks)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv", nargs="+", default=["fp8", "fp8_e5m2", "int8"])
    ap.add_argument("--append", action="store_true", help="append to benchmarks/RESULTS.md")
    args = ap.parse_args()
    base = measure("auto", args.max_tokens)
    rows = [f"| auto | - | - | - | - | {base['ppl']:.3f} | 1.000 | {base['blocks']} |"]
    for kv in args.kv:
        r = measure(kv, args.max_tokens, forced_from=base["runs"])
        agree = total = same = prefix = identical = 0
        for (p, g), (_, q), out in zip(base["runs"], r["runs"], r["forced"]):
            agree += sum(s[t].rank == 1 for s, t in zip(out.prompt_logprobs[len(p):], g))
            total += len(g)
            same += sum(a == b for a, b in zip(g, q))
            n = 0
            while n < len(g) and g[n] == q[n]:
                n += 1
            prefix += n
            identical += g == q
        rows.append(f"| {kv} | {agree / total:.3f} | {same / total:.3f} | {prefix / total:.3f} | "
                    f"{identical}/{len(base['runs'])} | {r['ppl']:.3f} | "
                    f"{r['ppl'] / base['ppl']:.4f} | {r['blocks']} |")
    table = "\n".join(
        ["| KV dtype | teacher-forced agreement | free-running identical | matching prefix | "
         "identical sequences | held-out ppl | ppl ratio | blocks (256 MiB) |",
         "|---|---|---|---|---|---|---|---|", *rows])
    print(table)
    if args.append:
        stamp = datetime.date.today().isoformat()
        with open(Path(__file__).parent / "RESULTS.md", "a") as f:
            f.write(f"\n### KV cache quantisation quality ({stamp})\n\nDevice: CPU "
                    f"({platform.processor() or platform.machine()}), default model f32, "
                    f"{len(PROMPTS) * 2} prompts x {args.max_tokens} greedy tokens. Command: "
                    f"`python benchmarks/bench_kv_quant.py --append`.\n\n{table}\n")


if __name__ == "__main__":
    main()
