"""The default model's matmuls, kept quantized vs dequantized to f32 (issue 22): its tied Q8_0
head (576 x 49152) and one layer's seven Q4_1 matrices, at decode row counts, the two weight
forms timed in turns (A B A B ...) so load from other processes hits both alike.

    python benchmarks/bench_gguf_matmuls.py [--rows 2 64] [--rounds 5] [--iters 10]

Loads the GGUF twice (`load_model`, no engine); times jitted `linear` calls as the model makes
them (`tied_logits`; the layer's matrices sliced from the stacked weights). Prints the median over rounds of
each round's median call, in ms, and kept / f32 time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from timing import timed  # noqa: E402

from jaxserve.default_model import default_model_path  # noqa: E402
from jaxserve.layers.embedding import tied_logits  # noqa: E402
from jaxserve.layers.linear import linear  # noqa: E402
from jaxserve.loader.loader import load_model  # noqa: E402

LAYER = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    forms = {}
    for name, q in (("f32", None), ("kept", "gguf")):
        _, w = load_model(default_model_path(), "float32", quantization=q)
        if q is None and not isinstance(w.embed, jax.Array):
            raise SystemExit("the f32 load kept the GGUF quantized; this benchmark compares it with f32")
        layer = {k: jax.tree.map(lambda x: x[0], getattr(w.layers, k)) for k in LAYER}
        forms[name] = (w.embed, layer)
    head = jax.jit(tied_logits)
    layer_fn = jax.jit(lambda x, xi, ws: [linear(xi if k == "w_down" else x, ws[k]) for k in LAYER])
    print(f"{jax.devices()[0].platform}, default model; ms per call, median of {a.rounds} rounds")
    print("| matmuls | rows | f32 ms | kept ms | kept / f32 |\n|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for m in a.rows:
        x = jnp.asarray(rng.standard_normal((m, 576)), jnp.float32)
        xi = jnp.asarray(rng.standard_normal((m, 1536)), jnp.float32)
        res: dict[tuple[str, str], list[float]] = {}
        for _ in range(a.rounds):
            for name, (hw, lw) in forms.items():
                res.setdefault(("head", name), []).append(1e3 * timed(head, (x, hw), a.iters))
                res.setdefault(("layer", name), []).append(1e3 * timed(layer_fn, (x, xi, lw), a.iters))
        for what in ("head", "layer"):
            f, k = (statistics.median(res[(what, n)]) for n in ("f32", "kept"))
            label = "tied head 576 x 49152 (Q8_0)" if what == "head" else "one layer's 7 matrices (Q4_1)"
            print(f"| {label} | {m} | {f:.2f} | {k:.2f} | {k / f:.2f} |", flush=True)


if __name__ == "__main__":
    main()
