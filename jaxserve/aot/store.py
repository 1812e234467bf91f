"""A directory of compiled step programs: serialized executables, keyed by everything that changes
them, which an engine loads instead of compiling (`--compiled-dir DIR`, and the offline `LLM`'s
program cache under ~/.cache/jaxserve/programs, one directory per key).

    DIR/manifest.json          {"key": {...}}
    DIR/<program>.exe          pickle of jax's serialize_executable (payload, in tree, out tree)
    DIR/<program>.hlo.txt      the optimized HLO (what the report reads; `jaxserve compile`)
    DIR/report.json, report.md (jaxserve.aot.report)

The key (`program_key`) is computed from a `ModelRunner` by the same function whether the runner
compiles for a target or is an engine about to serve, so "the programs fit this engine" is one
comparison; `mismatch` names each field that differs. A program is a file of its own, written
whole then renamed, so processes sharing a cache directory never read half a program.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import threading
from importlib import metadata
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = 1


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _spec_signature(tree) -> str:
    """Structure, shapes, dtypes, partition specs and (host) memory kinds of a pytree of arrays or
    ShapeDtypeStructs."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    parts = [str(treedef)]
    for a in leaves:
        sharding = getattr(a, "sharding", None)
        # one device, or every device holding the whole array: the same program either way
        split = sharding is not None and not sharding.is_fully_replicated
        kind = getattr(sharding, "memory_kind", None)
        parts.append(f"{tuple(a.shape)}:{a.dtype}:{getattr(a, 'weak_type', False)}:"
                     f"{getattr(sharding, 'spec', None) if split else None}"
                     + (f":{kind}" if kind not in (None, "device") else ""))    # --cpu-offload-gb's
    return _digest(parts)


def device_description(devices) -> dict:
    """What identifies the devices a program runs on: platform, kind, count, compute capability."""
    d = devices[0]
    cc = getattr(d, "compute_capability", None)
    return {"platform": d.platform, "device_kind": d.device_kind, "devices": len(devices),
            "compute_capability": None if cc is None else str(cc)}


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A digest of jaxserve's own source (every .py, .cc and .h file of the package): programs
    compiled by other code are never loaded."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cc", ".h") and p.is_file()):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _host_cpu() -> str:
    """CPU programs are machine code for this CPU's features (AVX-512 or not): its flags' digest."""
    import platform

    from jaxserve.layers.int4_cpu import cpu_flags
    return _digest([platform.machine(), sorted(cpu_flags() or ())])


def program_key(runner) -> dict:
    """Everything that changes a `ModelRunner`'s compiled programs, as a flat dict of fields:
    software versions, the devices, the model, every shape-changing setting, and the signature
    of the weights / KV pool / penalty state the programs take (their weight types included)."""
    weights, cache, pen = runner._state_specs()
    return {
        "format": FORMAT,
        "jaxserve": code_fingerprint(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "cuda_plugin": _version("jax-cuda13-plugin"),
        "devices": device_description(list(runner.plan.mesh.devices.flat)),
        "host_cpu": _host_cpu() if runner.plan.mesh.devices.flat[0].platform == "cpu" else None,
        "mesh": dict(runner.plan.mesh.shape),
        "model": _digest(repr(runner.cfg)),
        "runner": type(runner).__name__,            # a pooling runner's step is another program
        "pooler": repr(getattr(runner, "pooler", None)),
        "architecture": runner.cfg.architecture,
        "attention_backend": runner.backend,
        "compiler_options": runner.compiler_options,
        "block_size": runner.block_size,
        "num_blocks": runner.num_blocks,
        "max_num_seqs": runner.max_seqs,
        "max_blocks_per_seq": runner.max_blocks_per_seq,
        "token_buckets": list(runner.buckets),
        "max_logprobs": runner.max_logprobs,
        "num_speculative_tokens": runner.num_spec,
        "lora": runner.lora is not None,
        "weights": _spec_signature(weights),
        "kv_cache": _spec_signature(cache),
        "penalties": _spec_signature(pen),
    }


def mismatch(compiled: dict, wanted: dict) -> list[str]:
    """The fields where two keys differ, as "field: compiled X, this engine Y" lines."""
    out = []
    for field in sorted(set(compiled) | set(wanted)):
        a, b = compiled.get(field), wanted.get(field)
        if a != b:
            out.append(f"{field}: compiled {a!r}, this engine {b!r}")
    return out


class ProgramStore:
    """A compiled directory, written by `jaxserve compile` and read by an engine. `load` returns
    None for a program the directory does not hold (the engine compiles that one). writable: a
    program cache, to which the engine `save`s each program it compiles."""

    def __init__(self, directory: str | os.PathLike, writable: bool = False, kind: str = "compiled directory"):
        self.dir = Path(directory)
        self.writable = writable
        self.kind = kind

    @property
    def manifest(self) -> dict | None:
        path = self.dir / MANIFEST
        if not path.is_file():
            return None
        return json.loads(path.read_text())

    @property
    def key(self) -> dict | None:
        m = self.manifest
        return None if m is None else m["key"]

    def write(self, key: dict, programs: dict[str, jax.stages.Compiled]) -> None:
        """Serialize `programs` (name -> compiled) under `key`, replacing the manifest."""
        self.write_key(key)
        for name, exe in programs.items():
            self.save(name, exe)

    def write_key(self, key: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.dir / MANIFEST, json.dumps({"key": key}, indent=1).encode())

    def save(self, name: str, exe) -> None:
        """Add one compiled program (a failure to write is logged: the program is still served)."""
        from jax.experimental.serialize_executable import serialize
        try:
            _write_atomic(self.dir / f"{name}.exe", pickle.dumps(serialize(exe)))
        except (OSError, ValueError, TypeError) as e:
            logger.warning("could not store program %s in %s: %s", name, self.dir, e)

    def load(self, name: str, devices):
        """The compiled program `name` loaded onto `devices` (the runner's mesh, in its order: a
        program of 2 devices on a host of 8 runs on those 2), or None (not held, or unreadable:
        logged, and the engine compiles it)."""
        path = self.dir / f"{name}.exe"
        if not path.is_file():
            return None
        from jax.experimental.serialize_executable import deserialize_and_load
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            return deserialize_and_load(payload, in_tree, out_tree, execution_devices=list(devices))
        except Exception as e:    # noqa: BLE001 - a damaged or foreign file: compile instead
            logger.warning("could not load program %s from %s (%r); compiling it", name, self.dir, e)
            return None


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def open_cache(root: str | os.PathLike, runner) -> ProgramStore | None:
    """The program cache's directory for this runner's key under `root` (made, with its key, when
    new): programs compiled once are loaded by every later engine of the same key."""
    key = program_key(runner)
    store = ProgramStore(Path(os.path.expanduser(root)) / _digest(key), writable=True, kind="program cache")
    try:
        if store.key != key:
            store.write_key(key)
    except (OSError, ValueError) as e:
        logger.warning("program cache %s unusable (%s); compiling without it", store.dir, e)
        return None
    return store


def open_matching(directory: str | os.PathLike, runner) -> ProgramStore | None:
    """The store at `directory` when its key equals the runner's, else None with a warning that
    names each differing field (the engine then compiles, as without a directory)."""
    store = ProgramStore(directory)
    compiled = store.key
    if compiled is None:
        logger.warning("compiled directory %s holds no manifest (jaxserve compile writes one); compiling", directory)
        return None
    diff = mismatch(compiled, program_key(runner))
    if diff:
        logger.warning("compiled directory %s was compiled for another engine; compiling instead. Differs: %s",
                       directory, "; ".join(diff))
        return None
    return store


def compiled_pool_blocks(directory: str | os.PathLike | None, backend: str, bytes_per_block: int,
                         weight_bytes: int) -> int | None:
    """The KV pool size a compiled directory's programs were built for, when they were built for
    attention `backend` and the pool fits this device beside the weights (None otherwise: the
    engine sizes the pool itself, and the key check then names what differs)."""
    key = ProgramStore(directory).key if directory else None
    if key is None or key.get("attention_backend") != backend:
        return None
    blocks = int(key["num_blocks"])
    from jaxserve.worker.kv_sizing import device_memory_stats
    stats = device_memory_stats() if jax.default_backend() != "cpu" else None
    limit = (stats or {}).get("bytes_limit")
    if limit and weight_bytes + blocks * bytes_per_block > limit:
        logger.warning("compiled directory %s: its pool of %d blocks does not fit this device beside the weights "
                       "(%d bytes of %d); sizing the pool here", directory, blocks,
                       weight_bytes + blocks * bytes_per_block, limit)
        return None
    return blocks
