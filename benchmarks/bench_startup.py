"""Server start-up time: spawn `jaxserve serve` and time until /health answers 200.

Cold: an empty --compilation-cache-dir (every model program is compiled) and an empty cache for
the fused CPU kernel's build (JAXSERVE_KERNEL_CACHE). Warm: the same
directory again (programs are loaded from the persistent XLA cache). The server log's own
timestamps split the time into phases (python + jax import, tokenizer + weights, KV pool,
warm-up compile/load, and the background warm-up's end). After /health answers 200 one
completion (a ~40-token prompt, 16 tokens) is timed: the first request a user sends.

    python benchmarks/bench_startup.py [--model M] [--append-results] [-- extra serve flags]
    python benchmarks/bench_startup.py --against REV [--rounds 2]   # also the tree at REV, A B A B

`--against` extracts REV with `git archive` into a temporary folder and runs both trees' servers
in turns (cold then warm each, with its own fresh cache directory), reporting the medians.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_fixtures import free_port  # noqa: E402

PHASES = [("listener", "HTTP listener on"), ("loading weights", "jaxserve.loader.loader: loading"),
          ("KV pool", "KV cache:"), ("warm-up done", "warm-up:"), ("ready", "ready in"),
          ("background warm-up done", "background warm-up done")]
PROMPT = ("A short history of the printing press: who built the first one, where it spread "
          "in the following fifty years, and what it changed for ordinary readers.")


def _health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _stamp(line: str) -> float | None:
    m = re.match(r"\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)
    if not m:
        return None
    return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _first_request(base: str) -> float:
    """Seconds for one completion right after /health 200 (the model named as /v1/models says)."""
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as r:
        model = json.load(r)["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.time()
    with urllib.request.urlopen(req, timeout=600) as r:
        json.load(r)
    return time.time() - t0


def run_once(cache_dir: str, model: str | None, extra: list[str], tree: str | None = None,
             wait_background: bool = False) -> dict:
    """One server start (from `tree`'s sources when given): seconds to /health 200, the phases
    from its log, the first request's latency. wait_background: keep it up until the log says
    the background warm-up is done (so a warm run after it finds every program cached)."""
    port = free_port()
    cmd = [sys.executable, "-m", "jaxserve.server.cli", "serve", *([model] if model else []),
           "--port", str(port), "--compilation-cache-dir", cache_dir, *extra]
    # the fused CPU kernel's build cache beside the XLA one: a cold start compiles it too
    env = dict(os.environ, JAXSERVE_KERNEL_CACHE=os.path.join(cache_dir, "kernels"),
               **({"PYTHONPATH": tree} if tree else {}))
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    t0 = time.time()
    # `python -m` puts the working directory first on sys.path: run in the tree itself
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tree)
    try:
        while _health(f"http://127.0.0.1:{port}/health") != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {Path(log.name).read_text()[-2000:]}")
            time.sleep(0.05)
        total = time.time() - t0
        first = _first_request(f"http://127.0.0.1:{port}")
        while wait_background and proc.poll() is None:
            text = Path(log.name).read_text()
            if "more building in the background" not in text or "background warm-up done" in text:
                break
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    text = Path(log.name).read_text()
    phases = {}
    for name, needle in PHASES:
        for line in text.splitlines():
            if needle in line and _stamp(line) is not None:
                phases[name] = _stamp(line) - t0
                break
    return {"total": total, "first_request": first, "phases": phases, "command": " ".join(cmd[1:])}


def _cold_warm(model, extra, tree=None, wait_background=False) -> tuple[dict, dict]:
    cache = tempfile.mkdtemp(prefix="jaxserve-xla-")
    try:
        return (run_once(cache, model, extra, tree, wait_background=wait_background),
                run_once(cache, model, extra, tree))
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _line(name: str, r: dict) -> str:
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in r["phases"].items())
    return f"| {name} | {r['total']:.1f} s | {r['first_request']:.2f} s | {phases} |"


def _extract(rev: str) -> str:
    """The tree at git `rev` in a temporary folder (its jaxserve/server linked to ours)."""
    here = str(Path(__file__).resolve().parents[1])
    tmp = tempfile.mkdtemp(prefix="bench_startup_")
    archive = subprocess.run(["git", "-C", here, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    (Path(tmp) / "jaxserve" / "server").unlink(missing_ok=True)
    os.symlink(os.path.join(here, "server"), os.path.join(tmp, "jaxserve", "server"))
    return tmp


def against(args) -> None:
    """A B A B: both trees' cold and warm starts, in turns; medians per tree."""
    here = str(Path(__file__).resolve().parents[1])
    trees = {f"git {args.against}": _extract(args.against), "this tree": here}
    runs = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, tree in trees.items():
            cold, warm = _cold_warm(args.model, args.extra, tree)
            runs[name].append((cold, warm))
            print(f"round {r} {name}: cold {cold['total']:.1f} s, warm {warm['total']:.1f} s to /health "
                  f"200; first request {cold['first_request']:.2f} / {warm['first_request']:.2f} s",
                  flush=True)
    print("\n| tree | run | spawn -> /health 200 (median) | first request (median) |")
    print("| --- | --- | --- | --- |")
    for name, rs in runs.items():
        for i, kind in enumerate(("cold", "warm")):
            print(f"| {name} | {kind} | {statistics.median(x[i]['total'] for x in rs):.1f} s | "
                  f"{statistics.median(x[i]['first_request'] for x in rs):.2f} s |")
    print("\nlast round's phases (seconds after spawn):")
    for name, rs in runs.items():
        for i, kind in enumerate(("cold", "warm")):
            print(_line(f"{name} {kind}", rs[-1][i]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--append-results", action="store_true",
                    help="append the figures to benchmarks/RESULTS.md")
    ap.add_argument("--against", help="git revision to compare with (A B A B)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two trees")
    ap.add_argument("extra", nargs="*", help="extra `jaxserve serve` flags (after --)")
    args = ap.parse_args()
    if args.against:
        against(args)
        return
    cold, warm = _cold_warm(args.model, args.extra, wait_background=True)
    lines = []
    for name, r in (("cold", cold), ("warm", warm)):
        lines.append(_line(name, r))
        print(f"{name}: {r['total']:.1f} s to /health 200, first request {r['first_request']:.2f} s "
              f"({', '.join(f'{k} {v:.1f} s' for k, v in r['phases'].items())})")
    if args.append_results:
        results = Path(__file__).with_name("RESULTS.md")
        text = results.read_text() if results.exists() else "# Benchmark results\n"
        device = f"CPU ({platform.processor() or platform.machine()}, shared 2 cores)"
        command = re.sub(r"--compilation-cache-dir \S+", "--compilation-cache-dir <fresh dir>",
                         cold["command"])
        block = (f"\n### {datetime.date.today()} — {device}\n\n"
                 f"Command: `python benchmarks/bench_startup.py {' '.join(sys.argv[1:])}` "
                 f"(server: `{command}`)\n\n"
                 "| run | spawn -> /health 200 | first request | phases (seconds after spawn) |\n"
                 "| --- | --- | --- | --- |\n" + "\n".join(lines) + "\n")
        if "## Server start-up" not in text:
            text = text.rstrip() + "\n\n## Server start-up\n"
        results.write_text(text.rstrip() + "\n" + block)


if __name__ == "__main__":
    main()
