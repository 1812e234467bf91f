"""Benchmark the Pallas paged attention kernels on decode batches (H100/H200, jax 0.11.2).

For each (batch, context, KV dtype) it times, on one GPU:
  ragged   jaxserve.pallas.paged_attention.ragged_paged_attention (the mixed-batch kernel)
  split-K  jaxserve.pallas.paged_attention_decode.ragged_paged_attention_decode
  ref      ref_ragged_paged_attention compiled by XLA (skipped when its [T, ctx, K, D] gather
           would not fit the memory budget)
and reports time per call, the achieved HBM bandwidth of the faster kernel (K/V + scales read,
q read, out written, divided by time) as a fraction of the device's peak, and the speed-up of
the faster kernel over ref. Prints a markdown table.

    python benchmarks/bench_paged_attention.py            # full sweep
    python benchmarks/bench_paged_attention.py --quick    # small sweep
    python benchmarks/bench_paged_attention.py --allow-cpu --quick   # smoke test, interpret mode
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.pallas.paged_attention import (ragged_paged_attention,  # noqa: E402
                                             ref_ragged_paged_attention)
from jaxserve.pallas.paged_attention_decode import ragged_paged_attention_decode  # noqa: E402

PEAK_HBM = {"H200": 4.8e12, "H100": 3.35e12}   # bytes/s, SXM parts
REF_BUDGET_BYTES = 16 * 2**30                   # largest f32 gather the reference may build


try:
    from jaxserve.attention import AttentionMetadata
except ImportError:  # the kernels only read attributes
    from typing import NamedTuple

    class AttentionMetadata(NamedTuple):
        slot_mapping: jax.Array
        block_tables: jax.Array
        kv_lens: jax.Array
        cu_q_lens: jax.Array
        num_seqs: jax.Array


def peak_bandwidth():
    kind = jax.devices()[0].device_kind
    for name, peak in PEAK_HBM.items():
        if name in kind:
            return kind, peak
    return kind, None


def make_decode_batch(batch, ctx, *, K, G, D, B, dtype, kv, seed=0):
    """Decode step: `batch` sequences with one new token each and `ctx` cached tokens."""
    M = -(-ctx // B)
    N = batch * M + 1
    rng = np.random.default_rng(seed)
    bt = rng.permutation(N)[: batch * M].reshape(batch, M).astype(np.int32)
    meta = AttentionMetadata(
        slot_mapping=jnp.zeros((batch,), jnp.int32), block_tables=jnp.asarray(bt),
        kv_lens=jnp.full((batch,), ctx, jnp.int32),
        cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32),
        num_seqs=jnp.asarray([batch], jnp.int32))
    key = jax.random.key(seed)
    kq, kk, kv_ = jax.random.split(key, 3)
    q = jax.random.normal(kq, (batch, K * G, D), dtype)
    shape = (N, B, K, D)
    k = jax.random.normal(kk, shape, dtype)
    v = jax.random.normal(kv_, shape, dtype)
    ks = vs = None
    if kv != "auto":   # random codes + plausible scales: the bytes moved are what matters
        sd = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8}[kv]
        k = (k * 8).astype(sd)
        v = (v * 8).astype(sd)
        ks = jnp.full(shape[:-1], 0.125, jnp.float32)
        vs = jnp.full(shape[:-1], 0.125, jnp.float32)
    return q, k, v, meta, ks, vs


def bytes_moved(batch, ctx, *, K, G, D, dtype, kv):
    """HBM traffic of one call: K/V (+ scales) read once, q read, out written."""
    kv_item = jnp.dtype(dtype).itemsize if kv == "auto" else 1
    kv_bytes = 2 * batch * ctx * K * D * kv_item
    scale_bytes = 0 if kv == "auto" else 2 * batch * ctx * K * 4
    qo_bytes = 2 * batch * K * G * D * jnp.dtype(dtype).itemsize
    return kv_bytes + scale_bytes + qo_bytes


def time_fn(fn, args, iters):
    jax.block_until_ready(fn(*args))           # compile + warm up
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return min(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sweep")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="run tiny shapes in Pallas interpret mode when there is no GPU")
    ap.add_argument("--kv", default="auto,fp8", help="comma list of auto|fp8|int8")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--batches", default=None, help="comma list (GPU default 1,8,32,64,128,256)")
    ap.add_argument("--contexts", default=None,
                    help="comma list (GPU default 512,2048,8192,32768)")
    args = ap.parse_args(argv)

    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.allow_cpu:
        print(f"bench_paged_attention: no GPU (backend={jax.default_backend()}); this benchmark "
              "measures GPU kernels. Pass --allow-cpu to smoke-test it in interpret mode.")
        return 0
    kind, peak = peak_bandwidth()
    if on_gpu:
        K, G, D, B, dtype = 8, 4, 128, 16, jnp.bfloat16        # Llama-3-8B attention shape
        batches = [1, 32, 256] if args.quick else [1, 8, 32, 64, 128, 256]
        contexts = [512, 8192] if args.quick else [512, 2048, 8192, 32768]
        iters = args.iters or 20
    else:
        K, G, D, B, dtype = 2, 4, 64, 16, jnp.float32
        batches, contexts, iters = [1, 4], [64, 128], args.iters or 1
    if args.batches:
        batches = [int(x) for x in args.batches.split(",")]
    if args.contexts:
        contexts = [int(x) for x in args.contexts.split(",")]
    interpret = not on_gpu
    kvs = [s for s in args.kv.split(",") if s]

    print(f"# Paged attention decode benchmark\n\ndevice: {kind}, jax {jax.__version__}, "
          f"{datetime.date.today()}, K={K} G={G} D={D} block_size={B} q={jnp.dtype(dtype).name}"
          f"{'' if on_gpu else ' (CPU interpret mode: timings meaningless)'}\n")
    print("| batch | context | KV | ragged ms | split-K ms | ref ms | best GB/s | % peak | "
          "speed-up vs ref |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    sm = 1.0 / np.sqrt(D)
    for kv in kvs:
        for batch in batches:
            for ctx in contexts:
                row = f"| {batch} | {ctx} | {kv if kv != 'auto' else jnp.dtype(dtype).name} |"
                try:
                    q, k, v, meta, ks, vs = make_decode_batch(batch, ctx, K=K, G=G, D=D, B=B,
                                                              dtype=dtype, kv=kv)
                    # jit around the entries: metadata become tracers, so the eager
                    # validation's device->host copy stays out of the timing
                    ragged = jax.jit(lambda *a: ragged_paged_attention(
                        *a[:4], sm_scale=sm, k_scale=a[4], v_scale=a[5], interpret=interpret))
                    split = jax.jit(lambda *a: ragged_paged_attention_decode(
                        *a[:4], sm_scale=sm, k_scale=a[4], v_scale=a[5], interpret=interpret))
                    ops = (q, k, v, meta, ks, vs)
                    t_r = time_fn(ragged, ops, iters)
                    t_s = time_fn(split, ops, iters)
                    ref_bytes = batch * meta.block_tables.shape[1] * B * K * D * 4 * 2
                    if ref_bytes <= REF_BUDGET_BYTES:
                        ref = jax.jit(lambda *a: ref_ragged_paged_attention(
                            *a[:4], sm_scale=sm, k_scale=a[4], v_scale=a[5]))
                        t_ref = time_fn(ref, ops, iters)
                    else:
                        t_ref = None
                    best = min(t_r, t_s)
                    bw = bytes_moved(batch, ctx, K=K, G=G, D=D, dtype=dtype, kv=kv) / best
                    frac = f"{100 * bw / peak:.0f}%" if peak else "n/a"
                    ref_ms = f"{t_ref * 1e3:.3f}" if t_ref else "skipped (memory)"
                    speed = f"{t_ref / best:.1f}x" if t_ref else "-"
                    row += (f" {t_r * 1e3:.3f} | {t_s * 1e3:.3f} | {ref_ms} | {bw / 1e9:.0f} | "
                            f"{frac} | {speed} |")
                    del q, k, v, meta, ks, vs
                except Exception as e:  # noqa: BLE001 -- keep the sweep going (OOM, lowering)
                    row += f" error: {type(e).__name__}: {str(e).splitlines()[0][:120]} |||||||"
                print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
