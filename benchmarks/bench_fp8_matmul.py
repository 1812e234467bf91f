"""Benchmark the FP8 weight matmul (H100/H200, jax 0.11.2): issue 13's figures in one run.

Square problems (M = N = K = 4096, 8192), TFLOP/s (2 M N K / time), bf16 activations in and out:
  mgpu-block    our Mosaic GPU kernel, 128x128 block weight scales, x quantised per 1x128 group
  mgpu-tensor   our kernel, per-tensor weight scale, x quantised per token
  xla-fp8       XLA's dot on fp8 operands with per-tensor / per-token scales around it (the HLO is
                checked for a cuBLASLt FP8 custom call; the column header says whether it found one)
  deq-bf16      the block-scaled weight dequantised to bf16 + a bf16 dot (XLA; what serving a
                block-scaled checkpoint costs without the kernel)
  bf16          a plain bf16 dot, for scale
Activation quantisation is inside every W8A8 timing (it is part of the op when serving).
Decode (M = 1..128, N = K = 8192): GB/s of weight bytes read (N K bytes for fp8, 2 N K for bf16).
Targets (issue 13): mgpu-tensor >= 0.9x xla-fp8; mgpu-block >= 1.3x deq-bf16; >= 2 TB/s at M <= 64.
A column that fails (lowering, OOM) says so in its cell. Prints markdown tables.

    python benchmarks/bench_fp8_matmul.py                       # GPU
    python benchmarks/bench_fp8_matmul.py --allow-cpu --sizes 256 --decode-n 256 --decode-m 1,8 --iters 2
        # CPU smoke test (kernel in interpret mode on jax >= 0.11, else its columns say n/a)
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from timing import timed  # noqa: E402

from jaxserve.pallas import fp8_matmul as fm  # noqa: E402


def problem(m: int, n: int, k: int, seed: int = 0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.float32) * 0.02
    qb, sb = jax.jit(fm.quantize_weight, static_argnames="granularity")(w, "block")
    qt, st = jax.jit(fm.quantize_weight, static_argnames="granularity")(w, "tensor")
    nk_b, nk_t = qb.T.copy(), qt.T.copy()            # K-major storage, as the loader keeps it
    return x, w.astype(jnp.bfloat16), (qb, sb, nk_b), (qt, st, nk_t)


def columns(interpret: bool):
    """name -> (make(x, w16, block, tensor) -> (jitted fn, args))."""
    mgpu = functools.partial(fm.fp8_matmul_mgpu, k_major=True, interpret=interpret or None)
    return {
        "mgpu-block": lambda x, w16, b, t: (jax.jit(mgpu), (x, b[2], b[1])),
        "mgpu-tensor": lambda x, w16, b, t: (jax.jit(mgpu), (x, t[2], t[1])),
        "xla-fp8": lambda x, w16, b, t: (jax.jit(fm.fp8_matmul_xla), (x, t[0], t[1])),
        "deq-bf16": lambda x, w16, b, t: (jax.jit(functools.partial(fm.fp8_matmul_xla, activations="none")),
                                          (x, b[0], b[1])),
        "bf16": lambda x, w16, b, t: (jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
                                              .astype(x.dtype)), (x, w16)),
    }


def uses_cublaslt_fp8(x, q, s) -> str:
    try:
        hlo = jax.jit(fm.fp8_matmul_xla).lower(x, q, s).compile().as_text()
    except Exception as e:  # noqa: BLE001 - report, do not stop the sweep
        return f"error: {type(e).__name__}"
    return "yes" if "cublas$lt$matmul$f8" in hlo else "no"


def run(args) -> None:
    interpret = jax.default_backend() != "gpu"
    if interpret and not args.allow_cpu:
        sys.exit("no GPU: pass --allow-cpu for a smoke test (tiny sizes, kernel in interpret mode)")
    cols = columns(interpret)
    kernel_ok = fm.MGPU_AVAILABLE
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, iters {args.iters}")

    def cell(name, make, x, w16, b, t, measure):
        if name.startswith("mgpu") and not kernel_ok:
            return "n/a (jax < 0.11)"
        try:
            fn, a = make(x, w16, b, t)
            return measure(timed(fn, a, args.iters))
        except Exception as e:  # noqa: BLE001 - a failing column says so and the sweep goes on
            return f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"

    first = problem(128, 256, 256)
    header = " | ".join(f"{c} (cuBLASLt fp8: {uses_cublaslt_fp8(first[0], *first[3][:2])})" if c == "xla-fp8"
                        else c for c in cols)
    print("\n### Square problems, TFLOP/s\n")
    print(f"| M = N = K | {header} |")
    print("|---:|" + "---:|" * len(cols))
    for size in args.sizes:
        x, w16, b, t = problem(size, size, size)
        flops = 2 * size ** 3
        row = [cell(c, mk, x, w16, b, t, lambda s, f=flops: f"{f / s / 1e12:.1f}") for c, mk in cols.items()]
        print(f"| {size} | " + " | ".join(row) + " |")
        del x, w16, b, t

    print(f"\n### Decode, N = K = {args.decode_n}: GB/s of weight bytes\n")
    print(f"| M | {' | '.join(cols)} |")
    print("|---:|" + "---:|" * len(cols))
    n = k = args.decode_n
    _, w16, b, t = problem(1, n, k)
    for m in args.decode_m:
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
        row = [cell(c, mk, x, w16, b, t,
                    lambda s, c=c: f"{(2 if c == 'bf16' else 1) * n * k / s / 1e9:.0f}")
               for c, mk in cols.items()]
        print(f"| {m} | " + " | ".join(row) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    p.add_argument("--sizes", type=ints, default=[4096, 8192])
    p.add_argument("--decode-n", type=int, default=8192)
    p.add_argument("--decode-m", type=ints, default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--allow-cpu", action="store_true")
    run(p.parse_args())


if __name__ == "__main__":
    main()
