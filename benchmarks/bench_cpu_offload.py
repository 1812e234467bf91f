"""`--cpu-offload-gb` on CPU: the default model dequantized to f32 (its stacked layer weights are
then plain arrays, ~0.4 GiB), with none of them and with about half of them in host memory
(`--cpu-offload-gb 0.2`: the two largest MLP stacks), rounds alternating (A B A B). On a CPU host
and device memory are the same RAM: what this measures is the cost of the per-layer copies the step
makes, not a transfer over a bus. Reports decode tokens/s at batch 1 and at batch `--batch`, and
whether the greedy tokens are identical.

    python benchmarks/bench_cpu_offload.py [--rounds 2] [--gib 0.2]
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from jaxserve import LLM, SamplingParams


def one_round(gib: float, args) -> dict:
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.prompt)]}
               for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    llm = LLM(quantization="none", dtype="float32", max_model_len=512, max_num_seqs=args.batch,
              max_num_batched_tokens=256, cpu_offload_gb=gib)
    llm.generate(prompts[:1], params, use_tqdm=False)      # first use of each program
    out = {}
    for name, batch in (("batch 1", prompts[:1]), (f"batch {args.batch}", prompts)):
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        out[name] = (sum(len(o.outputs[0].token_ids) for o in outs) / wall,
                     [o.outputs[0].token_ids for o in outs])
    llm.shutdown()
    del llm
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=0.2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    runs = {0.0: [], args.gib: []}
    for r in range(args.rounds):
        for gib in runs:
            res = one_round(gib, args)
            runs[gib].append(res)
            print(f"round {r} --cpu-offload-gb {gib:g}: " +
                  ", ".join(f"{k} {v[0]:.1f} tok/s" for k, v in res.items()), flush=True)
    for name in runs[0.0][0]:
        base = sum(r[name][0] for r in runs[0.0]) / args.rounds
        off = sum(r[name][0] for r in runs[args.gib]) / args.rounds
        same = all(a[name][1] == b[name][1] for a, b in zip(runs[0.0], runs[args.gib]))
        print(f"{name}: offloaded / resident {off / base:.3f}x; greedy tokens identical: {same}")


if __name__ == "__main__":
    main()
