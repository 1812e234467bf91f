"""Benchmark the Pallas paged attention kernels on decode batches (H100/H200, jax 0.11.2).

For each (batch, context, KV dtype) it times, on one GPU:
  ragged   jaxserve.pallas.paged_attention.ragged_paged_attention (the mixed-batch kernel)
  split-K  jaxserve.pallas.paged_attention_decode.ragged_paged_attention_decode
  mosaic   jaxserve.pallas.paged_attention_mgpu.ragged_paged_attention_mgpu, when that module
           exists (Mosaic GPU; same signature as ragged)
  xla      the engine's reference backend (jaxserve.attention.ragged_paged_attention_ref: chunked
           online softmax in plain XLA), what `attention_backend="reference"` runs
  jax-ops  jax's own jax.experimental.pallas.ops.gpu.paged_attention (decode only; K/V pages
           head-major, transposed once outside the timing; no sm_scale argument, timing only)
  ref      ref_ragged_paged_attention (the dense oracle) compiled by XLA (skipped when its
           [T, ctx, K, D] gather would not fit the memory budget)
and reports time per call, the achieved HBM bandwidth of the fastest jaxserve kernel (K/V +
scales read, q read, out written, divided by time) as a fraction of the device's peak, and its
speed-up over the xla path. A column that fails (lowering, OOM, unsupported dtype) says so in
its cell and the sweep goes on. Prints a markdown table.

    python benchmarks/bench_paged_attention.py            # full sweep
    python benchmarks/bench_paged_attention.py --quick    # small sweep
    python benchmarks/bench_paged_attention.py --allow-cpu --quick   # smoke test, interpret mode
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.pallas.paged_attention import ragged_paged_attention, ref_ragged_paged_attention  # noqa: E402
from jaxserve.pallas.paged_attention_decode import ragged_paged_attention_decode  # noqa: E402

try:   # another kernel, landing separately; the column appears once it exists
    from jaxserve.pallas.paged_attention_mgpu import ragged_paged_attention_mgpu
except ImportError:
    ragged_paged_attention_mgpu = None
try:
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_ops_paged_attention
except ImportError:
    jax_ops_paged_attention = None
try:
    from jaxserve.attention import ragged_paged_attention_ref as xla_path
except ImportError:
    xla_path = None

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


def columns(interpret: bool, D: int) -> dict:
    """name -> fn(q, k, v, meta, ks, vs, sm) for every implementation importable here."""
    cols = {
        "ragged": lambda q, k, v, m, ks, vs, sm: ragged_paged_attention(
            q, k, v, m, sm_scale=sm, k_scale=ks, v_scale=vs, interpret=interpret),
        "split-K": lambda q, k, v, m, ks, vs, sm: ragged_paged_attention_decode(
            q, k, v, m, sm_scale=sm, k_scale=ks, v_scale=vs, interpret=interpret),
    }
    if ragged_paged_attention_mgpu is not None:
        cols["mosaic"] = lambda q, k, v, m, ks, vs, sm: ragged_paged_attention_mgpu(
            q, k, v, m, sm_scale=sm, k_scale=ks, v_scale=vs, interpret=interpret)
    if xla_path is not None:
        cols["xla"] = lambda q, k, v, m, ks, vs, sm: xla_path(
            q, k, v, m, sm_scale=sm, k_scale=ks, v_scale=vs)
    if jax_ops_paged_attention is not None:
        cols["jax-ops"] = functools.partial(jax_ops_column, interpret=interpret)
    cols["ref"] = lambda q, k, v, m, ks, vs, sm: ref_ragged_paged_attention(
        q, k, v, m, sm_scale=sm, k_scale=ks, v_scale=vs)
    return cols


def jax_ops_column(q, k_hm, v_hm, meta, ks_hm, vs_hm, sm, *, interpret):
    """jax's GPU paged attention on head-major pages [K, N, B, D] (see `to_head_major`)."""
    M = meta.block_tables.shape[1]
    k_splits = min(16, M)                                   # M is a power of two in the sweep
    per_split = M // k_splits
    ppcb = max(p for p in (8, 4, 2, 1) if per_split % p == 0)
    return jax_ops_paged_attention.paged_attention(
        q * sm, k_hm, v_hm, meta.block_tables, meta.kv_lens, ks_hm, vs_hm,
        k_splits=k_splits, pages_per_compute_block=ppcb, interpret=interpret)


def to_head_major(k, v, ks, vs):
    """[N, B, K, D] pages (and [N, B, K] scales) -> jax ops' [K, N, B, D] (and [K, N, B])."""
    hm = [k.transpose(2, 0, 1, 3), v.transpose(2, 0, 1, 3)]
    hm += [None, None] if ks is None else [ks.transpose(2, 0, 1), vs.transpose(2, 0, 1)]
    return hm


def sweep_row(cols, batch, ctx, kv, *, K, G, D, B, dtype, iters):
    """Time every column on one decode batch: (cells as text, name -> seconds or None)."""
    cells, times = [], {}
    try:
        q, k, v, meta, ks, vs = make_decode_batch(batch, ctx, K=K, G=G, D=D, B=B, dtype=dtype,
                                                  kv=kv)
    except Exception as e:  # noqa: BLE001 -- OOM making the cache: the whole row says so
        return [f"error: {type(e).__name__}"] * len(cols), {}
    sm = 1.0 / np.sqrt(D)
    for name, fn in cols.items():
        times[name] = None
        if name == "ref" and batch * meta.block_tables.shape[1] * B * K * D * 8 > REF_BUDGET_BYTES:
            cells.append("skipped (memory)")
            continue
        try:
            ops = (q, k, v, meta, ks, vs)
            if name == "jax-ops":
                k_hm, v_hm, ks_hm, vs_hm = to_head_major(k, v, ks, vs)
                ops = (q, k_hm, v_hm, meta, ks_hm, vs_hm)
            # jit around the entries: metadata become tracers, so the eager validation's
            # device->host copy stays out of the timing
            jitted = jax.jit(lambda *a, fn=fn: fn(*a, sm))
            times[name] = time_fn(jitted, ops, iters)
            cells.append(f"{times[name] * 1e3:.3f}")
        except Exception as e:  # noqa: BLE001 -- keep the sweep going (OOM, lowering, dtype)
            cells.append(f"error: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
                         if str(e) else f"error: {type(e).__name__}")
    del q, k, v, meta, ks, vs
    return cells, times


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
    ap.add_argument("--columns", default=None,
                    help="comma list of the columns to time (default: all; e.g. ragged,split-K,mosaic,xla: "
                         "each column is one kernel compile per row on the GPU)")
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
    cols = columns(interpret, D)
    if args.columns:
        keep = [c for c in args.columns.split(",") if c]
        cols = {c: fn for c, fn in cols.items() if c in keep}
    print("| batch | context | KV | " + " | ".join(f"{c} ms" for c in cols)
          + " | best GB/s | % peak | speed-up vs xla |")
    print("|---:|---:|---|" + "---:|" * (len(cols) + 3))
    for kv in kvs:
        for batch in batches:
            for ctx in contexts:
                cells, times = sweep_row(cols, batch, ctx, kv, K=K, G=G, D=D, B=B, dtype=dtype,
                                         iters=iters)
                ours = [times[c] for c in ("ragged", "split-K", "mosaic") if times.get(c)]
                best = min(ours) if ours else None
                bw = bytes_moved(batch, ctx, K=K, G=G, D=D, dtype=dtype, kv=kv) / best \
                    if best else None
                frac = f"{100 * bw / peak:.0f}%" if bw and peak else "n/a"
                speed = f"{times['xla'] / best:.1f}x" if best and times.get("xla") else "-"
                kv_name = kv if kv != "auto" else jnp.dtype(dtype).name
                print(f"| {batch} | {ctx} | {kv_name} | " + " | ".join(cells)
                      + f" | {bw / 1e9 if bw else 0:.0f} | {frac} | {speed} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
