"""Benchmark the int4 (W4A16) matmul (issue 22): wall time and compiled temporaries of
`linear(x, Int4Weight)` against the same matrix as a f32 `DenseWeight` and against dequantising the
whole matrix then multiplying, side by side in one run, at decode and prefill row counts.

    python benchmarks/bench_int4.py                 # CPU: a minute
    python benchmarks/bench_int4.py --k 4096 --n 14336
    python benchmarks/bench_int4.py --kernel pallas # Hopper, jax >= 0.11: bf16 activations, adds the
                                                    # Mosaic GPU kernel (pallas/int4_matmul.py) and a
                                                    # bf16 dense column; --interpret runs it on CPU (tiny
                                                    # shapes only: a smoke check, not a timing)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from timing import timed  # noqa: E402

from jaxserve.layers.int4 import Int4Weight, dequantize, pack  # noqa: E402
from jaxserve.layers.linear import DenseWeight, linear  # noqa: E402


def _median_ms(fn, *args, reps: int = 20) -> float:
    return 1e3 * timed(fn, args, reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--kernel", choices=["xla", "pallas"], default="xla")
    ap.add_argument("--interpret", action="store_true", help="with --kernel pallas: GPU interpret mode (CPU)")
    a = ap.parse_args()
    if a.kernel == "pallas":
        return kernel_table(a)
    rng = np.random.default_rng(0)
    codes = jnp.asarray(rng.integers(0, 16, (a.k, a.n)), jnp.uint8)
    w4 = Int4Weight(pack(codes), jnp.asarray(rng.random((a.k // a.group, a.n)) * 0.01, jnp.float32),
                    jnp.asarray(rng.integers(0, 16, (a.k // a.group, a.n)), jnp.uint8), None, a.group)
    dense = DenseWeight(dequantize(w4.q, w4.scale, w4.zero, a.group))
    f = jax.jit(linear)
    whole = jax.jit(lambda x, w: x @ dequantize(w.q, w.scale, w.zero, w.group_size))
    print(f"{jax.devices()[0].device_kind}: K {a.k} N {a.n} group {a.group}; weight bytes int4 {w4.nbytes / 2**20:.1f} "
          f"MiB, f32 {dense.w.nbytes / 2**20:.1f} MiB")
    print("rows | int4 tiled ms | int4 whole-dequant ms | f32 dense ms | tiled temp MiB | whole temp MiB")
    for m in a.rows:
        x = jnp.asarray(rng.standard_normal((m, a.k)), jnp.float32)
        temp = [fn.lower(x, w4).compile().memory_analysis().temp_size_in_bytes / 2**20 for fn in (f, whole)]
        print(f"{m:4d} | {_median_ms(f, x, w4):13.2f} | {_median_ms(whole, x, w4):21.2f} | "
              f"{_median_ms(f, x, dense):12.2f} | {temp[0]:14.1f} | {temp[1]:14.1f}")


def kernel_table(a):
    """bf16 activations: the Mosaic GPU kernel beside the XLA int4 tiles and a bf16 dense matrix."""
    import functools

    from jaxserve.layers.int4_kernel import to_kernel
    from jaxserve.pallas.int4_matmul import int4_matmul_mgpu, ref_int4_matmul
    rng = np.random.default_rng(0)
    w4 = Int4Weight(pack(jnp.asarray(rng.integers(0, 16, (a.k, a.n)), jnp.uint8)),
                    jnp.asarray(rng.random((a.k // a.group, a.n)) * 0.01 + 0.005, jnp.float32),
                    jnp.asarray(rng.integers(0, 16, (a.k // a.group, a.n)), jnp.uint8), None, a.group)
    kw = to_kernel(w4, jnp.bfloat16)
    dense = DenseWeight(dequantize(w4.q, w4.scale, w4.zero, a.group, jnp.bfloat16))
    pallas = jax.jit(functools.partial(int4_matmul_mgpu, interpret=a.interpret))
    f = jax.jit(linear)
    reps = 1 if a.interpret else 50
    print(f"{jax.devices()[0].device_kind}: K {a.k} N {a.n} group {a.group} (asymmetric), bf16 activations; "
          f"weight bytes kernel layout {kw.nbytes / 2**20:.2f} MiB, bf16 {dense.w.nbytes / 2**20:.2f} MiB")
    print("rows | int4 pallas ms | int4 xla tiles ms | bf16 dense ms | pallas max rel err")
    for m in a.rows:
        x = jnp.asarray(rng.standard_normal((m, a.k)), jnp.bfloat16)
        y = pallas(x, kw)
        ref = ref_int4_matmul(x, kw)
        err = float(jnp.abs(y.astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
        print(f"{m:4d} | {_median_ms(pallas, x, kw, reps=reps):14.3f} | {_median_ms(f, x, w4, reps=reps):17.3f} | "
              f"{_median_ms(f, x, dense, reps=reps):13.3f} | {err:.1e}")


if __name__ == "__main__":
    main()
