"""The AMX kernel (jaxserve/layers/csrc/amx_matmul.cc) against XLA's bf16 tiles, which it replaces
for quantized matmuls of 17-256 rows on a CPU with AMX-BF16, side by side in one sitting.

    python benchmarks/bench_amx.py [--batches 32 64] [--max-tokens 64] [--rounds 2] [--matrices]

Engine: the default model (`--dtype auto`), B chat-style prompts x N greedy tokens (EOS ignored),
in a fresh process per run with the kernel on and off (`JAXSERVE_CPU_AMX=0`), alternating (A B A
B); each run warms its programs up on the same prompts first, then times `LLM.generate` (prefill of
the short prompts included). Reports the best tok/s of each mode per batch size, their ratio, and
whether the greedy tokens are identical. `--matrices` adds this model's layer matrices (576 x 576,
576 x 192, 576 x 1536, 1536 x 576, Q4_1 in the kernel's layout) at 1-256 rows: the fused kernel,
the bf16 tiles and the AMX kernel, median microseconds a call.
Prints Markdown rows and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

_RUN = r"""
import json, sys, time
from jaxserve import LLM, SamplingParams
from jaxserve.layers import int4_cpu
batches, max_tokens, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
topics = ["the ocean", "volcanoes", "the moon", "bread baking", "honey bees", "the internet", "chess", "rainbows"]
kinds = ["Write a paragraph about {}.", "Explain {} to a child.", "List facts about {}.", "Tell a story about {}.",
         "Why does {} matter?", "Describe {} in detail.", "What is surprising about {}?", "Summarize {}."]
prompts = [k.format(t) for t in topics for k in kinds]
llm = LLM(max_num_seqs=max(batches), max_model_len=1024)
res = {"amx": int4_cpu.amx()}
for b in batches:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:b], params, use_tqdm=False)          # compiles every bucket this uses
    t0 = time.perf_counter()
    outs = llm.generate(prompts[:b], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    res[str(b)] = {"tok_s": b * max_tokens / seconds, "ids": [o.outputs[0].token_ids for o in outs]}
json.dump(res, open(out, "w"))
"""


def engine(batches: list[int], max_tokens: int, rounds: int) -> dict:
    best: dict = {}
    ids: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for on in (True, False):
                out = os.path.join(tmp, f"{r}-{on}.json")
                env = dict(os.environ, JAXSERVE_CPU_AMX="1" if on else "0")
                subprocess.run([sys.executable, "-c", _RUN, json.dumps(batches), str(max_tokens), out], env=env,
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                res = json.load(open(out))
                if on and not res["amx"]:
                    raise SystemExit("the AMX kernel does not run here (int4_cpu.amx() is False)")
                for b in batches:
                    key = (b, on)
                    best[key] = max(best.get(key, 0.0), res[str(b)]["tok_s"])
                    ids.setdefault(key, res[str(b)]["ids"])
                print(f"round {r + 1} amx={on}: " + ", ".join(f"batch {b} {res[str(b)]['tok_s']:.1f} tok/s"
                                                             for b in batches), flush=True)
    rows = []
    for b in batches:
        same = sum(a == t for a, t in zip(ids[(b, True)], ids[(b, False)]))
        rows.append(dict(batch=b, amx_tok_s=best[(b, True)], tiles_tok_s=best[(b, False)],
                         ratio=best[(b, True)] / best[(b, False)], identical=f"{same}/{b}"))
    return {"engine": rows}


def matrices(rows_list: list[int]) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.layers import int4_cpu
    from jaxserve.layers.int4 import Int4Weight, pack, with_bf16_tiles, with_fused_kernel
    from jaxserve.layers.int4_layout import cpu_layout
    from jaxserve.layers.linear import linear

    rng = np.random.default_rng(0)

    def timed(f, x):
        f(x).block_until_ready()
        runs = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(20):
                y = f(x)
            y.block_until_ready()
            runs.append((time.perf_counter() - t0) / 20)
        return 1e6 * sorted(runs)[3]

    out = []
    for k, n in [(576, 576), (576, 192), (576, 1536), (1536, 576)]:
        w = Int4Weight(q=pack(jnp.asarray(rng.integers(0, 16, (k, n)), jnp.int32)),
                       scale=jnp.asarray(rng.uniform(0.01, 0.02, (k // 32, n)), jnp.float16).astype(jnp.float32),
                       offset=jnp.asarray(rng.uniform(-0.1, 0, (k // 32, n)), jnp.float32), group_size=32, zero_point=0)
        forms = {"fused": cpu_layout(with_fused_kernel(w, max_rows=1 << 20, int8_x=int4_cpu.int8_dot() is not None)),
                 "tiles": with_bf16_tiles(w, min_rows=1),
                 "amx": cpu_layout(with_fused_kernel(with_bf16_tiles(w, min_rows=1), max_rows=0, amx_min_rows=1))}
        for m in rows_list:
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            us = {name: timed(jax.jit(lambda x, f=f: linear(x, f)), x) for name, f in forms.items()}
            out.append(dict(k=k, n=n, rows=m, **{f"{name}_us": round(v, 1) for name, v in us.items()}))
            print(f"{k} x {n}, {m} rows: " + ", ".join(f"{name} {v:.0f} us" for name, v in us.items()), flush=True)
    return {"matrices": out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--matrices", action="store_true")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256])
    a = ap.parse_args()
    result = dict(machine=platform.machine(), date=time.strftime("%Y-%m-%d"))
    result.update(engine(a.batches, a.max_tokens, a.rounds))
    for r in result["engine"]:
        print(f"| default model, batch {r['batch']} x {a.max_tokens} tokens | AMX {r['amx_tok_s']:.1f} tok/s | "
              f"bf16 tiles {r['tiles_tok_s']:.1f} tok/s | **{r['ratio']:.2f}x** | greedy identical {r['identical']} |")
    if a.matrices:
        result.update(matrices(a.rows))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
