"""Server vs offline engine throughput on the same prompts, in one sitting (issue: async scheduling).

    python benchmarks/bench_server.py                 # 64 streamed completions x 64 tokens, concurrency 32
    python benchmarks/bench_server.py --rounds 3 --append
    python benchmarks/bench_server.py --stream-interval 4     # and a server with --stream-interval 4

The default model (SmolLM2-135M GGUF, `--dtype auto`). Two `jaxserve serve` processes are
started, one with async scheduling (the default) and one with `--no-async-scheduling`, and an
offline `LLM` in this process, all with the same engine flags. Each round, in turn (A B C D ...):
`jaxserve bench serve`'s client sends the 64 prompts as streamed completions (ignore_eos,
greedy) to each server at concurrency 32 and counts output tokens by the streams' `usage`; the
offline engine generates the same 64 prompts with the same parameters in one `generate` call,
and so does a second offline engine with `max_num_seqs` = the concurrency (the server's batch:
what the server's own overhead is measured against). Reports output tok/s of each (best and
median round) and the server / offline ratios: of the best rounds, and the median over rounds of
each round's server / capped ratio (the capped engine runs right after the async server, so a
noisy stretch of the machine touches both: steadier than best-of on a shared machine). Only one
works at a time (the idle servers wait on an event); measuring starts once both servers'
background warm-ups are done (their logs say so), as their compiles would otherwise take the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_FLAGS = dict(max_model_len=1024, max_num_seqs=64, seed=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(asynchronous: bool, log_path: str, stream_interval: int = 1) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "jaxserve.server.cli", "serve", "--port", str(port),
           "--max-model-len", str(ENGINE_FLAGS["max_model_len"]), "--max-num-seqs", str(ENGINE_FLAGS["max_num_seqs"]),
           "--seed", str(ENGINE_FLAGS["seed"]), "--disable-log-requests"]
    if not asynchronous:
        cmd.append("--no-async-scheduling")
    if stream_interval > 1:
        cmd += ["--stream-interval", str(stream_interval)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(url: str, proc: subprocess.Popen, log_path: str, timeout: float = 900) -> None:
    """/health 200, then the background warm-up (if one was started) done."""
    deadline = time.monotonic() + timeout
    healthy = False
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        if not healthy:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    healthy = r.status == 200
            except OSError:
                pass
        if healthy:
            text = Path(log_path).read_text()
            if "building in the background" not in text or "background warm-up done" in text:
                return
        time.sleep(1)
    raise TimeoutError(f"{url} not ready (warm-up included) in {timeout} s")


async def serve_round(url: str, requests, concurrency: int) -> float:
    """Output tok/s of one round of streamed completions (tokens counted by `usage`)."""
    from jaxserve.default_model import DEFAULT_MODEL_NAME
    from jaxserve.server.bench.serve import request_body, run_requests
    ns = argparse.Namespace(temperature=0.0, ignore_eos=True, top_p=None, top_k=None, min_p=None)
    bodies = [request_body(DEFAULT_MODEL_NAME, r, False, ns) for r in requests]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        outcomes, wall = await run_requests(session, url + "/v1/completions", bodies, requests, False, None,
                                            request_rate=float("inf"), burstiness=1.0,
                                            max_concurrency=concurrency, seed=0)
    failed = [o.error for o in outcomes if not o.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return sum(o.output_tokens for o in outcomes) / wall


def offline_round(llm, requests) -> float:
    from jaxserve import SamplingParams
    params = [SamplingParams(max_tokens=r.expected_output_len, temperature=0.0, ignore_eos=True) for r in requests]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--append", action="store_true")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="N > 1: a third server, async with --stream-interval N, in the rotation")
    args = ap.parse_args()
    from jaxserve import LLM
    from jaxserve.default_model import DEFAULT_MODEL_NAME
    from jaxserve.engine.llm_engine import enable_compilation_cache
    from jaxserve.server.bench.datasets import random_requests
    from jaxserve.server.bench.serve import load_tokenizer

    enable_compilation_cache(None)          # as the servers do (the CLI's default cache)
    requests = random_requests(load_tokenizer(DEFAULT_MODEL_NAME), args.num_prompts, args.input_len,
                               args.output_len, seed=0)
    logs = tempfile.TemporaryDirectory()
    modes = {"async": (True, 1), "sync": (False, 1)}
    if args.stream_interval > 1:
        modes["interval"] = (True, args.stream_interval)
    servers = {name: start_server(asynchronous, os.path.join(logs.name, f"{name}.log"), interval)
               for name, (asynchronous, interval) in modes.items()}
    try:
        for name, (proc, url) in servers.items():
            wait_ready(url, proc, os.path.join(logs.name, f"{name}.log"))
        llm = LLM(**ENGINE_FLAGS, program_cache_dir="")
        capped = LLM(**dict(ENGINE_FLAGS, max_num_seqs=args.concurrency), program_cache_dir="")
        offline_round(llm, requests[:4])            # warm
        offline_round(capped, requests[:4])
        for _, url in servers.values():
            asyncio.run(serve_round(url, requests[:4], args.concurrency))
        order = ["async", "capped", "sync", "offline"] + (["interval"] if "interval" in servers else [])
        got = {name: [] for name in order}
        for r in range(args.rounds):
            for name in order:
                if name in ("offline", "capped"):
                    tps = offline_round(llm if name == "offline" else capped, requests)
                else:
                    tps = asyncio.run(serve_round(servers[name][1], requests, args.concurrency))
                got[name].append(tps)
                print(f"round {r}: {name} {tps:.1f} tok/s", flush=True)
        llm.shutdown()
        capped.shutdown()
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
        logs.cleanup()
    best = {k: max(v) for k, v in got.items()}
    med = {k: statistics.median(v) for k, v in got.items()}
    paired = {k: statistics.median(s / c for s, c in zip(got[k], got["capped"]))
              for k in ("async", "sync", "interval") if k in got}
    date = datetime.date.today().isoformat()

    def row(name: str) -> str:
        return f"{best[name]:.1f} ({med[name]:.1f})"
    table = "\n".join([
        f"### Server vs offline engine, same prompts ({date})", "",
        f"`python benchmarks/bench_server.py --num-prompts {args.num_prompts} --input-len {args.input_len} "
        f"--output-len {args.output_len} --concurrency {args.concurrency} --rounds {args.rounds}"
        f"{f' --stream-interval {args.stream_interval}' if args.stream_interval > 1 else ''}` on "
        f"{platform.machine()} ({os.cpu_count()} cores); default model, greedy, ignore_eos; best and "
        "median of the rounds, the engines in turn each round.", "",
        "| what | output tok/s, best (median) | best / offline | / capped, median of rounds |",
        "|---|---|---|---|",
        f"| offline `LLM.generate` (all prompts at once) | {row('offline')} | 1.00x | |",
        f"| offline `LLM.generate`, `max_num_seqs` {args.concurrency} (the server's batch) | "
        f"{row('capped')} | {best['capped'] / best['offline']:.2f}x | 1.00x |",
        f"| server, async scheduling (default), concurrency {args.concurrency} | {row('async')} | "
        f"{best['async'] / best['offline']:.2f}x | {paired['async']:.2f}x |",
        f"| server, `--no-async-scheduling`, concurrency {args.concurrency} | {row('sync')} | "
        f"{best['sync'] / best['offline']:.2f}x | {paired['sync']:.2f}x |"]
        + ([f"| server, async, `--stream-interval {args.stream_interval}`, concurrency {args.concurrency} | "
            f"{row('interval')} | {best['interval'] / best['offline']:.2f}x | {paired['interval']:.2f}x |"]
           if "interval" in best else [])
        + ["", f"Server (async) / offline at the same batch: {best['async'] / best['capped']:.2f}x of the best "
           f"rounds, {paired['async']:.2f}x the median of the rounds' ratios"
           + (f"; with `--stream-interval {args.stream_interval}`: {best['interval'] / best['capped']:.2f}x, "
              f"{paired['interval']:.2f}x." if "interval" in best else ".")]) + "\n"
    print(table)
    if args.append:
        with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "a") as f:
            f.write("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
