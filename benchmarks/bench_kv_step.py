"""Per-step cost of quantised KV caches against an unquantised one, at two pool sizes (issue 11
item 8: an fp8 cache once cost ~700x an f32 one on CPU and grew with the pool).

For each pool size (blocks) and KV dtype: one engine, its programs compiled by a first
generate, then decode steps timed (one prompt, `--tokens` new tokens: one step per token) and a
prefill step (a `--prompt-len`-token prompt, one step). Prints a markdown table; the ratio column
is the step time over the unquantised cache's at the same pool size.

    python benchmarks/bench_kv_step.py                          # default model, 256 and 4096 blocks
    python benchmarks/bench_kv_step.py --model tests/data/tiny-llama --load-format dummy
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402


def measure(model, load_format, kv, blocks, tokens, prompt_len, repeats):
    from jaxserve import LLM, SamplingParams
    llm = LLM(model=model, load_format=load_format, dtype="float32", kv_cache_dtype=kv,
              num_gpu_blocks_override=blocks, max_model_len=1024, max_num_seqs=8,
              max_num_batched_tokens=256, enable_prefix_caching=False, warmup=False)
    with llm:
        vocab = llm.llm_engine.model_config.vocab_size
        rng = np.random.default_rng(0)
        prompt = {"prompt_token_ids": rng.integers(3, vocab - 1, prompt_len).tolist()}
        decode = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        llm.generate([prompt], decode, use_tqdm=False)            # compiles every shape used
        best_decode = best_prefill = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            t1 = time.perf_counter()
            llm.generate([prompt], decode, use_tqdm=False)
            t2 = time.perf_counter()
            best_prefill = min(best_prefill, t1 - t0)
            # the first decode-run step is the prefill again: (t2 - t1 - prefill) / (tokens - 1)
            best_decode = min(best_decode, (t2 - t1 - (t1 - t0)) / (tokens - 1))
        return best_decode, best_prefill


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded default model")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--blocks", default="256,4096")
    ap.add_argument("--kv", default="auto,fp8,int8")
    ap.add_argument("--tokens", type=int, default=17)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    rows, base = [], {}
    for blocks in (int(b) for b in args.blocks.split(",")):
        for kv in args.kv.split(","):
            dec, pre = measure(args.model, args.load_format, kv, blocks, args.tokens, args.prompt_len,
                               args.repeats)
            base.setdefault(blocks, dec)
            rows.append(f"| {blocks} | {kv} | {dec * 1e3:.1f} | {dec / base[blocks]:.2f}x | {pre * 1e3:.0f} |")
            print(rows[-1], flush=True)
    print(f"\nKV cache dtype per-step cost, {args.model or 'default model'} (f32 weights), "
          f"{platform.node()} CPU x{os.cpu_count()}, jax {jax.__version__}\n")
    print(f"Command: `python benchmarks/bench_kv_step.py {' '.join(argv or sys.argv[1:])}`\n")
    print("| pool blocks | kv_cache_dtype | decode step ms | vs auto | prefill step ms "
          f"({args.prompt_len} tokens) |")
    print("|---:|---|---:|---:|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
