"""The fused CPU kernel for quantized matmuls of a few rows (batch-1 decode): csrc/int4_matvec.cc;
its library also holds the CPU paged attention kernel (csrc/paged_attention.cc, wrapped by
attention/cpu_kernel.py), built and registered with it.

XLA:CPU multiplies an `Int4Weight` by dequantising a tile of it into memory and running its dot
on the tile: at one or two rows that costs a 4-byte write and read of every weight for a
half-byte (int4) or one-byte (int8) read. The kernel reads the codes once and accumulates
`scale * sum(x * code) + bias * sum(x)` per group, on XLA's own intra-op threads: 3-4x the tiled
matmul on this model's matrices at two rows (benchmarks/RESULTS.md).

It is C++ compiled on first use with the machine's compiler (`$CXX`, else c++ / g++ / clang++,
`-O3 -march=native`) against jaxlib's XLA FFI headers, cached in `~/.cache/jaxserve/kernels`
(`$JAXSERVE_KERNEL_CACHE`) under a key of the source, compiler, jaxlib and CPU, and registered
as an FFI target. Without a compiler, or with `JAXSERVE_CPU_KERNELS=0`, `load()` says why and the
matmuls stay XLA's tiles. The engine turns it on (`Int4Weight.fused_max_rows`) with
`--dtype auto` on one CPU device; `--dtype float32` keeps the tiles at every batch size, so a
row's result never depends on its batch.

With `int8_x` the int4 matmuls split each block of 32 inputs of x into two int8 parts (a scale
max|x| / 127 and the rounded codes, then the rounded rest at 1/254 of that scale: x to 1.6e-5 of
the block's max|x|, near f32) and sum code * x as exact integer dot products (AVX512-VNNI, else
AVX2) instead of a convert and a float multiply-add per code and row. `int8_dot()` says whether
this build has them; `Int4Weight.fused_int8_x` asks for it (the engine's `--dtype auto`).

The engine also lays those weights out for the kernel (`layers.int4_layout.cpu_layout`: column blocks
of 64, f16 scales where exact), which doubles the bytes a second it reads; the tiles, which still
take steps of more rows, copy each tile back to the checkpoint layout first (`unblock`,
csrc/unblock.cc, in the same library).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

TARGET = "jaxserve_int4_matvec"
MAX_ROWS = 8              # rows per pass over the weight (its accumulators are templated on the rows)
# The engine's: up to 16 rows the kernel beat the tiles on both CPUs measured (AVX-512 with bf16
# tiles: 1.25x at 16 rows, crossover near 24-32; AVX2 with f32 tiles: 1.7x at 16, 3x at 8).
FUSED_MAX_ROWS = 16
SOURCE = Path(__file__).with_name("csrc") / "int4_matvec.cc"
# built into the same library: the decode attention kernel (attention/cpu_kernel.py wraps it)
ATTENTION_TARGET = "jaxserve_paged_attention"
ATTENTION_SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cc"
HEADERS = tuple(Path(__file__).with_name("csrc") / h                  # included
                for h in ("claims.h", "simd.h", "int8_dot.h", "quant_weight.h"))
UNBLOCK_TARGET = "jaxserve_unblock"       # column blocks -> the checkpoint layout, for the tiles
UNBLOCK_SOURCE = Path(__file__).with_name("csrc") / "unblock.cc"
# many rows on Intel AMX's bf16 tiles (csrc/amx_matmul.cc): where this build and process have them
AMX_TARGET = "jaxserve_amx_matmul"
# Past this many rows XLA's bf16 tiles (dequantised once a tile) are as fast: the kernel dequantises
# the weight again for every 64 rows (this model's matrices: 0.5-1x the tiles' time at 256 rows,
# 1.1-1.2x at 512, 2-3x at 2,048; 0.2-0.3x at 16-64). Prefill beyond it keeps the tiles.
AMX_MAX_ROWS = 256
AMX_SOURCE = Path(__file__).with_name("csrc") / "amx_matmul.cc"
SOURCES = (SOURCE, ATTENTION_SOURCE, UNBLOCK_SOURCE, AMX_SOURCE)


def _compiler() -> str | None:
    return os.environ.get("CXX") or next(
        (p for p in map(shutil.which, ("c++", "g++", "clang++")) if p), None)


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU model and its flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str] | None:
    """The x86 feature flags of /proc/cpuinfo, or None where there is no such line (not x86 Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def native_bf16() -> bool | None:
    """Whether this CPU multiplies bf16 in hardware (x86: AVX512-BF16 or AMX-BF16); None: unknown."""
    flags = cpu_flags()
    return None if flags is None else bool({"avx512_bf16", "amx_bf16"} & flags)


def _cache_dir() -> Path:
    return Path(os.path.expanduser(os.environ.get("JAXSERVE_KERNEL_CACHE", "~/.cache/jaxserve/kernels")))


def build(cxx: str, flags: tuple[str, ...] = ()) -> Path:
    """Compile SOURCES with `cxx` (and extra `flags`, e.g. a narrower target) into the cache (once
    per key) and return the library's path. Raises RuntimeError with the compiler's message when
    it fails."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([*(src.read_text() for src in SOURCES),
                                    *(h.read_text() for h in HEADERS), cxx, version,
                                    jax.ffi.include_dir(),
                                    jax.__version__, _cpu_signature(), *flags]).encode()).hexdigest()[:20]
    out = _cache_dir() / f"int4_matvec-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)      # the same filesystem: an atomic rename
    os.close(fd)
    compile_ = [cxx, "-O3", "-std=c++17", "-fPIC", "-fopenmp-simd", "-Wno-psabi", "-isystem",
                jax.ffi.include_dir(), *flags]
    try:
        with tempfile.TemporaryDirectory(dir=out.parent) as objs:
            for arch in (["-march=native"], []):   # a compiler without -march=native: its default target
                # one compiler per source, at once (the cold start waits for the slowest, not the sum)
                runs = [(src, subprocess.Popen([*compile_, *arch, "-c", str(src), "-o", f"{objs}/{src.stem}.o"],
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
                        for src in SOURCES]
                failed = []
                for src, run in runs:
                    err = run.communicate(timeout=300)[1]
                    if run.returncode:
                        failed.append((src.name, err))
                if not failed:
                    done = subprocess.run([cxx, "-shared", *arch, *(f"{objs}/{src.stem}.o" for src in SOURCES),
                                           "-o", tmp, *flags], capture_output=True, text=True, timeout=300)
                    if done.returncode == 0:
                        break
                    failed = [("link", done.stderr)]
            else:
                raise RuntimeError(f"{' '.join(compile_)} failed on {failed[0][0]}:\n{failed[0][1][-2000:]}")
        os.replace(tmp, out)         # concurrent builders (test workers) each rename a whole file
        logger.info("built the fused CPU kernel in %.1f s: %s", time.perf_counter() - start, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def load() -> str | None:
    """Build and register the kernel once per process. None when it is ready, else why not."""
    if os.environ.get("JAXSERVE_CPU_KERNELS", "1") == "0":
        return "JAXSERVE_CPU_KERNELS=0"
    cxx = _compiler()
    if cxx is None:
        return "no C++ compiler found (set CXX)"
    try:
        _INT8_DOT[0] = register(build(cxx), TARGET, ATTENTION_TARGET)
        if os.environ.get("JAXSERVE_CPU_AMX", "1") == "0":
            _AMX[0] = False
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return f"the kernel did not build: {e}"
    return None


_INT8_DOTS = {1: "AVX512-VNNI", 2: "AVX2"}
_INT8_DOT: list[str | None] = [None]
_AMX: list[bool] = [False]


def register(library: Path, target: str, attention_target: str | None = None) -> str | None:
    """Register a built kernel library's matmul as the FFI target `target` (and its attention as
    `attention_target`); returns its integer dot product (what `int8_dot()` reports for it)."""
    lib = ctypes.CDLL(str(library))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.JaxserveInt4Matvec), platform="cpu")
    if attention_target is not None:
        jax.ffi.register_ffi_target(attention_target, jax.ffi.pycapsule(lib.JaxservePagedAttention), platform="cpu")
        jax.ffi.register_ffi_target(UNBLOCK_TARGET, jax.ffi.pycapsule(lib.JaxserveUnblock), platform="cpu")
    if target == TARGET:       # the process's own build (not a test's narrower one)
        _AMX[0] = bool(lib.JaxserveAmx())      # asks Linux for the tile registers (once a process)
        if _AMX[0]:
            jax.ffi.register_ffi_target(AMX_TARGET, jax.ffi.pycapsule(lib.JaxserveAmxMatmul), platform="cpu")
    return _INT8_DOTS.get(lib.JaxserveInt4Int8Dot())


def int8_dot() -> str | None:
    """The integer dot product the loaded kernel runs `int8_x` matmuls on (\"AVX512-VNNI\" or
    \"AVX2\"), or None: not loaded, or no such instructions in this build (then `int8_x` is refused)."""
    return _INT8_DOT[0] if load() is None else None


def amx() -> bool:
    """Whether the many-row AMX kernel (csrc/amx_matmul.cc: bf16 tiles, the arithmetic of the
    engine's bf16 tiles) runs here: built for AMX-BF16, the process granted the tile registers, and
    not turned off (`JAXSERVE_CPU_AMX=0`)."""
    return load() is None and _AMX[0]


def amx_fits(K: int, bits: int) -> bool:
    """Whether the AMX kernel takes a weight of K input rows (a `fits` one): chunks of 32 inputs."""
    return K % 32 == 0 and bits in (4, 8)


def amx_pays(rows: int) -> bool:
    """Whether the AMX kernel beats the tiles at this many rows (`AMX_MAX_ROWS`)."""
    return rows <= AMX_MAX_ROWS


def _columns(scale, col_block: int) -> int:
    """N of a [(L,) G, N] scale array, or of [(L,) N / col_block, G, col_block]."""
    return scale.shape[-1] * (scale.shape[-3] if col_block else 1)


def fits(q, scale, zero, offset, group_size: int, bits: int, stacked: bool, col_block: int = 0,
         scale_sup=None, offset_sup=None) -> bool:
    """Whether the kernel takes these arrays (else the caller uses the tiles): [(L,) rows, N], or
    with `col_block` [(L,) N / col_block, rows, col_block]; f32 or f16 scales (offsets alike), or
    int8 ones under f16 super-block scales (`Int4Weight.scale_sup`: `scale_sup` and `offset_sup`
    [..., G / S, ...] where `offset` is int8; not with a `zero` array)."""
    n = _columns(scale, col_block)
    if scale_sup is not None or offset_sup is not None:
        def sub(a, sup):
            return (a is None and sup is None) or (a is not None and sup is not None and a.dtype == jnp.int8
                                                   and sup.dtype == jnp.float16 and sup.ndim == a.ndim
                                                   and sup.shape[:-2] == a.shape[:-2] and sup.shape[-1] == a.shape[-1]
                                                   and a.shape[-2] % sup.shape[-2] == 0)
        if scale_sup is None or zero is not None or not sub(scale, scale_sup) or not sub(offset, offset_sup):
            return False
    elif scale.dtype not in (jnp.float32, jnp.float16) or (offset is not None and offset.dtype != scale.dtype):
        return False
    return (bits in (4, 8) and q.ndim == 2 + stacked + bool(col_block)
            and (q.dtype == jnp.int32 if bits == 4 else q.dtype in (jnp.int8, jnp.int32))
            and n % 16 == 0 and group_size % 8 == 0
            and col_block % 64 == 0 and (zero is None or zero.dtype == jnp.uint8))


def matmul(x: jax.Array, q, scale, zero, offset, layer, group_size: int, bits: int,
           int8_x: bool = False, target: str = TARGET, zero_point: int | None = None,
           col_block: int = 0, amx: bool = False, int8_hi_only: bool = False, scale_sup=None,
           offset_sup=None) -> jax.Array:
    """x [M, K] f32 (MAX_ROWS rows a pass over the weight) @ the quantized [K, N] weight (the `layer` slice of a
    [L, ...] stack when `layer` is an index, else 2-D arrays) -> [M, N] f32. `load()` first (or
    `register` a build as `target`). `int8_x` (int4 codes, a build with an integer dot product):
    x as two int8 parts per block of 32 inputs. `zero_point`: the groups' zero point without a
    `zero` array (default 8 for int4, 0 for int8, as `layers.int4.zero_point_of`); `col_block`:
    the arrays are column blocks [(L,) N / col_block, rows, col_block] (`Int4Weight.col_block`).
    `amx`: the AMX kernel instead (any rows; x and the dequantised weight rounded to bf16, f32
    sums; `amx()` first, K a multiple of 32). `int8_hi_only` (with `int8_x`): x as its high int8
    part alone (llama.cpp's Q8 activations, to 1/254 of each block's max|x|): half the integer work.
    `scale_sup` / `offset_sup`: two-level scales (`Int4Weight.scale_sup`; `scale`, `offset` int8
    sub-scales then; not the AMX kernel's)."""
    M = x.shape[0]
    if amx:
        if int8_x or not amx_fits(x.shape[1], bits) or (target == TARGET and not _AMX[0]):
            raise ValueError(f"the AMX kernel takes f32 x with K a multiple of 32 where amx() is True "
                             f"(int8_x={int8_x}, K={x.shape[1]}, bits={bits}, amx()={_AMX[0]})")
        target = AMX_TARGET
    k4 = bits == 8 and q.dtype == jnp.int32          # 8-bit codes four a word (VNNI's products)
    if int8_x and ((bits != 4 and not k4) or (target == TARGET and int8_dot() is None)
                   or (k4 and target == TARGET and int8_dot() != "AVX512-VNNI")):
        raise ValueError("int8_x needs int4 codes (or 8-bit ones four a word, with AVX512-VNNI) and a kernel "
                         f"built with an integer dot product (bits={bits}, int8_dot()={int8_dot()})")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((M, _columns(scale, col_block)), jnp.float32),
                            vmap_method="sequential")
    if amx and (scale_sup is not None or offset_sup is not None):
        raise ValueError("the AMX kernel takes one-level scales (layers.int4.plain_scales)")
    more = {} if amx else {"int8_x": bool(int8_x), "int8_hi_only": bool(int8_x and int8_hi_only)}
    sups = () if amx else tuple(jnp.zeros((0,), jnp.float16) if a is None else a for a in (scale_sup, offset_sup))
    return call(x.astype(jnp.float32), q, scale,
                jnp.zeros((0,), jnp.uint8) if zero is None else zero,
                jnp.zeros((0,), scale.dtype) if offset is None else offset,
                jnp.asarray(0 if layer is None else layer, jnp.int32), *sups,
                group_size=np.int64(group_size), bits=np.int64(bits), **more,
                zero_point=np.int64((8 if bits == 4 else 0) if zero_point is None else zero_point),
                col_block=np.int64(col_block))


def unblock(a: jax.Array, layer, row0, block0, rows: int, blocks: int) -> jax.Array:
    """Rows [row0, row0 + rows) of column blocks [block0, block0 + blocks) of `a`
    ([(L,) N / cb, R, cb], layer `layer` of a stack) as [rows, blocks * cb]: the checkpoint
    layout's slice, copied a block row at a time (`load()` first). The tiles take a weight in
    column blocks (`Int4Weight.col_block`) this way."""
    cb = a.shape[-1]
    call = jax.ffi.ffi_call(UNBLOCK_TARGET, jax.ShapeDtypeStruct((rows, blocks * cb), a.dtype))
    at = jnp.stack([jnp.asarray(0 if layer is None else layer, jnp.int32), jnp.asarray(row0, jnp.int32),
                    jnp.asarray(block0, jnp.int32)])
    return call(a, at, rows=np.int64(rows), blocks=np.int64(blocks))
