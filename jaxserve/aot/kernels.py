"""The project's GPU kernels compiled for a GPU target (an H100 from any machine, `targets.py`), at
every shipped configuration, with what each takes from an SM: registers per thread, spilled bytes,
shared memory per CTA, threads per CTA and how many CTAs fit one SM.

    kernel_report(get_target("h100")) -> [{name, config, compiled, error, registers, spill_bytes,
                                           smem_bytes, ctas_per_sm, threads, ...}, ...]

Where each figure comes from (one temporary directory per compile, removed afterwards):
  Triton (Pallas `ragged_paged_attention`, `ragged_paged_attention_decode`): XLA runs ptxas from
    `xla_gpu_cuda_data_dir`/bin first, so the compile points that option at a directory whose
    `bin/ptxas` copies each PTX it is given aside and runs the real ptxas; `ptxas -v` on the PTX
    holding the kernel's entry gives registers, spills and static shared memory. XLA's dump
    (`xla_dump_to`, `*.thunk_sequence.txt`) gives the launch: grid, threads and the dynamic
    shared memory.
  Mosaic GPU (paged attention, FP8 and int4 matmuls): Mosaic runs ptxas itself when XLA compiles
    the custom call; `MOSAIC_GPU_DUMP_TO` + `MOSAIC_GPU_DUMP_PTXAS`/`_PTX`/`_RESOURCES` (read
    while lowering, Python, and while compiling, C++: set around both) leave its verbose output,
    the PTX (threads: `.maxntid`) and the resources (dynamic shared memory: scratch + mbarriers).
smem_bytes = ptxas' static shared memory + the dynamic shared memory of the launch.
ctas_per_sm: `jaxserve.aot.ptxas.ctas_per_sm` (registers, threads, shared memory, 32 CTAs).
Without ptxas the report still has smem/threads (Triton) and registers None.

Shapes are small and realistic (a few sequences, 16-token pages, 32 query and 8 KV heads, a
pool of 512 pages; 2048 x 2048 weights); the kernels' tables give the block sizes and tiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.aot import ptxas as px

__all__ = ["KernelCase", "kernel_cases", "compile_kernel", "kernel_report"]

COMPILE_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}   # CUB's sort needs a device to compile
CUSTOM_CALLS = {"triton": "__gpu$xla.gpu.triton", "mosaic": 'custom_call_target="mosaic_gpu'}
# what an interpreted Pallas kernel leaves in the HLO (host callbacks), never a compiled kernel's
INTERPRETER_MARKS = ("python_cpu_callback", "python_gpu_callback")
_MOSAIC_ENV = ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_RESOURCES")
_FIELDS = ("registers", "spill_bytes", "smem_bytes", "ctas_per_sm", "threads")


# ----------------------------------------------------------------------------------------------
# The shipped configurations
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One shipped configuration of a kernel. name: "attention/pallas", "attention/pallas-decode",
    "attention/mosaic", "fp8/pallas" or "int4/pallas" (the names of `jaxserve.pallas.measured`);
    config: what selects it (head_dim, dtypes, block sizes or tiles); kind: "triton" or "mosaic";
    kernel: the Pallas kernel's name (Triton: its launch and PTX entry);
    build(sharding) -> (function, args): a small call of the kernel and its ShapeDtypeStruct
    arguments (pytrees of them), each placed with `sharding`."""
    name: str
    config: dict
    kind: str
    build: Callable
    kernel: str = ""


SEQS, TOKENS, Q_HEADS, KV_HEADS, PAGES, PAGE, PAGES_PER_SEQ = 4, 64, 32, 8, 512, 16, 64
MATMUL_K = MATMUL_N = 2048


def _attention(entry, *, head_dim, q_dtype, kv_dtype, block_size=PAGE, tokens=TOKENS, seqs=SEQS, **kw):
    """build() of an attention call: q [T, 32, D], caches [512, 16, 8, D], 64 pages per sequence."""
    from jaxserve.attention.metadata import AttentionMetadata
    from jaxserve.pallas.paged_attention import QUANTIZED_KV_DTYPES

    def build(sharding):
        def sds(shape, dtype):
            return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)
        i32 = jnp.int32
        meta = AttentionMetadata(sds((tokens,), i32), sds((seqs, PAGES_PER_SEQ), i32), sds((seqs,), i32),
                                 sds((seqs + 1,), i32), sds((1,), i32))
        cache = (PAGES, block_size, KV_HEADS, head_dim)
        scales = [sds(cache[:3], jnp.float32)] * 2 if jnp.dtype(kv_dtype) in QUANTIZED_KV_DTYPES else [None, None]

        def call(q, k, v, meta, ks, vs):
            return entry(q, k, v, meta, sm_scale=head_dim ** -0.5, k_scale=ks, v_scale=vs, **kw)
        return call, [sds((tokens, Q_HEADS, head_dim), q_dtype), sds(cache, kv_dtype), sds(cache, kv_dtype),
                      meta, *scales]
    return build


def _fp8_matmul(tiles, scales: str, m: int):
    from jaxserve.pallas import fp8_matmul as fm

    def build(sharding):
        scale = (1, MATMUL_N) if scales == "channel" else (MATMUL_K // fm.BLOCK, MATMUL_N // fm.BLOCK)
        args = [jax.ShapeDtypeStruct(s, jnp.dtype(d), sharding=sharding)
                for s, d in (((m, MATMUL_K), jnp.bfloat16), ((MATMUL_K, MATMUL_N), fm.FP8), (scale, jnp.float32))]
        return (lambda x, w, s: fm.fp8_matmul_mgpu(x, w, s, tiles=tiles)), args
    return build


def _int4_matmul(tiles, group: int, asym: bool, m: int):
    from jaxserve.pallas import int4_matmul as im

    def build(sharding):
        def sds(shape, dtype):
            return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)
        scale = sds((MATMUL_K // group, MATMUL_N), jnp.bfloat16)
        w = im.Int4KernelWeight(sds((MATMUL_N, MATMUL_K), jnp.int4), scale, scale if asym else None, None, group)
        return (lambda x, w: im.int4_matmul_mgpu(x, w, tiles=tiles)), [sds((m, MATMUL_K), jnp.bfloat16), w]
    return build


def _grouped_matmul(tile: int, k: int, n: int, experts: int = 64, tiles: int = 32):
    from jaxserve.pallas import grouped_matmul as gm

    def build(sharding):
        args = [jax.ShapeDtypeStruct(s, jnp.dtype(d), sharding=sharding)
                for s, d in (((tiles * tile, k), jnp.bfloat16), ((experts, k, n), jnp.bfloat16), ((tiles,), jnp.int32))]
        return (lambda x, w, e: gm.grouped_matmul(x, w, e, tile)), args
    return build


def kernel_cases() -> list[KernelCase]:
    """Every shipped configuration: Triton ragged attention and split-K decode at each head_dim of
    DEFAULT_BLOCK_SIZES (q bf16/f16; KV the q dtype, fp8 e4m3 or int8 with scales); Mosaic GPU
    attention at each head_dim of its table (q bf16; KV bf16 or fp8 e4m3); the FP8 matmul's
    SHIPPED_TILES (per-channel and 128x128-block scales) and the int4 matmul's (group 128
    symmetric and asymmetric, group 32 asymmetric), M in each tile's range."""
    from jaxserve.pallas import fp8_matmul as fm
    from jaxserve.pallas import int4_matmul as im
    from jaxserve.pallas import paged_attention as pa
    from jaxserve.pallas import paged_attention_decode as pad
    from jaxserve.pallas import paged_attention_mgpu as pm
    from jaxserve.pallas import paged_attention_mgpu_sizes as pms

    cases = []
    for d, bs in sorted(pa.DEFAULT_BLOCK_SIZES.items()):
        for q in ("bfloat16", "float16"):
            for kv in (q, "float8_e4m3fn", "int8"):
                cfg = dict(head_dim=d, q_dtype=q, kv_dtype=kv, block_size=PAGE)
                cases.append(KernelCase("attention/pallas", dict(cfg, q_rows=bs.q_rows, kv_tokens=bs.kv_tokens),
                                        "triton", _attention(pa.ragged_paged_attention, **cfg),
                                        "ragged_paged_attention"))
                cases.append(KernelCase("attention/pallas-decode", dict(cfg, kv_tokens=bs.kv_tokens), "triton",
                                        _attention(pad.ragged_paged_attention_decode, tokens=8, seqs=8, **cfg),
                                        "paged_attention_decode_split_k"))
    for d, bs in sorted(pms.DEFAULT_BLOCK_SIZES.items()):
        for kv in ("bfloat16", "float8_e4m3fn"):
            cfg = dict(head_dim=d, q_dtype="bfloat16", kv_dtype=kv, block_size=PAGE)
            cases.append(KernelCase("attention/mosaic", dict(cfg, kv_tokens=bs.kv_tokens, slots=bs.slots), "mosaic",
                                    _attention(pm.ragged_paged_attention_mgpu, **cfg)))
    for t in fm.SHIPPED_TILES:
        m = 16 if t == fm.DECODE_TILES else 256
        for scales in ("channel", "block"):
            if fm.default_tiles(m, scales) != t:     # a pair the kernel never runs
                continue
            cfg = dict(tile_m=t.tile_m, tile_n=t.tile_n, stages=t.stages, scales=scales, m=m, dtype="bfloat16")
            cases.append(KernelCase("fp8/pallas", cfg, "mosaic", _fp8_matmul(t, scales, m)))
    for t in im.SHIPPED_TILES:
        m = {16: 16, 64: 64}.get(t.tile_m, 256)
        for group, asym in ((128, False), (128, True), (32, True)):
            cfg = dict(tile_m=t.tile_m, stages=t.stages, group_size=group, asym=asym, m=m, dtype="bfloat16")
            cases.append(KernelCase("int4/pallas", cfg, "mosaic", _int4_matmul(t, group, asym, m)))
    for tile in (1, 2, 4, 8, 16, 32, 64):     # the experts' tiles (Qwen3-30B-A3B's gate/up and down)
        for k, n in ((2048, 768), (768, 2048)):
            cases.append(KernelCase("experts/grouped-matmul", dict(tile=tile, k=k, n=n, dtype="bfloat16"), "triton",
                                    _grouped_matmul(tile, k, n), "grouped_matmul"))
    return cases


@contextlib.contextmanager
def _env(values: dict):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _ptxas_shim(work: str, real: str | None) -> str | None:
    """A CUDA data dir whose bin/ptxas keeps a copy of every PTX XLA compiles in work/ptx, then
    runs `real`; nvvm/ (libdevice) links to the real CUDA's. None without a real ptxas."""
    if real is None:
        return None
    root, ptx = os.path.join(work, "cuda"), os.path.join(work, "ptx")
    os.makedirs(os.path.join(root, "bin"))
    os.makedirs(ptx)
    shim = os.path.join(root, "bin", "ptxas")
    with open(shim, "w") as f:
        f.write(f'#!/bin/sh\n[ -f "$1" ] && cp "$1" "{ptx}/$(date +%s%N)_$$.ptx"\nexec "{real}" "$@"\n')
    os.chmod(shim, 0o755)
    for cand in (os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(real))), "nvvm"),
                 *sorted(glob.glob("/usr/local/cuda*/nvvm"), reverse=True)):
        if os.path.isdir(cand):
            os.symlink(cand, os.path.join(root, "nvvm"))
            break
    return root


def _no_persistent_cache():
    """A compile served from jax's persistent cache runs no ptxas: keep it out of the way."""
    from jax._src import config
    ctx = getattr(config, "enable_compilation_cache", None)
    return ctx(False) if ctx is not None else contextlib.nullcontext()


def _read(pattern: str) -> list[str]:
    out = []
    for p in sorted(glob.glob(pattern)):
        with open(p, errors="replace") as f:
            out.append(f.read())
    return out


def _triton_figures(work: str, kernel: str, real_ptxas: str | None) -> dict:
    launches = [t for text in _read(os.path.join(work, "xla", "*thunk_sequence.txt"))
                for t in px.parse_thunk_sequence(text) if t["name"].startswith(kernel)]
    if not launches:
        raise RuntimeError(f"no launch of kernel {kernel!r} in XLA's thunk sequence")
    out = {"kernel": launches[0]["name"], "grid": launches[0]["grid"], "threads": launches[0]["threads"],
           "smem_dynamic": launches[0]["shared_memory"]}
    seen = set()
    for path in sorted(glob.glob(os.path.join(work, "ptx", "*.ptx"))):
        with open(path, "rb") as f:
            data = f.read()
        digest = hashlib.sha1(data).hexdigest()
        if digest in seen or out["kernel"].encode() not in data:
            continue
        seen.add(digest)
        funcs = px.parse_ptxas(px.run_ptxas(path, ptxas=real_ptxas))
        if out["kernel"] in funcs:
            out.update(funcs[out["kernel"]])
            break
    return out


def _mosaic_figures(work: str) -> dict:
    d = os.path.join(work, "mosaic")
    reports = _read(os.path.join(d, "*.ptxas"))
    resources = _read(os.path.join(d, "*.resources.txt"))
    if len(resources) != 1:
        raise RuntimeError(f"expected one Mosaic GPU kernel's resources dump, found {len(resources)}")
    out = {"smem_dynamic": px.parse_mosaic_resources(resources[0])}
    for text in _read(os.path.join(d, "*.ptx")):
        out.update(("threads", n) for n in px.parse_ptx_threads(text).values())
    funcs = {k: v for text in reports for k, v in px.parse_ptxas(text).items()}
    if len(funcs) == 1:
        (name, figures), = funcs.items()
        out.update(figures, kernel=name)
    return out


def _compile(case: KernelCase, target, work: str, real_ptxas: str | None):
    mesh = jax.sharding.Mesh(np.array(target.devices[:1]).reshape(1), ("tp",))
    fn, args = case.build(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    options = dict(COMPILE_OPTIONS, xla_dump_to=os.path.join(work, "xla"))
    cuda = _ptxas_shim(work, real_ptxas)
    if cuda:
        options["xla_gpu_cuda_data_dir"] = cuda
    env = {}
    if case.kind == "mosaic":
        os.makedirs(os.path.join(work, "mosaic"))
        env = dict(zip(_MOSAIC_ENV, (os.path.join(work, "mosaic"), "1", "1", "1")))
    with _env(env), _no_persistent_cache(), target.context(mesh):
        return jax.jit(fn).lower(*args).compile(options)


def compile_kernel(case: KernelCase, target, *, keep_dir: str | None = None) -> dict:
    """Compile `case` for `target` (a GPU `jaxserve.aot.targets.Target`) and report its kernel:
    {name, config, compiled, error, registers, spill_bytes, smem_bytes, ctas_per_sm, threads}
    plus kernel (PTX entry), custom_call (found in the compiled HLO), interpreted (an interpreter
    callback found instead), spill_stores/spill_loads/stack_frame/smem_static/smem_dynamic and
    grid (Triton). Every shipped case launches one Pallas kernel; XLA's fusions around it are
    left out. Never raises for a failed compile: compiled False and error say why.
    `keep_dir`: copy the dumps there (debugging)."""
    res = {"name": case.name, "config": dict(case.config), "compiled": False, "error": None,
           **dict.fromkeys(_FIELDS)}
    real = px.find_ptxas()
    work = tempfile.mkdtemp(prefix="jaxserve-kernel-")
    try:
        try:
            exe = _compile(case, target, work, real)
        except Exception as e:  # noqa: BLE001 - a failed configuration is a row of the report
            res["error"] = f"{type(e).__name__}: {e}"[:2000]
            return res
        res["compiled"] = True
        hlo = exe.as_text()
        res["custom_call"] = CUSTOM_CALLS[case.kind] if CUSTOM_CALLS[case.kind] in hlo else None
        res["interpreted"] = any(m in hlo for m in INTERPRETER_MARKS)
        try:
            figures = (_triton_figures(work, case.kernel, real) if case.kind == "triton"
                       else _mosaic_figures(work))
        except (RuntimeError, OSError, ValueError) as e:
            res["error"] = f"figures: {e}"
            figures = {}
        res.update(figures)
        if "smem_dynamic" in figures:
            res["smem_bytes"] = figures.get("smem_static", 0) + figures["smem_dynamic"]
        if res["registers"] is None and not res["error"]:
            res["error"] = "registers unknown: " + ("ptxas not found" if real is None else "no ptxas report")
        res["ctas_per_sm"] = px.ctas_per_sm(res["registers"], res["threads"], res["smem_bytes"])
        return res
    finally:
        if keep_dir:
            shutil.copytree(work, keep_dir, dirs_exist_ok=True, symlinks=True)
        shutil.rmtree(work, ignore_errors=True)


def kernel_report(target, cases: list[KernelCase] | None = None) -> list[dict]:
    """`compile_kernel` of every case (default: every shipped configuration, `kernel_cases()`)."""
    return [compile_kernel(c, target) for c in (kernel_cases() if cases is None else cases)]


def format_report(rows: list[dict]) -> str:
    """The report as a fixed-width table, one line per kernel configuration."""
    lines = [f"{'kernel':<24} {'config':<72} {'regs':>5} {'spill':>6} {'smem':>7} {'thr':>4} {'cta/SM':>6}"]
    for r in rows:
        cfg = " ".join(f"{k}={v}" for k, v in r["config"].items())
        vals = [("-" if r.get(k) is None else r[k]) for k in ("registers", "spill_bytes", "smem_bytes", "threads",
                                                              "ctas_per_sm")]
        lines.append(f"{r['name']:<24} {cfg:<72} {vals[0]:>5} {vals[1]:>6} {vals[2]:>7} {vals[3]:>4} {vals[4]:>6}"
                     + ("" if not r["error"] else f"  ! {r['error'][:120]}"))
    return "\n".join(lines)
