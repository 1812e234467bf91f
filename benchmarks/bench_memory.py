"""Where a jaxserve process's memory goes: resident memory (RSS, split into anonymous and
file-backed pages) after each start-up stage, and the device arrays by role (weights, KV pool,
sampler state), for the engine `jaxserve serve` builds with the same flags.

    python benchmarks/bench_memory.py [--append-results] [-- engine flags as key=value ...]

Stages: python + jax + the server's imports; the engine built (weights, KV pool, sampler state;
no compile); the warm-up (every step program compiled or loaded); 64 requests served. On CPU the
"device" arrays live in the same RSS, so the table says how much of the RSS they are.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def rss_mib() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(line.split()[1]) // 1024
    return out


def arrays_by_role(engine) -> dict[str, float]:
    import jax
    runner = engine.runner
    roles = {"weights": runner.weights, "KV pool": runner.cache, "sampler state": runner.penalties}
    seen, out = set(), {}
    for role, tree in roles.items():
        leaves = [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]
        seen.update(id(x) for x in leaves)
        out[role] = sum(x.nbytes for x in leaves) / 2**20
    out["other arrays"] = sum(a.nbytes for a in jax.live_arrays() if id(a) not in seen) / 2**20
    return out


def parse_flags(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = int(value)
        except ValueError:
            out[key] = value
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--append-results", action="store_true")
    ap.add_argument("flags", nargs="*", help="EngineArgs overrides, e.g. num_gpu_blocks_override=512")
    args = ap.parse_args()
    kwargs = parse_flags(args.flags)

    rows = [("python start", rss_mib(), None)]
    import jax
    jax.devices()
    import jaxserve.server.http.api_server  # noqa: F401  (what `jaxserve serve` imports)
    from jaxserve import LLM, SamplingParams
    from jaxserve.engine.llm_engine import enable_compilation_cache
    enable_compilation_cache(None)          # as the CLI does
    rows.append(("jax + server imports", rss_mib(), None))

    t0 = time.perf_counter()
    llm = LLM(warmup=False, **kwargs)
    engine = llm.llm_engine
    gc.collect()
    rows.append(("engine built (weights, KV pool)", rss_mib(), arrays_by_role(engine)))
    engine.runner.warmup()
    gc.collect()
    rows.append(("warm-up (step programs)", rss_mib(), arrays_by_role(engine)))
    prompts = [f"Write a short note number {i} about memory." for i in range(args.requests)]
    llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.8, seed=0,
                                         presence_penalty=0.1), use_tqdm=False)
    gc.collect()
    rows.append((f"{args.requests} requests served", rss_mib(), arrays_by_role(engine)))
    wall = time.perf_counter() - t0

    cfg, cache = engine.model_config, engine.cache_config
    lines = [f"model {engine.model_name} ({cfg.architecture}, {engine.args.dtype}), KV pool "
             f"{cache.num_blocks} blocks x {cache.block_size} tokens, max_num_seqs "
             f"{engine.scheduler_config.max_num_seqs}; flags {kwargs or 'defaults'}", "",
             "| stage | RSS MiB | anon | file | weights | KV pool | sampler state | other arrays |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, rss, roles in rows:
        r = roles or {}
        cells = [f"{r[k]:.0f}" if k in r else "" for k in
                 ("weights", "KV pool", "sampler state", "other arrays")]
        lines.append(f"| {name} | {rss['VmRSS']} | {rss['RssAnon']} | {rss['RssFile']} | "
                     + " | ".join(cells) + " |")
    lines.append(f"\npeak RSS {rows[-1][1]['VmHWM']} MiB; {wall:.0f} s")
    report = "\n".join(lines)
    print(report)
    if args.append_results:
        stamp = datetime.date.today().isoformat()
        with RESULTS.open("a") as f:
            f.write(f"\n### Memory by stage ({stamp}, {platform.machine()} CPU, "
                    f"`python benchmarks/bench_memory.py {' '.join(args.flags)}`)\n\n{report}\n")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
