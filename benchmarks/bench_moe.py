"""Benchmark the mixture-of-experts grouped matmul (issue 22): FLOPs and wall time of the experts'
MLP by layout, and decode of a tiny 128-expert Qwen3-MoE, side by side in one run.

1. One MoE MLP (`layers/moe.py: expert_mlp`): X experts, top-k, hidden E, expert inner F, T tokens
   (decode T = 1..16, prefill T = 128..512). Columns per layout ("tiles": the default off
   `RAGGED_DOT_BACKENDS`; "ragged": `jax.lax.ragged_dot`, today's path before issue 22):
   XLA's `cost_analysis()` FLOPs over the useful FLOPs (2 T k 3 E F), and the median wall time.
   The tiles layout gathers at most `MAX_GATHER_BYTES` of expert matrices per step; at these
   shapes every tile fits in one step (no loop), so cost_analysis counts every tile (XLA counts a
   loop body once). The "chunks" column says how many steps the layout took.
2. Decode of a tiny Qwen3-MoE (hidden 256, 128 experts, top 8, `--layers` layers, dummy weights)
   through `LLM.generate`: decode tokens/s for ragged (forced by putting "cpu" in
   RAGGED_DOT_BACKENDS), tiles, and tiles with `--quantization fp8` (FP8 experts).

3. `--int4`: the same MLP with int4 experts (`Int4Weight` [X, in, out], asymmetric groups of
   `--group`) beside the f32 experts they dequantise to, tiles layout: wall time and weight bytes.

    python benchmarks/bench_moe.py                  # both parts (CPU, minutes)
    python benchmarks/bench_moe.py --no-engine      # part 1 only
    python benchmarks/bench_moe.py --no-engine --int4 --tokens 1,16,128
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
from timing import timed  # noqa: E402

from jaxserve.layers import experts as ex  # noqa: E402
from jaxserve.layers import moe  # noqa: E402
from jaxserve.layers.linear import DenseWeight  # noqa: E402


def layer_table(tokens, X, k, E, F, iters):
    ks = jax.random.split(jax.random.key(0), 4)
    w = [ex.ExpertWeight(DenseWeight(jax.random.normal(kk, s) * 0.05))
         for kk, s in zip(ks[:3], [(X, E, F), (X, E, F), (X, F, E)])]
    print(f"\n### One MoE MLP: {X} experts, top {k}, hidden {E}, expert inner {F}, f32, {jax.default_backend()}\n")
    print("| T | useful MFLOP | tiles FLOPs / useful | ragged FLOPs / useful | tile rows | chunks | "
          "tiles ms | ragged ms | ragged / tiles time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T in tokens:
        x = jax.random.normal(jax.random.fold_in(ks[3], T), (T, E))
        weights, ids = moe.route(jax.random.normal(jax.random.fold_in(ks[3], 10_000 + T), (T, X)), k, True)
        useful = ex.useful_flops(T, k, E, F)
        row, ms = [], []
        for layout in ("tiles", "ragged"):
            fn = jax.jit(lambda x, wt, i, a, b, c, layout=layout: moe.expert_mlp(x, wt, i, a, b, c, layout=layout))
            flops = fn.lower(x, weights, ids, *w).compile().cost_analysis()["flops"]
            row.append(flops / useful)
            ms.append(1e3 * timed(fn, (x, weights, ids, *w), iters))
        tile = ex.tile_rows(T * k, X)
        tiles = ex.num_tiles(T * k, X, tile)
        per_expert = E * F * 4
        chunks = -(-tiles // max(1, ex.MAX_GATHER_BYTES // per_expert))
        print(f"| {T} | {useful / 1e6:.1f} | {row[0]:.3f} | {row[1]:.1f} | {tile} | {chunks} | {ms[0]:.2f} | "
              f"{ms[1]:.2f} | {ms[1] / ms[0]:.1f}x |")


def engine_table(layers, prompts, max_tokens):
    from jaxserve import LLM, SamplingParams
    config = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 1024, "hidden_size": 256,
              "intermediate_size": 768, "num_hidden_layers": layers, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "num_experts": 128, "num_experts_per_tok": 8,
              "moe_intermediate_size": 128, "norm_topk_prob": True, "eos_token_id": 2,
              "max_position_embeddings": 512}
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": [(7 * i + 13 * j) % 1000 + 3 for j in range(8)]} for i in range(prompts)]
    print(f"\n### Decode, tiny Qwen3-MoE: hidden 256, 128 experts, top 8, {layers} layers, dummy weights, "
          f"{prompts} prompts x {max_tokens} tokens, f32\n")
    print("| experts path | decode tok/s | step ms | tokens equal ragged's |")
    print("|---|---|---|---|")
    ref, default = None, ex.RAGGED_DOT_BACKENDS
    for name, backends, quantization in (("ragged (before)", ("cpu",), None), ("tiles", (), None),
                                         ("tiles, --quantization fp8", (), "fp8")):
        ex.RAGGED_DOT_BACKENDS = backends       # read when the step is traced
        with LLM(model=d, load_format="dummy", seed=0, max_model_len=256, kv_cache_memory_bytes=32 << 20,
                 max_num_seqs=prompts, quantization=quantization) as llm:
            llm.generate(batch, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
            t0 = time.perf_counter()
            outs = llm.generate(batch, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
        tokens = [o.outputs[0].token_ids for o in outs]
        ref = ref or tokens
        same = sum(a == b for a, b in zip(tokens, ref))
        n = sum(len(t) for t in tokens)
        print(f"| {name} | {n / dt:.1f} | {1e3 * dt / max_tokens:.1f} | {same}/{len(tokens)} |")
    ex.RAGGED_DOT_BACKENDS = default


def int4_table(tokens, X, k, E, F, iters, group):
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.layers.int4 import Int4Weight, dequantize, pack
    rng = np.random.default_rng(0)

    def int4(shape):
        n_groups = (shape[0], shape[1] // group, shape[2])
        return Int4Weight(pack(jnp.asarray(rng.integers(0, 16, shape))),
                          jnp.asarray(rng.uniform(0.005, 0.02, n_groups), jnp.float32),
                          jnp.asarray(rng.integers(0, 16, n_groups), jnp.uint8), None, group)
    q = [int4(s) for s in [(X, E, F), (X, E, F), (X, F, E)]]
    d = [ex.ExpertWeight(DenseWeight(dequantize(w.q, w.scale, w.zero, group))) for w in q]
    q = [ex.ExpertWeight(w) for w in q]
    ratio = sum(w.w.nbytes for w in q) / sum(w.w.w.nbytes for w in d)
    print(f"\n### int4 experts (group {group}, asymmetric) vs f32, tiles layout: weight bytes {ratio:.3f}x\n")
    print("| T | f32 ms | int4 ms | int4 / f32 time |")
    print("|---|---|---|---|")
    fn = jax.jit(lambda *a: moe.expert_mlp(*a, layout="tiles"))
    for T in tokens:
        x = jax.random.normal(jax.random.key(T), (T, E))
        weights, ids = moe.route(jax.random.normal(jax.random.key(10_000 + T), (T, X)), k, True)
        ms = [1e3 * timed(fn, (x, weights, ids, *w), iters) for w in (d, q)]
        print(f"| {T} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[1] / ms[0]:.2f}x |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,16,128,256,512")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inner", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--int4", action="store_true", help="add the int4 experts table")
    ap.add_argument("--group", type=int, default=128)
    a = ap.parse_args()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {when}")
    layer_table([int(t) for t in a.tokens.split(",")], a.experts, a.top_k, a.hidden, a.inner, a.iters)
    if a.int4:
        int4_table([int(t) for t in a.tokens.split(",")], a.experts, a.top_k, a.hidden, a.inner, a.iters, a.group)
    if not a.no_engine:
        engine_table(a.layers, a.prompts, a.max_tokens)


if __name__ == "__main__":
    main()
