"""Two commits side by side: run each commit's own `benchmarks/bench_engine.py` in turns (A B A B
...) on this machine and report both, so load from other processes hits both alike.

    python benchmarks/bench_ab.py BEFORE [AFTER] [--rounds 2] [-- bench_engine flags]

AFTER defaults to the working tree. Each commit is checked out in a temporary git worktree and
imported from there (PYTHONPATH), with the default model and the compilation cache of this
machine. Reports per round and the median of each: jaxserve tokens/s and engine efficiency
(bench_engine's end-to-end over bare-step figure), and the after/before ratio of the medians.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIGURES = {"tokens/s": r"jaxserve `LLM.generate` tokens/s \| ([\d.]+)",
           "efficiency": r"engine efficiency = e2e / bare \(target >= 0.9\) \| ([\d.]+)"}


def run_once(tree: Path, flags: list[str]) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, str(tree / "benchmarks" / "bench_engine.py"),
                          "--skip-transformers", *flags], cwd=tree, env=env, capture_output=True,
                         text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"bench_engine failed in {tree}:\n{out.stderr[-3000:]}")
    found = {}
    for name, pattern in FIGURES.items():
        m = re.search(pattern, out.stdout)
        if m is None:
            raise RuntimeError(f"no {name!r} in the output of {tree}:\n{out.stdout[-3000:]}")
        found[name] = float(m.group(1))
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after", nargs="?", default=None, help="default: the working tree")
    ap.add_argument("--rounds", type=int, default=2)
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.flags = flags
    with tempfile.TemporaryDirectory(prefix="jaxserve-ab-") as tmp:
        trees = {}
        for label, rev in (("before", args.before), ("after", args.after)):
            if rev is None:
                trees[label] = REPO
                continue
            path = Path(tmp) / label
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(path),
                            rev], check=True)
            trees[label] = path
        try:
            results = {label: [] for label in trees}
            for r in range(args.rounds):
                for label, tree in trees.items():
                    res = run_once(tree, args.flags)
                    results[label].append(res)
                    print(f"round {r + 1} {label}: {res}", flush=True)
        finally:
            for label, rev in (("before", args.before), ("after", args.after)):
                if rev is not None:
                    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                    str(trees[label])], check=False)
    names = {"before": args.before, "after": args.after or "working tree"}
    print("\n| | " + " | ".join(f"{label} ({names[label]})" for label in results) + " | after / before |")
    print("|---|" + "---:|" * (len(results) + 1))
    for fig in FIGURES:
        med = {label: statistics.median(x[fig] for x in runs) for label, runs in results.items()}
        print(f"| {fig} (median of {args.rounds}) | " + " | ".join(f"{med[k]:.3f}" for k in results)
              + f" | {med['after'] / med['before']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
