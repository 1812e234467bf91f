"""Decode speed of the default model's GGUF (Q4_1 layers, Q8_0 embedding): dequantized to f32 at
load (`quantization="none"`) vs kept quantized in memory (the default since 2026-11-25, `"gguf"`),
optionally llama.cpp on the same file, in turns (A B A B ...) in one run so load from other processes hits all alike.

    python benchmarks/bench_gguf_int4.py [--rounds 2] [--batches 1 64] [--tokens 64]
                                         [--llama-cpp-python /tmp/peer/venv/bin/python]

Each turn generates `--tokens` greedy tokens (EOS ignored) for B prompts "Once upon a time, in a
kingdom by the sea number {i}, there lived" (the peer harness's, /work/shared/peers/batched.py)
and reports output tokens/s; both engines are built and warmed up before the first clock.
Prints one Markdown row per (engine, batch) with the median and every round, and the weight bytes.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import time
from pathlib import Path

import jax

from jaxserve import LLM, SamplingParams
from jaxserve.default_model import default_model_path

PEER = Path("/work/shared/peers/batched.py")


def prompts(b: int) -> list[str]:
    return [f"Once upon a time, in a kingdom by the sea number {i}, there lived" for i in range(b)]


def jaxserve_tok_s(llm: LLM, b: int, tokens: int) -> float:
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts(b), sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return b * tokens / dt


def llama_cpp_tok_s(python: str, b: int) -> float:
    out = subprocess.run([python, str(PEER), str(default_model_path()), str(b)], capture_output=True,
                         text=True, timeout=1200)
    m = re.search(r"([\d.]+) output tok/s", out.stdout)
    if m is None:
        raise RuntimeError(f"llama.cpp run failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--llama-cpp-python", default=None, help="a venv's python with llama-cpp-python installed")
    a = ap.parse_args()
    engines = {}
    for name, q in (("f32 (dequantized at load, --quantization none)", "none"),
                    ("kept quantized (the default; --quantization gguf)", "gguf")):
        # KV blocks for the largest batch at max_model_len, not the 2 GiB default: two engines and
        # llama.cpp share one machine's memory
        llm = LLM(quantization=q, max_num_seqs=max(a.batches), max_model_len=256, max_num_batched_tokens=1024,
                  enable_prefix_caching=False, num_gpu_blocks_override=max(a.batches) * 256 // 16 + 16)
        nbytes = sum(x.nbytes for x in jax.tree.leaves(llm.llm_engine.runner.weights))
        for b in a.batches:
            jaxserve_tok_s(llm, b, 4)                      # warm-up: every bucket this batch uses
        engines[name] = (llm, nbytes)
    results: dict[tuple[str, int], list[float]] = {}
    for r in range(a.rounds):
        for b in a.batches:
            for name, (llm, _) in engines.items():
                results.setdefault((name, b), []).append(jaxserve_tok_s(llm, b, a.tokens))
            if a.llama_cpp_python:
                results.setdefault(("llama.cpp (Q4_1 as shipped, 2 threads)", b), []).append(
                    llama_cpp_tok_s(a.llama_cpp_python, b))
            print(f"round {r + 1} batch {b}: " + ", ".join(f"{n}: {v[-1]:.1f}" for (n, bb), v in results.items()
                                                          if bb == b), flush=True)
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {jax.devices()[0].platform}, "
          f"{a.tokens} greedy tokens per prompt, output tok/s (median of {a.rounds} rounds, then each)")
    print("| engine | batch | tok/s | rounds |\n|---|---|---|---|")
    for (name, b), v in results.items():
        print(f"| {name} | {b} | {statistics.median(v):.1f} | {', '.join(f'{x:.1f}' for x in v)} |")
    for name, (_, nbytes) in engines.items():
        print(f"weights in memory, {name}: {nbytes / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
