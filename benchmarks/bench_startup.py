"""Server start-up time: spawn `jaxserve serve` and time until /health answers 200.

Cold: an empty --compilation-cache-dir (every model program is compiled). Warm: the same
directory again (programs are loaded from the persistent XLA cache). The server log's own
timestamps split the time into phases (python + jax import, tokenizer + weights, KV pool,
warm-up compile/load).

    python benchmarks/bench_startup.py [--model M] [--append-results] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import shutil
import signal
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
          ("KV pool", "KV cache:"), ("warm-up done", "warm-up:"), ("ready", "ready in")]


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


def run_once(cache_dir: str, model: str | None, extra: list[str]) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "jaxserve.server.cli", "serve", *([model] if model else []),
           "--port", str(port), "--compilation-cache-dir", cache_dir, *extra]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        while _health(f"http://127.0.0.1:{port}/health") != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {Path(log.name).read_text()[-2000:]}")
            time.sleep(0.05)
        total = time.time() - t0
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
    return {"total": total, "phases": phases, "command": " ".join(cmd[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--append-results", action="store_true",
                    help="append the figures to benchmarks/RESULTS.md")
    ap.add_argument("extra", nargs="*", help="extra `jaxserve serve` flags (after --)")
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="jaxserve-xla-")
    try:
        cold = run_once(cache, args.model, args.extra)
        warm = run_once(cache, args.model, args.extra)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    lines = []
    for name, r in (("cold", cold), ("warm", warm)):
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in r["phases"].items())
        lines.append(f"| {name} | {r['total']:.1f} s | {phases} |")
        print(f"{name}: {r['total']:.1f} s to /health 200 ({phases})")
    if args.append_results:
        results = Path(__file__).with_name("RESULTS.md")
        text = results.read_text() if results.exists() else "# Benchmark results\n"
        device = f"CPU ({platform.processor() or platform.machine()}, shared 2 cores)"
        block = (f"\n### {datetime.date.today()} — {device}\n\n"
                 f"Command: `python benchmarks/bench_startup.py {' '.join(sys.argv[1:])}` "
                 f"(server: `{cold['command'].replace(cache, '<fresh dir>')}`)\n\n"
                 "| run | spawn -> /health 200 | phases (seconds after spawn) |\n"
                 "| --- | --- | --- |\n" + "\n".join(lines) + "\n")
        if "## Server start-up" not in text:
            text = text.rstrip() + "\n\n## Server start-up\n"
        results.write_text(text.rstrip() + "\n" + block)


if __name__ == "__main__":
    main()
