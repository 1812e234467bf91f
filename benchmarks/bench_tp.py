"""Decode step time per tensor-parallel size.

    python benchmarks/bench_tp.py                       # CPU: 8 simulated devices, TP 1 2 4 8
    python benchmarks/bench_tp.py --tp 1,2,4,8 --simulate-cpu-devices 0 --model DIR --batch 64
                                                        # a machine with 8 GPUs, real weights
    python benchmarks/bench_tp.py --model benchmarks/configs/qwen3-moe-tp-smoke \
        --load-format dummy --dtype float32 --enable-expert-parallel    # MoE, whole experts

Each size runs in its own process (the device count is fixed when jax starts). The engine is
built with `tensor_parallel_size=N`, `batch` requests are prefilled, then `--steps` engine steps
of pure decode (every request one token) are timed one by one (`LLMEngine.step`: schedule,
jitted step, update; the bare step is >99% of it on CPU). Prints the median and p90 step time,
decode tokens/s and per-device weight / KV bytes (measured from device 0's shards) as JSON lines
and a Markdown table.

On CPU the simulated devices share the host's cores, so TP adds collectives without adding
compute: the CPU figure is a smoke test that the sharded step compiles and runs, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import json, statistics, sys, time
import jax
from jaxserve import LLM, SamplingParams
a = json.loads(sys.argv[1])
kw = dict(load_format=a["load_format"], seed=0) if a["load_format"] != "auto" else {}
if a["dtype"]:
    kw["dtype"] = a["dtype"]
llm = LLM(model=a["model"], tensor_parallel_size=a["tp"], enable_expert_parallel=a["ep"],
          max_model_len=a["max_model_len"],
          max_num_seqs=a["batch"], max_num_batched_tokens=a["max_num_batched_tokens"],
          num_gpu_blocks_override=a["num_blocks"], compilation_cache_dir="", warmup=False, **kw)
eng = llm.llm_engine
params = SamplingParams(temperature=0, max_tokens=a["steps"] + 8, ignore_eos=True)
for i in range(a["batch"]):
    eng.add_request(f"r{i}", {"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(a["prompt_len"])]},
                    params)
while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in eng.scheduler.running) or \
        eng.scheduler.waiting:
    eng.step()
eng.step()   # the first pure-decode step compiles its bucket; not timed
times = []
for _ in range(a["steps"]):
    t0 = time.perf_counter()
    eng.step()
    times.append(time.perf_counter() - t0)
r = eng.runner
dev0 = lambda t: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(t))
times.sort()
med = statistics.median(times)
print("RESULT" + json.dumps({"tp": a["tp"], "ep": a["ep"], "median_ms": 1e3 * med,
      "p90_ms": 1e3 * times[int(0.9 * len(times))],
      "decode_tok_s": a["batch"] / med, "weight_bytes_per_device": dev0(r.weights),
      "kv_bytes_per_device": dev0(r.cache), "device": str(jax.devices()[0]),
      "num_devices": len(jax.devices()), "jax": jax.__version__}))
llm.shutdown()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: the embedded model)")
    ap.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tp", default="1,2,4,8", help="comma-separated tensor-parallel sizes")
    ap.add_argument("--enable-expert-parallel", action="store_true",
                    help="MoE models: whole experts per device (default: experts' F split over tp)")
    ap.add_argument("--simulate-cpu-devices", type=int, default=8,
                    help="XLA host devices to simulate on CPU (0: use the real devices)")
    ap.add_argument("--batch", type=int, default=8, help="concurrent decoding requests")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=256, help="KV blocks (the same for every size)")
    a = ap.parse_args()
    env = dict(os.environ)
    if a.simulate_cpu_devices:
        env.update(JAX_PLATFORMS="cpu",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={a.simulate_cpu_devices}")
    rows = []
    for tp in [int(x) for x in a.tp.split(",")]:
        cfg = dict(vars(a), tp=tp, ep=a.enable_expert_parallel)
        proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cfg)], capture_output=True, text=True,
                              env=env)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
        if proc.returncode or not lines:
            sys.exit(f"tp={tp} failed:\n{proc.stderr[-3000:]}")
        row = json.loads(lines[0][len("RESULT"):])
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\nbatch {a.batch}, prompt {a.prompt_len}, {a.steps} decode steps, {rows[0]['device']} "
          f"x{rows[0]['num_devices']}, jax {rows[0]['jax']}\n")
    print("| TP | EP | median step ms | p90 ms | decode tok/s | weight MiB/device | KV MiB/device |")
    print("|---:|:---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tp']} | {'yes' if r['ep'] else 'no'} | {r['median_ms']:.1f} | {r['p90_ms']:.1f} | "
              f"{r['decode_tok_s']:.0f} | "
              f"{r['weight_bytes_per_device'] / 2**20:.1f} | {r['kv_bytes_per_device'] / 2**20:.1f} |")


if __name__ == "__main__":
    main()
