"""benchmarks/gpu_suite.sh off the GPU: `gpu_prepare.py --dry-run` compiles the suite's
configurations for this CPU (tiny shapes) and bundles them with the parity reference, then
`DRY_RUN=1 bash benchmarks/gpu_suite.sh` runs every stage of part 1 from that bundle: each engine
loads all its step programs (none compiled), the parity stage passes, the budget arithmetic
(stage ceilings + reserve <= 480 s) and the carried size (<= 64 MiB) are stated and checked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_dry_run_loads_every_program_and_fits_the_budget(tmp_path):
    gpu, work, out = tmp_path / "gpu", tmp_path / "work", tmp_path / "out"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path))
    prep = subprocess.run([sys.executable, "benchmarks/gpu_prepare.py", "--dry-run", "--out", str(gpu),
                           "--work", str(work)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert prep.returncode == 0, prep.stderr[-3000:]
    meta = json.loads((gpu / "bundle.json").read_text())
    assert meta["dry_run"] and meta["targets"] == ["cpu"] and meta["carried_bytes"] <= meta["carry_limit_bytes"]

    suite = subprocess.run(["bash", "benchmarks/gpu_suite.sh"], cwd=REPO, capture_output=True, text=True, timeout=900,
                           env=dict(env, DRY_RUN="1", GPU_DIR=str(gpu), OUT=str(out), PYTHON=sys.executable))
    assert suite.returncode == 0, suite.stdout[-3000:] + suite.stderr[-3000:]
    results = (out / "results.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "results.md"]     # <= 8 files come back

    budget = re.search(r"stage ceilings (\d+) s \+ reserve (\d+) s = (\d+) s of the (\d+) s budget", results)
    assert budget and int(budget[1]) + int(budget[2]) == int(budget[3]) <= int(budget[4]) == 480, results[:600]
    carried = re.search(r"carried: .* = ([\d.]+) MiB of 64 MiB", results)
    assert carried and float(carried[1]) <= 64

    stages = re.findall(r"^### (\w+): exit (\d+)", results, re.M)
    assert [s for s, _ in stages] == ["setup", "env", "parity", "decode_bf16", "decode_fp8", "decode_bf16_mosaic",
                                      "decode_fp8_mosaic", "kernels", "throughput"], stages
    assert all(rc == "0" for _, rc in stages), results
    # every engine loaded its programs from the bundle: none compiled, no directory refused
    engines = re.findall(r"^programs: (\d+) loaded from the compiled directory, \d+ loaded from the compilation cache, "
                         r"(\d+) compiled; compiled dir \S+: (\w+)", results, re.M)
    assert len(engines) == 4 + 4 + 1, results
    assert all(int(n) > 0 and k == "0" and how == "matched" for n, k, how in engines), engines
    assert len(re.findall(r"^\| \S+ \| .* \| ok \|$", results, re.M)) == 4          # the parity rows
    assert len(re.findall(r"^\| (1|4) \| 32 \| [\d.]+ \|", results, re.M)) == 2 * 4  # decode rows
    assert "Offline: 4 prompts" in results
