"""What a compiled GPU kernel takes from an SM: parsers of ptxas' verbose output, of PTX launch
bounds, of XLA's thunk sequence and of Mosaic GPU's resource dump, and the occupancy formula.

Pure Python (no jax): `jaxserve.aot.kernels` feeds it the files a compile for an H100 leaves
behind; the tests feed it text.
"""

from __future__ import annotations

import glob
import math
import os
import re
import shutil
import subprocess

# Hopper (sm_90: H100, H200) per-SM limits, CUDA programming guide table 21 / occupancy calculator
REGISTERS_PER_SM = 64 * 1024
REGISTER_ALLOC_UNIT = 256          # registers are allocated per warp in units of 256
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_CTA = 1024       # the hardware keeps 1 KiB of each resident CTA's shared memory
MAX_CTAS_PER_SM = 32
MAX_THREADS_PER_SM = 2048
WARP = 32

_FUNC = re.compile(r"Function properties for (\S+)")
_COMPILING = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")
_ENTRY = re.compile(r"\.entry\s+([\w$.]+)\s*\(")
_NTID = re.compile(r"\.(?:reqntid|maxntid)\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?")
_THUNK = re.compile(r"^\s*\d+: kCustomKernel\s+\[[^\]]*\]\s+(\S+)\s+grid: \[(\d+), (\d+), (\d+)\]\s+"
                    r"threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+) bytes")


def parse_ptxas(text: str) -> dict[str, dict]:
    """ptxas -v output -> {entry function: {registers, spill_stores, spill_loads, spill_bytes,
    stack_frame, barriers, smem_static}} (bytes; smem_static is the .shared the PTX declares,
    not the dynamic shared memory given at launch). Functions ptxas gives no "Used" line for
    (none use registers) are left out."""
    out: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        m = _COMPILING.search(line) or _FUNC.search(line)
        if m:
            current = out.setdefault(m.group(1), {"registers": None, "spill_stores": 0, "spill_loads": 0,
                                                  "spill_bytes": 0, "stack_frame": 0, "barriers": 0,
                                                  "smem_static": 0})
            continue
        if current is None:
            continue
        if m := _FRAME.search(line):
            frame, stores, loads = map(int, m.groups())
            current.update(stack_frame=frame, spill_stores=stores, spill_loads=loads, spill_bytes=stores + loads)
        elif m := _USED.search(line):
            current.update(registers=int(m.group(1)), barriers=int(m.group(2) or 0), smem_static=int(m.group(3) or 0))
    return {k: v for k, v in out.items() if v["registers"] is not None}


def parse_ptx_threads(ptx: str) -> dict[str, int]:
    """PTX -> {entry function: threads per CTA} from each entry's `.reqntid` / `.maxntid`
    (Triton and XLA emit reqntid, Mosaic GPU maxntid: the block it launches)."""
    out = {}
    for m in _ENTRY.finditer(ptx):
        body = ptx[m.end():ptx.find("{", m.end())]          # directives sit between ")" and "{"
        if n := _NTID.search(body):
            out[m.group(1)] = math.prod(int(g or 1) for g in n.groups())
    return out


def parse_thunk_sequence(text: str) -> list[dict]:
    """XLA's `*.thunk_sequence.txt` -> one dict per kernel launch {name, grid, threads,
    shared_memory} (dynamic shared memory given at launch, bytes). Custom calls (Mosaic GPU)
    carry no launch dimensions there and are not listed."""
    out = []
    for line in text.splitlines():
        if m := _THUNK.match(line):
            g = [int(x) for x in m.groups()[1:]]
            out.append({"name": m.group(1), "grid": tuple(g[:3]), "threads": math.prod(g[3:6]),
                        "shared_memory": g[6]})
    return out


def parse_mosaic_resources(text: str) -> int:
    """Mosaic GPU's `*.resources.txt` (`Resources(smem_scratch_bytes=..., barrier_counts=...)`)
    -> the dynamic shared memory its launch asks for: the scratch bytes plus 8 bytes per mbarrier
    (jax.experimental.mosaic.gpu.core._smem_tree_size)."""
    m = re.search(r"smem_scratch_bytes=(\d+)", text)
    if m is None:
        raise ValueError(f"no smem_scratch_bytes in Mosaic GPU resources: {text[:200]!r}")
    barriers = sum(int(n) * int(c) for n, c in re.findall(r"num_barriers=(\d+)[^)]*\): (\d+)", text))
    return int(m.group(1)) + 8 * barriers


def ctas_per_sm(registers: int | None, threads: int | None, smem_bytes: int | None) -> int | None:
    """CTAs of a kernel one Hopper SM holds at once: the least of
      registers: 65536 // (warps per CTA * ceil(registers * 32 / 256) * 256)  (per-warp allocation)
      shared memory: 228 KiB // (smem_bytes + 1 KiB reserved per CTA)
      threads: 2048 // threads;  CTAs: 32.
    None when registers or threads are unknown (shared memory unknown counts as none used)."""
    if not registers or not threads:
        return None
    warps = -(-threads // WARP)
    per_warp = -(-registers * WARP // REGISTER_ALLOC_UNIT) * REGISTER_ALLOC_UNIT
    limits = [REGISTERS_PER_SM // (warps * per_warp), MAX_THREADS_PER_SM // (warps * WARP), MAX_CTAS_PER_SM,
              SMEM_PER_SM // ((smem_bytes or 0) + SMEM_RESERVED_PER_CTA)]
    return min(limits)


def find_ptxas() -> str | None:
    """ptxas to run: $JAXSERVE_PTXAS, the one on PATH, or a /usr/local/cuda*/bin/ptxas."""
    for cand in (os.environ.get("JAXSERVE_PTXAS"), shutil.which("ptxas"),
                 *sorted(glob.glob("/usr/local/cuda*/bin/ptxas"), reverse=True)):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def run_ptxas(ptx_path: str, arch: str = "sm_90a", ptxas: str | None = None, timeout: float = 120) -> str:
    """`ptxas -v` on a PTX file (output to /dev/null); returns its verbose report (stdout + stderr).
    Raises RuntimeError when ptxas fails or is missing."""
    ptxas = ptxas or find_ptxas()
    if ptxas is None:
        raise RuntimeError("ptxas not found (set JAXSERVE_PTXAS or put it on PATH)")
    r = subprocess.run([ptxas, "-v", f"-arch={arch}", ptx_path, "-o", os.devnull],
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise RuntimeError(f"ptxas failed ({r.returncode}): {r.stderr[-2000:]}")
    return r.stdout + r.stderr
