"""Soak test: N concurrent clients against a real `jaxserve serve` for a while, misbehaving on
purpose, then checks that the server kept its promises.

Each client loops until the deadline, picking per request: a streamed completion or chat read to
the end; a stream it drops after a chunk or two (disconnect); a slow reader (sleeps between
chunks); a plain JSON request; a request cancelled by a short timeout before the answer. Reports
requests served, server errors (5xx or broken connections the client did not cause; target 0),
p50/p99 latency of completed requests, KV blocks still held once idle (target 0) and the server's
RSS over time.

    python benchmarks/soak.py --clients 32 --duration 300          # 5 minutes
    python benchmarks/soak.py --clients 16 --duration 60           # what the test suite runs
    python benchmarks/soak.py --append-results                     # add a block to RESULTS.md

Exit code 0 when there were no errors and nothing leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
SERVER_ARGS = ["--max-model-len", "512", "--max-num-batched-tokens", "128", "--max-num-seqs",
               "32", "--num-gpu-blocks-override", "512", "--disable-access-log"]
PROMPTS = ["Tell me about the sea.", "List three fruits:", "def square(x):", "Once upon a time",
           "The history of Rome in one sentence:", "Why is the sky blue?", "1, 2, 3, 4,"]
BEHAVIOURS = (("stream", 0.45), ("chat_stream", 0.15), ("disconnect", 0.12), ("slow", 0.1),
              ("json", 0.12), ("cancel", 0.06))


@dataclasses.dataclass
class Tally:
    served: int = 0
    disconnects: int = 0
    cancels: int = 0
    errors: list = dataclasses.field(default_factory=list)
    latencies: list = dataclasses.field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def _metrics(session, base) -> dict[str, float]:
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("jaxserve:") and "{" in line:
            name, value = line.split("{")[0], line.rsplit(" ", 1)[1]
            out[name] = float(value)
    return out


async def _one(session, base, rng: random.Random, tally: Tally) -> None:
    kind = rng.choices([b for b, _ in BEHAVIOURS], [w for _, w in BEHAVIOURS])[0]
    body = {"max_tokens": rng.randint(1, 40), "temperature": rng.choice([0.0, 0.8]),
            "seed": rng.randrange(1000)}
    if kind == "chat_stream":
        url = base + "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    else:
        url = base + "/v1/completions"
        body["prompt"] = rng.choice(PROMPTS)
    body["stream"] = kind != "json"
    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=0.05 if kind == "cancel" else 120)
    try:
        async with session.post(url, json=body, timeout=timeout) as r:
            if r.status != 200:
                tally.errors.append(f"{kind}: HTTP {r.status}: {(await r.text())[:200]}")
                return
            if kind == "json":
                data = await r.json()
                assert data["choices"][0]["finish_reason"] in ("stop", "length"), data
            else:
                chunks, done = 0, False
                async for line in r.content:
                    if line.startswith(b"data: [DONE]"):
                        done = True
                        break
                    if line.startswith(b"data: "):
                        json.loads(line[6:])
                        chunks += 1
                    if kind == "disconnect" and chunks >= rng.randint(1, 2):
                        tally.disconnects += 1
                        return                     # leaving the block closes the connection
                    if kind == "slow":
                        await asyncio.sleep(0.2)
                if not done:
                    tally.errors.append(f"{kind}: stream ended without [DONE]")
                    return
        tally.served += 1
        tally.latencies.append(time.perf_counter() - t0)
    except TimeoutError:
        if kind == "cancel":
            tally.cancels += 1
        else:
            tally.errors.append(f"{kind}: timed out after 120 s")
    except (aiohttp.ClientError, AssertionError, ValueError) as e:
        tally.errors.append(f"{kind}: {type(e).__name__}: {e}")


async def _client(base, seed, deadline, tally):
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            await _one(session, base, rng, tally)


async def _soak(base, pid, clients, duration, rss):
    tally = Tally()
    deadline = time.monotonic() + duration

    async def sample_rss():
        while time.monotonic() < deadline:
            rss.append((time.monotonic(), _rss_mib(pid)))
            await asyncio.sleep(2)

    await asyncio.gather(sample_rss(), *(_client(base, i, deadline, tally)
                                         for i in range(clients)))
    async with aiohttp.ClientSession() as session:      # idle: everything must be released
        for _ in range(60):
            m = await _metrics(session, base)
            if not m.get("jaxserve:num_requests_running") and \
                    not m.get("jaxserve:num_requests_waiting"):
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(1)
        m = await _metrics(session, base)
    return tally, m


def _start_server(model, extra, log):
    port = _free_port()
    cmd = [sys.executable, "-m", "jaxserve.server.cli", "serve", *([model] if model else []),
           "--port", str(port), *SERVER_ARGS, *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    base = f"http://127.0.0.1:{port}"
    import urllib.request
    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("server not ready after 600 s")


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--model", default=None, help="model path (default: the embedded model)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra serve flag")
    ap.add_argument("--log", default="/tmp/jaxserve-soak-server.log")
    ap.add_argument("--append-results", action="store_true")
    args = ap.parse_args(argv)

    with open(args.log, "w") as log:
        proc, base = _start_server(args.model, args.server_arg, log)
        rss: list = []
        try:
            tally, metrics = asyncio.run(_soak(base, proc.pid, args.clients, args.duration, rss))
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(120)
    kv = metrics.get("jaxserve:kv_cache_usage_perc", float("nan"))
    running = metrics.get("jaxserve:num_requests_running", float("nan"))
    leaked = kv != 0.0 or running != 0.0
    mibs = [m for _, m in rss if m is not None]
    q = max(1, len(mibs) // 4)
    first, last = sum(mibs[:q]) / q, sum(mibs[-q:]) / q
    lines = [
        f"### Soak: {args.clients} clients x {args.duration:.0f} s "
        f"({datetime.date.today()}, `python benchmarks/soak.py --clients {args.clients} "
        f"--duration {args.duration:.0f}`)", "",
        "| served | disconnects | cancels | errors | p50 s | p99 s | KV usage idle | running idle "
        "| RSS first/last quarter MiB | exit |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {tally.served} | {tally.disconnects} | {tally.cancels} | {len(tally.errors)} | "
        f"{_pct(tally.latencies, 0.5):.2f} | {_pct(tally.latencies, 0.99):.2f} | {kv:.3f} | "
        f"{running:.0f} | {first:.0f} / {last:.0f} | {code} |"]
    print("\n".join(lines))
    for e in tally.errors[:20]:
        print("error:", e)
    if args.append_results:
        with open(REPO / "benchmarks" / "RESULTS.md", "a") as f:
            f.write("\n" + "\n".join(lines) + "\n")
    return 0 if not tally.errors and not leaked and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
