"""Lower a jitted function for CUDA on a machine without a GPU, on every jax we test (0.10, 0.11).

Why a helper: the two jax versions find the target GPU differently.
  - jax 0.10: Pallas' Triton lowering asks `jax.local_devices(backend="gpu")` and, finding none,
    falls back to compute capability 9.0 (Hopper). A plain `lower(lowering_platforms=("cuda",))`
    works.
  - jax 0.11: Pallas (Triton and Mosaic GPU) reads the target from the abstract mesh's
    `AbstractDevice`; with no GPU and no abstract device it raises "No supported GPU devices
    found". So the lowering runs under `jax.sharding.use_abstract_mesh` with an H100 device.
The version gate lives here only; kernel lowering tests (Triton today, Mosaic GPU next) call
`lower_for_cuda` and assert on the returned text.
"""
from __future__ import annotations

import contextlib

import jax

# What an H100 SXM reports as jax.devices()[0].device_kind / core_count (SMs).
H100_DEVICE_KIND = "NVIDIA H100 80GB HBM3"
H100_NUM_CORES = 132


def jax_version() -> tuple[int, int]:
    """(major, minor) of the running jax, e.g. (0, 11)."""
    major, minor = jax.__version__.split(".")[:2]
    return int(major), int(minor)


def needs_abstract_device() -> bool:
    """True where Pallas' GPU lowering reads its target from the abstract mesh (jax >= 0.11)."""
    return jax_version() >= (0, 11)


@contextlib.contextmanager
def cuda_target(device_kind: str = H100_DEVICE_KIND, num_cores: int = H100_NUM_CORES):
    """Context in which tracing/lowering targets `device_kind` (an H100 by default).

    jax >= 0.11: a one-device abstract mesh (Explicit axis, so the setting applies at top level)
    carrying an `AbstractDevice(platform="gpu")`. jax 0.10: nothing to set (Triton falls back to
    compute capability 9.0 without a GPU, the same as an H100).
    """
    if not needs_abstract_device():
        yield
        return
    sharding = jax.sharding
    device = sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
    mesh = sharding.AbstractMesh((1,), ("x",), (sharding.AxisType.Explicit,),
                                 abstract_device=device)
    with sharding.use_abstract_mesh(mesh):
        yield


def lower_for_cuda(jitted, *args, **kwargs) -> str:
    """Trace `jitted(*args, **kwargs)` and lower it for CUDA; returns the StableHLO text.

    `jitted` is a `jax.jit`-wrapped function (static arguments passed by keyword as usual).
    Kernels appear in the text as custom calls (`__gpu$xla.gpu.triton` for Triton,
    `mosaic_gpu` for Mosaic GPU). Raises what jax raises when lowering is unsupported.
    """
    with cuda_target():
        traced = jitted.trace(*args, **kwargs)
        return traced.lower(lowering_platforms=("cuda",)).as_text()
