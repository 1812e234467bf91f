"""Device meshes from the parallel sizes. Axes, outermost first: data ("dp"), expert ("ep"),
tensor ("tp"); on one device every axis has size 1 and everything still runs through the mesh."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh

MESH_AXES = ("dp", "ep", "tp")


def make_mesh(tensor_parallel_size: int = 1, expert_parallel_size: int = 1,
              data_parallel_size: int = 1, devices=None) -> Mesh:
    """A mesh of dp x ep x tp devices (the first that many of `devices`, default all local)."""
    sizes = {"data_parallel_size": data_parallel_size,
             "expert_parallel_size": expert_parallel_size,
             "tensor_parallel_size": tensor_parallel_size}
    for name, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive integer, got {size!r}")
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(sizes.values())
    if need > len(devices):
        raise ValueError(f"data_parallel_size x expert_parallel_size x tensor_parallel_size = "
                         f"{need} devices, but only {len(devices)} are available")
    grid = np.array(devices[:need], dtype=object).reshape(data_parallel_size,
                                                           expert_parallel_size,
                                                           tensor_parallel_size)
    return Mesh(grid, MESH_AXES)
