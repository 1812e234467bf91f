"""run-batch vs LLM.generate on the same requests and engine settings.

    python benchmarks/bench_batch.py [--num-requests 1000] [--max-tokens 16] [--max-num-seqs 64]

Writes N short completion requests (greedy, ignore_eos, the same max_tokens) as an OpenAI Batch
JSONL, runs `jaxserve run-batch` on it in a subprocess, then `LLM.generate` on the same prompts
in another subprocess with the same engine flags. Both figures exclude start-up and compilation
(warm-up runs before either clock starts): run-batch's own summary reports the wall time of its
request loop; LLM.generate is timed around the call. Prints one JSON line and a Markdown row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

_GENERATE = r"""
import json, sys, time
from jaxserve import LLM, SamplingParams
cfg = json.loads(sys.argv[1])
llm = LLM(**cfg["engine"])
prompts = [json.loads(l)["body"]["prompt"] for l in open(cfg["input"])]
params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True)
t0 = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
wall = time.perf_counter() - t0
toks = sum(len(o.outputs[0].token_ids) for o in outs)
print(json.dumps({"wall_s": wall, "completion_tokens": toks, "requests": len(outs),
                  "device": str(__import__("jax").devices()[0])}))
llm.shutdown()
"""


def engine_flags(a) -> dict:
    return {"max_model_len": a.max_model_len, "max_num_seqs": a.max_num_seqs,
            "max_num_batched_tokens": a.max_num_batched_tokens,
            **({"kv_cache_memory_bytes": a.kv_cache_memory_bytes}
               if a.kv_cache_memory_bytes else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    a = ap.parse_args()
    engine = engine_flags(a)
    tmp = tempfile.mkdtemp(prefix="bench_batch_")
    inp, out = os.path.join(tmp, "in.jsonl"), os.path.join(tmp, "out.jsonl")
    with open(inp, "w") as f:
        for i in range(a.num_requests):
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": f"Request {i}: write a short line about the "
                                                   f"number {i}.",
                                         "max_tokens": a.max_tokens, "temperature": 0,
                                         "ignore_eos": True}}) + "\n")
    flags = []
    for k, v in engine.items():
        flags += ["--" + k.replace("_", "-"), str(v)]
    cmd = [sys.executable, "-c", "import sys; from jaxserve.server.cli.main import main; sys.exit(main())",
           "run-batch", "-i", inp, "-o", out, "--disable-progress-bar", *flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    batch_total = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"run-batch failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    m = re.search(r"run-batch: (\d+) lines \((\d+) ok.*?\+ (\d+) completion tokens in ([\d.]+) s",
                  proc.stderr)
    lines, ok, batch_toks, batch_wall = int(m[1]), int(m[2]), int(m[3]), float(m[4])
    assert ok == a.num_requests, proc.stderr[-2000:]

    proc = subprocess.run([sys.executable, "-c", _GENERATE,
                           json.dumps({"engine": engine, "input": inp,
                                       "max_tokens": a.max_tokens})],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"LLM.generate failed:\n{proc.stderr[-3000:]}")
    gen = json.loads(proc.stdout.strip().splitlines()[-1])
    result = {
        "device": gen["device"], "host": platform.node(), "date": time.strftime("%Y-%m-%d"),
        "num_requests": a.num_requests, "max_tokens": a.max_tokens, "engine": engine,
        "run_batch": {"wall_s": round(batch_wall, 2), "req_per_s": round(lines / batch_wall, 2),
                      "tok_per_s": round(batch_toks / batch_wall, 1),
                      "process_total_s": round(batch_total, 1)},
        "llm_generate": {"wall_s": round(gen["wall_s"], 2),
                         "req_per_s": round(gen["requests"] / gen["wall_s"], 2),
                         "tok_per_s": round(gen["completion_tokens"] / gen["wall_s"], 1)},
    }
    result["ratio"] = round(result["run_batch"]["tok_per_s"] / result["llm_generate"]["tok_per_s"],
                            3)
    print(json.dumps(result))
    print(f"| {result['date']} | {result['device']} | {a.num_requests} x {a.max_tokens} tok | "
          f"{result['run_batch']['req_per_s']} req/s, {result['run_batch']['tok_per_s']} tok/s | "
          f"{result['llm_generate']['req_per_s']} req/s, {result['llm_generate']['tok_per_s']} "
          f"tok/s | {result['ratio']} |")


if __name__ == "__main__":
    main()
