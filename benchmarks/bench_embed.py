"""Embedding throughput: `LLM.embed` (runner "pooling") against the same prompts prefilled by
the generate runner (`LLM.generate`, max_tokens=1), on the same model and engine settings.

The pooling step is the generate step up to the final hidden states, with the sampler replaced
by a per-row reduction, so the two should cost about the same; this measures that they do.

    python benchmarks/bench_embed.py [--model PATH] [--prompts 64] [--len 128] [--pooling LAST]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jaxserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--len", type=int, default=128, help="tokens per prompt")
    ap.add_argument("--pooling", default="LAST", choices=["LAST", "MEAN", "CLS"])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    engine = dict(max_model_len=max(256, a.len + 1), max_num_batched_tokens=1024, max_num_seqs=64,
                  enable_prefix_caching=False)
    results = {}
    for runner in ("generate", "pooling"):
        kw = dict(runner=runner, **engine)
        if runner == "pooling":
            kw["pooler_config"] = {"pooling_type": a.pooling}
        with LLM(a.model, **kw) as llm:
            vocab = llm.model_config.vocab_size
            prompts = [{"prompt_token_ids": rng.integers(10, vocab, a.len).tolist()}
                       for _ in range(a.prompts)]
            times = []
            for _ in range(a.repeats + 1):              # the first run is a warm-up
                t0 = time.perf_counter()
                if runner == "pooling":
                    llm.embed(prompts, use_tqdm=False)
                else:
                    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0),
                                 use_tqdm=False)
                times.append(time.perf_counter() - t0)
            results[runner] = min(times[1:])
    tokens = a.prompts * a.len
    for runner, s in results.items():
        print(f"{runner:9s}: {a.prompts} prompts x {a.len} tokens in {s:.3f} s "
              f"({tokens / s:,.0f} prompt tokens/s)")
    print(f"pooling / generate time: {results['pooling'] / results['generate']:.3f}")


if __name__ == "__main__":
    main()
