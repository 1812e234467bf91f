"""End-to-end engine figures on a GPU with seeded dummy weights of a real model's shapes
(default: Llama-3.1-8B, bf16) — no checkpoint has to travel to the GPU machine.

    python benchmarks/bench_gpu_e2e.py                                  # H100/H200
    python benchmarks/bench_gpu_e2e.py --config benchmarks/configs/qwen3-8b --batches 1,64
    python benchmarks/bench_gpu_e2e.py --allow-cpu --config tests/data/tiny-llama  # smoke test

Three measurements through `LLMEngine` (the real scheduler, runner, sampler):
- decode step time at batch B (B requests with `--context` cached tokens, all decoding), and the
  decode roofline: bytes a step must read (all weights + every request's K/V) over the step time,
  as a fraction of the HBM peak;
- prefill MFU: a step of `--max-num-batched-tokens` prompt tokens, model FLOPs (2 x params per
  token + attention) over the step time, as a fraction of the dense bf16 peak;
- offline throughput: `LLM.generate` on `--num-prompts` prompts of `--input-len` random tokens x
  `--output-len` new tokens (EOS ignored): output tokens/s.
Prints a markdown block for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.models import get_model  # noqa: E402
from jaxserve.models.params import num_parameters  # noqa: E402

PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12)}   # HBM B/s, dense bf16 FLOP/s


def _peaks():
    kind = jax.devices()[0].device_kind
    for name, peak in PEAKS.items():
        if name in kind:
            return kind, peak
    return kind, (None, None)


def _random_prompts(rng, n, length, vocab):
    return [{"prompt_token_ids": rng.integers(100, vocab - 100, length).tolist()}
            for _ in range(n)]


def decode_step_time(llm, rng, batch, context, steps):
    """Seconds per engine step once `batch` requests with `context` tokens are all decoding."""
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i, p in enumerate(_random_prompts(rng, batch, context, vocab)):
        engine.add_request(f"d{batch}-{i}", p, sp)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()                          # prefill (chunked), until every request decodes
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = (time.perf_counter() - t0) / steps
    engine.abort_request(list(engine.scheduler.requests))
    while engine.has_unfinished_requests():
        engine.step()
    return dt


def prefill_step_time(llm, rng, tokens, repeats=3):
    """Seconds of one step that prefills `tokens` prompt tokens (one request)."""
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    times = []
    for k in range(repeats + 1):
        engine.add_request(f"p{k}", _random_prompts(rng, 1, tokens, vocab)[0],
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            engine.step()
    return min(times[1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "configs",
                                                     "llama-3.1-8b"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per decode request")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per batch")
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--quantization", default=None,
                    help="e.g. fp8: the dummy weights quantised on load (vLLM's flag)")
    ap.add_argument("--allow-cpu", action="store_true")
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.allow_cpu:
        print("bench_gpu_e2e: no GPU; pass --allow-cpu with a tiny --config to smoke-test it")
        return 0
    batches = [int(b) for b in args.batches.split(",")]
    max_len = max(args.context + args.steps + 16, args.input_len + args.output_len,
                  args.max_num_batched_tokens + 8)
    t0 = time.perf_counter()
    llm = LLM(model=args.config, load_format="dummy", dtype=args.dtype, seed=0,
              max_model_len=max_len, max_num_seqs=max(batches + [args.num_prompts]),
              max_num_batched_tokens=args.max_num_batched_tokens,
              attention_backend=args.attention_backend, quantization=args.quantization)
    start_s = time.perf_counter() - t0
    engine = llm.llm_engine
    cfg = engine.model_config
    decl = get_model(cfg.architecture).declare(cfg)
    params = num_parameters(decl)
    itemsize = np.dtype(jax.numpy.dtype(args.dtype)).itemsize
    # fp8: linear weights at 1 byte (embeddings, norms stay at dtype: a lower bound of the bytes)
    weight_bytes = params * (1 if args.quantization == "fp8" else itemsize)
    kind, (hbm, flops_peak) = _peaks()
    rng = np.random.default_rng(0)

    rows = []
    for b in batches:
        dt = decode_step_time(llm, rng, b, args.context, args.steps)
        ctx = args.context + args.steps // 2
        kv_bytes = b * ctx * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * itemsize
        need = weight_bytes + kv_bytes
        frac = f"{100 * need / dt / hbm:.0f}%" if hbm else "n/a"
        rows.append(f"| {b} | {args.context} | {dt * 1e3:.2f} | {b / dt:.0f} | "
                    f"{need / 1e9:.1f} | {need / dt / 1e9:.0f} | {frac} |")
        print(rows[-1], flush=True)

    T = args.max_num_batched_tokens
    pt = prefill_step_time(llm, rng, T)
    attn = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * T * T   # QK^T + PV, causal half
    flops = 2 * params * T + attn
    mfu = f"{100 * flops / pt / flops_peak:.0f}%" if flops_peak else "n/a"

    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompts = _random_prompts(rng, args.num_prompts, args.input_len, cfg.vocab_size)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)

    print(f"\n### End to end, {os.path.basename(os.path.normpath(args.config))} dummy weights "
          f"({params / 1e9:.2f} B params, {args.dtype}{', ' + args.quantization if args.quantization else ''}), "
          f"{kind}, jax {jax.__version__}, "
          f"{datetime.date.today()}\n")
    print(f"Command: `python benchmarks/bench_gpu_e2e.py {' '.join(argv or sys.argv[1:])}`; "
          f"attention backend {engine.attention_backend} (asked: {args.attention_backend}); "
          f"engine start {start_s:.0f} s (weights made on device, programs compiled).\n")
    print("| decode batch | context | step ms | tok/s | bytes/step GB | GB/s | % of HBM roofline |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    print(f"\nPrefill: one step of {T} prompt tokens in {pt * 1e3:.1f} ms = "
          f"{flops / pt / 1e12:.0f} TFLOP/s, MFU {mfu} (dense bf16 peak).")
    print(f"Offline: {args.num_prompts} prompts x {args.input_len} tokens -> {args.output_len} "
          f"new tokens each: {out_tokens / wall:.0f} output tok/s ({wall:.1f} s).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
