"""Quality of the fused CPU kernel's int8 activations (`Int4Weight.fused_int8_x`, what `--dtype auto`
runs batch-1 decode with on a CPU with an integer dot product) against the exact f32 path, on the
default model (its GGUF kept quantized), in one run.

    python benchmarks/bench_int8_x.py

The kernel takes only steps of a few rows (decode), so perplexity and teacher-forced agreement,
which score prompts, would not reach it under the engine's defaults. Here the kernel engines run
with `max_num_batched_tokens=8` (every prompt in chunks of at most 8 tokens, the 8-token bucket)
and `fused_max_rows=8`: every row of every step goes through the kernel. Its rows are independent
(each row's x is quantised on its own and every column's sums run in the same order whatever the
row count), so a row's numbers are the ones batch-1 decode gets.

Engines: `--dtype float32` (f32 tiles, the reference: exact f32 activations); the kernel with f32
activations (only the summation order differs); the kernel with int8 activations. Measures
(bench_cpu_tiles.py's `quality`): perplexity over benchmarks/data/heldout_fp8.jsonl, and
teacher-forced greedy agreement with the reference's 32-token continuations of 16 prompts. The
issue's bar for a faster default: agreement >= 0.99, perplexity within 0.5%.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_tiles import quality  # noqa: E402

from jaxserve import LLM  # noqa: E402
from jaxserve.layers import int4_cpu  # noqa: E402
from jaxserve.layers.int4 import with_fused_kernel  # noqa: E402


def kernel_engine(int8_x: bool) -> LLM:
    llm = LLM(dtype="auto", max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=8,
              enable_chunked_prefill=True, enable_prefix_caching=False, warmup=False)
    runner = llm.llm_engine.runner
    runner.weights = with_fused_kernel(runner.weights, max_rows=int4_cpu.MAX_ROWS, int8_x=int8_x)
    return llm


def main() -> None:
    assert int4_cpu.load() is None, int4_cpu.load()
    if int4_cpu.int8_dot() is None:
        sys.exit("this machine's kernel build has no integer dot product: nothing to measure")
    engines = {"f32 tiles (--dtype float32, the reference)":
               LLM(dtype="float32", max_model_len=1024, enable_prefix_caching=False, warmup=False),
               "fused kernel, f32 activations": kernel_engine(False),
               f"fused kernel, int8 activations ({int4_cpu.int8_dot()})": kernel_engine(True)}
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {jax.devices()[0].platform}")
    quality(engines)


if __name__ == "__main__":
    main()
