"""`--load-format dummy`: seeded random weights of the declared shapes, made on the devices
directly (one jitted program per array, `out_shardings` from the sharding rules), so an
8B-parameter model never passes through host memory. Values have a sane scale (normal * 0.02,
norms 1, biases 0): a dummy model decodes varied tokens, never NaN."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.params import Param
from jaxserve.models.registry import get_model
from jaxserve.sharding.mesh import make_mesh
from jaxserve.sharding.plan import plan_for

STD = 0.02


def _init(p: Param, key, dtype) -> jax.Array:
    if p.init == "ones":
        return jnp.ones(p.shape, dtype)
    if p.init == "zeros":
        return jnp.zeros(p.shape, dtype)
    return (STD * jax.random.normal(key, p.shape, jnp.float32)).astype(dtype)


def dummy_weights(cfg: ModelConfig, dtype, mesh=None, seed: int = 0,
                  expert_parallel: bool = False):
    """The model's weights pytree, filled from `seed`: the same seed and config give the same
    weights on any device count (each array's key is derived from its path)."""
    model = get_model(cfg.architecture)
    plan = plan_for(cfg, mesh if mesh is not None else make_mesh(), expert_parallel)
    root = jax.random.key(seed)
    arrays = {}
    for p in model.declare(cfg):
        key = jax.random.fold_in(root, zlib.crc32(p.path.encode()))
        make = jax.jit(lambda k, p=p: _init(p, k, p.dtype or dtype),
                       out_shardings=plan.sharding(p.axes))
        arrays[p.path] = make(key)
    return model.build(cfg, arrays)


def abstract_weights(cfg: ModelConfig, dtype, mesh, expert_parallel: bool = False,
                     quantization: str | None = None, int4_scheme=None):
    """The model's weights pytree as `jax.ShapeDtypeStruct`s with the shardings `dummy_weights`
    would place them with (`quantization` "fp8": as `--quantization fp8` stores them;
    `int4_scheme`, an int4 checkpoint's format from its config.json: its stacked linear layers as
    the loader reads them, `loader.int4.abstract_int4`): what compiling the engine's programs
    needs, without one byte of weights (`jaxserve.aot`)."""
    model = get_model(cfg.architecture)
    plan = plan_for(cfg, mesh, expert_parallel)
    arrays = {}
    for p in model.declare(cfg):
        sharding = plan.sharding(p.axes)
        if int4_scheme is not None and p.dense and p.stacked:
            from jaxserve.loader.int4 import abstract_int4
            arrays[p.path] = abstract_int4(int4_scheme, *p.shape[-2:], sharding, p.shape[:p.stacked_dims], p.path)
        else:
            arrays[p.path] = jax.ShapeDtypeStruct(p.shape, jnp.dtype(p.dtype or dtype), sharding=sharding)
    weights = model.build(cfg, arrays)
    if quantization == "fp8":
        from jaxserve.loader.fp8 import quantize_weights
        weights = quantize_weights(weights)
    elif quantization not in (None, "none") and int4_scheme is None:
        raise ValueError(f"quantization {quantization!r}: compiling without weights covers none, fp8 and "
                         "the int4 checkpoints a config.json's quantization_config describes")
    return weights
