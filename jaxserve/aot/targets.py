"""Compile targets: the devices a program is compiled for, which need not be this machine's.

`h100` and `h200` are compile-only CUDA devices: XLA's GPU pipeline (LLVM, ptxas) runs on any
host from a shipped target description (`targets/*.txtpb`, the GpuTargetConfigProto fields
jaxlib 0.11.2 parses), through jax's CUDA plugin wheels (`pip install jax-cuda13-plugin
jax-cuda13-pjrt`; no GPU, driver or NVIDIA libraries needed). `cpu` is this machine's CPU devices,
so the same code path is testable anywhere.

A program compiled for a target is lowered under `target.context()`: the abstract mesh of the
target's devices, whose `AbstractDevice` is what kernels read to choose their compiled form
(`jaxserve.pallas.common.target_platform`), never the host's `jax.default_backend()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from importlib import resources

import jax

TARGETS = ("h100", "h200", "cpu")
# device_memory_size of the description, for the memory check (bytes)
_GPU_FILES = {"h100": "h100.txtpb", "h200": "h200.txtpb"}
PLUGIN_HINT = ("compiling for a GPU without one needs jax's CUDA plugin wheels of the same version as "
               "jax: pip install 'jax-cuda13-plugin=={v}' 'jax-cuda13-pjrt=={v}' (jax >= 0.11.2)")


def target_config_text(name: str) -> str:
    """The shipped GpuTargetConfigProto text of a GPU target."""
    if name not in _GPU_FILES:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {name!r}")
    return resources.files("jaxserve.aot").joinpath("targets", _GPU_FILES[name]).read_text()


def _field(text: str, key: str) -> str | None:
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip().strip('"')
    return None


@dataclasses.dataclass(frozen=True)
class Target:
    """name: "h100", "h200" or "cpu". devices: what meshes are built from (compile-only
    devices for a GPU target). memory_bytes: one device's memory (None: unknown, the CPU).
    memory_bandwidth: bytes/s of one device (None: unknown)."""
    name: str
    devices: tuple
    memory_bytes: int | None = None
    memory_bandwidth: float | None = None
    config_text: str = ""

    @property
    def is_gpu(self) -> bool:
        return self.name in _GPU_FILES

    @property
    def platform(self) -> str:
        return "gpu" if self.is_gpu else "cpu"

    @property
    def device_kind(self) -> str:
        return self.devices[0].device_kind

    @property
    def compute_capability(self) -> str | None:
        cc = getattr(self.devices[0], "compute_capability", None)
        return None if cc is None else str(cc)

    def description(self) -> dict:
        """What identifies the target in a compiled program's key."""
        return {"name": self.name, "device_kind": self.device_kind, "devices": len(self.devices),
                "compute_capability": self.compute_capability}

    @contextlib.contextmanager
    def context(self, mesh):
        """Lower programs for this target: `mesh` (built on `self.devices`) as the abstract mesh,
        so Pallas and jaxserve's kernels read the target's device (jax >= 0.11)."""
        use = getattr(jax.sharding, "use_abstract_mesh", None)
        if use is None or not self.is_gpu:
            yield
            return
        with use(mesh.abstract_mesh):
            yield


def get_target(name: str, num_devices: int = 1) -> Target:
    """The target `name` with `num_devices` devices. A GPU target needs jax >= 0.11.2 with the
    CUDA plugin wheels (ValueError with the install line otherwise); "cpu" needs that many local
    CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N)."""
    if name == "cpu":
        devices = jax.devices("cpu")
        if len(devices) < num_devices:
            raise ValueError(f"target cpu with {num_devices} devices: this process has {len(devices)} "
                             "(XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts)")
        return Target("cpu", tuple(devices[:num_devices]))
    text = target_config_text(name)
    # The plugin checks CUDA/cuDNN versions when it starts unless CUDA is not asked for; a
    # compile-only topology needs none of them.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=text,
                                            topology=f"1x1x{num_devices}")
    except (NotImplementedError, RuntimeError, ValueError) as e:
        raise ValueError(f"target {name}: no compile-only CUDA topology ({e}); "
                         + PLUGIN_HINT.format(v=jax.__version__) + "; on a machine without CUDA "
                         "libraries set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before jax starts (`jaxserve "
                         "compile` does)") from None
    mem = _field(text, "device_memory_size")
    bw = _field(text, "memory_bandwidth")
    return Target(name, tuple(topo.devices), int(mem) if mem else None, float(bw) if bw else None, text)


def client_memory_fraction() -> float:
    """The share of a GPU's memory jax's client will hand the engine (its `bytes_limit`): what
    XLA_PYTHON_CLIENT_MEM_FRACTION says, 0.75 by default (jax preallocates that much)."""
    try:
        return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    except ValueError:
        return 0.75
