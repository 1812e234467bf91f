"""bf16 tiles for the quantized matmuls on CPU (`--dtype auto`) against f32 tiles (`--dtype float32`):
quality and speed on the default model (its GGUF kept quantized), in one run.

    python benchmarks/bench_cpu_tiles.py [--rounds 2] [--batches 1 64] [--tokens 64] [--no-quality]

With `--dtype auto` on CPU the activations stay f32, but a matmul over 16 rows or more (batched
decode, prefill) rounds its rows to bf16 and dequantizes each weight tile to bf16, accumulating in
f32 (`layers.int4.with_bf16_tiles`), where the CPU multiplies bf16 in hardware (else f32 tiles:
`loader.bf16_tiles_pay`; this benchmark sets JAXSERVE_CPU_BF16_TILES=1 to measure them anyway);
`--dtype float32` keeps f32 tiles at every size.

Quality (the issue's bar for a faster default dtype): perplexity over the held-out set
benchmarks/data/heldout_fp8.jsonl (per text and overall, ratio to f32 tiles), and teacher-forced
greedy agreement: the f32 engine's 32-token greedy continuations of tests/test_kv_cache_dtypes.py's
prompts are fed back to the bf16 engine as prompts, and the fraction of positions where its
argmax is the same token is counted (prompt-logprob rank 1).

Speed: both engines are built and warmed up first, then alternate (A B A B) per batch size on
the peer harness's prompts (/work/shared/peers/batched.py), output tokens/s with prefill
included; and the time of one 64-prompt prefill (all prompts' tokens in one step).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gguf_int4 import jaxserve_tok_s as tok_s  # noqa: E402  (the peer harness's prompts)
from bench_gguf_int4 import prompts  # noqa: E402
from test_kv_cache_dtypes import PROMPTS  # noqa: E402  (one fixed prompt set)

from jaxserve import LLM, SamplingParams  # noqa: E402

HELDOUT = Path(__file__).resolve().parent / "data" / "heldout_fp8.jsonl"
ENGINES = {"f32 tiles (--dtype float32)": "float32",
           "bf16 tiles from 16 rows (--dtype auto, JAXSERVE_CPU_BF16_TILES=1)": "auto"}


def prefill_s(llm: LLM, b: int) -> float:
    t0 = time.perf_counter()
    llm.generate(prompts(b), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - t0


def nll(llm: LLM, texts: list[str]) -> list[tuple[float, int]]:
    outs = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [(-sum(e[t].logprob for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])),
             len(o.prompt_token_ids) - 1) for o in outs]


def quality(engines: dict[str, LLM]) -> None:
    """Each engine after the first against the first (the reference): perplexity and agreement."""
    rows = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    names, texts = [r["name"] for r in rows], [r["text"] for r in rows]
    (base_name, base), *others = engines.items()
    outs = base.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    runs = [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs]
    a = nll(base, texts)
    count = sum(c for _, c in a)
    ppl_a = math.exp(sum(s for s, _ in a) / count)
    print(f"\nquality, {len(texts)} held-out texts ({count} scored tokens), {len(PROMPTS)} prompts x 32 tokens forced")
    print("| engine | overall ppl | ratio | teacher-forced agreement | " + " | ".join(names) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(names))
    print(f"| {base_name} | {ppl_a:.3f} | 1 | 1 | " + " | ".join(f"{math.exp(s / c):.3f}" for s, c in a) + " |")
    for name, fast in others:
        forced = fast.generate([{"prompt_token_ids": p + g} for p, g in runs],
                               SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        agree = sum(step[tok].rank == 1 for (p, g), o in zip(runs, forced)
                    for step, tok in zip(o.prompt_logprobs[len(p):], g))
        total = sum(len(g) for _, g in runs)
        b = nll(fast, texts)
        ppl_b = math.exp(sum(s for s, _ in b) / count)
        print(f"| {name} | {ppl_b:.3f} | {ppl_b / ppl_a:.4f} | {agree / total:.3f} | "
              + " | ".join(f"{math.exp(s / c):.3f}" for s, c in b) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--no-quality", action="store_true")
    a = ap.parse_args()
    big = max(a.batches + [64])
    os.environ["JAXSERVE_CPU_BF16_TILES"] = "1"     # bf16 tiles whatever this CPU's default
    engines = {name: LLM(dtype=dtype, max_num_seqs=big, max_model_len=1024, max_num_batched_tokens=1024,
                         enable_prefix_caching=False, num_gpu_blocks_override=big * 256 // 16 + 16)
               for name, dtype in ENGINES.items()}
    if not a.no_quality:
        quality(engines)
    for llm in engines.values():
        for b in a.batches:
            tok_s(llm, b, 4)                      # warm-up: every bucket this batch uses
        prefill_s(llm, 64)
    results: dict[tuple[str, str], list[float]] = {}
    for r in range(a.rounds):
        for name, llm in engines.items():
            results.setdefault((name, "prefill of 64 prompts (s)"), []).append(prefill_s(llm, 64))
        for b in a.batches:
            for name, llm in engines.items():
                results.setdefault((name, f"batch {b} (tok/s)"), []).append(tok_s(llm, b, a.tokens))
        print(f"round {r + 1}: " + ", ".join(f"{n} {w}: {v[-1]:.2f}" for (n, w), v in results.items()), flush=True)
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {jax.devices()[0].platform}, "
          f"{a.tokens} greedy tokens per prompt (median of {a.rounds} rounds, then each)")
    print("| engine | measure | median | rounds |\n|---|---|---:|---|")
    for (name, what), v in results.items():
        print(f"| {name} | {what} | {statistics.median(v):.2f} | {', '.join(f'{x:.2f}' for x in v)} |")


if __name__ == "__main__":
    main()
