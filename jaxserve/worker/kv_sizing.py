"""KV pool sizing and allocation: how many blocks fit in the memory budget, and the pool itself.

The engine asks `num_kv_blocks` once at start-up (after the weights are placed, so their bytes are
known) and the runner calls `allocate_kv_cache` with the answer.

On a device that reports memory statistics (GPU), the budget is measured, as vLLM's profile run
does: a probe runner with a small pool runs the largest step program, with and without prompt
logprobs (XLA sizes a program's buffers statically, so an all-padding batch of the largest token
bucket needs what a real one does), and the device's `peak_bytes_in_use` afterwards is the
weights plus the largest step's activations and workspace plus the probe's pool. The KV pool
then takes

    gpu_memory_utilization * bytes_limit - (peak - probe pool bytes)

On CPU (no memory statistics) the pool holds what `max_num_seqs` sequences of `max_model_len`
tokens need, up to a cap: `VLLM_CPU_KVCACHE_SPACE` GiB (vLLM's CPU backend's variable) where set,
else `CPU_KV_BUDGET_BYTES` scaled by gpu_memory_utilization / 0.9. `kv_cache_memory_bytes` sets
the pool's size exactly on either.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from functools import partial

import jax

from jaxserve.attention import kv_cache as kvc
from jaxserve.config import EngineArgs

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 2 << 30    # the KV pool's cap on CPU when no size is given
UNMEASURED_HEADROOM = 2 << 30    # activations + workspace when a GPU reports a limit but no peak


@dataclasses.dataclass(frozen=True)
class MemoryProfile:
    """Figures of one profile run, in bytes."""
    limit: int               # device bytes_limit
    utilization: float       # gpu_memory_utilization
    weights: int             # bytes of the placed weights
    peak: int                # peak_bytes_in_use after the probe steps
    probe_pool: int          # bytes of the probe's KV pool (resident during the probe)

    @property
    def activations(self) -> int:
        """What the steps needed beyond weights and pool (activations, workspace, sampler state)."""
        return max(0, self.peak - self.weights - self.probe_pool)

    @property
    def kv_budget(self) -> int:
        return int(self.limit * self.utilization) - (self.peak - self.probe_pool)


def device_memory_stats(device=None) -> dict | None:
    """`device.memory_stats()` (None where the platform reports none, as XLA:CPU does)."""
    device = device or jax.devices()[0]
    try:
        return device.memory_stats() or None
    except Exception:   # noqa: BLE001 - some PJRT plugins raise instead of returning None
        return None


def probe_blocks(args: EngineArgs, max_model_len: int) -> int:
    """The probe runner's pool: one sequence of max_model_len."""
    return max(1, -(-max_model_len // args.block_size))


def cpu_kv_cap(utilization: float) -> int:
    """The CPU pool's largest size in bytes: `VLLM_CPU_KVCACHE_SPACE` GiB where set, else
    `CPU_KV_BUDGET_BYTES` x utilization / 0.9."""
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if space and space != "0":
        try:
            gib = float(space)
        except ValueError:
            raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got {space!r}") from None
        if gib <= 0:
            raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be > 0 GiB, got {space!r}")
        return int(gib * 2**30)
    return int(CPU_KV_BUDGET_BYTES * utilization / 0.9)


def num_kv_blocks(args: EngineArgs, bytes_per_block: int, weight_bytes: int, *,
                  profile: Callable[[int], int | None] | None = None, probe_num_blocks: int = 1,
                  stats: dict | None = None, max_model_len: int | None = None) -> int:
    """Blocks in the pool: `num_gpu_blocks_override`, else `kv_cache_memory_bytes`, else on a
    device with memory statistics (`stats`, read from the device when not given) the profiled
    budget (module docstring; `profile(probe_num_blocks)` runs the probe and returns the device's
    peak bytes in use, or None when it cannot tell), else (CPU) what `args.max_num_seqs`
    sequences of `max_model_len` tokens need (one block more each, for lookahead), at most
    `cpu_kv_cap`. Raises ValueError when not one block fits."""
    if args.num_gpu_blocks_override:
        return args.num_gpu_blocks_override
    util = args.gpu_memory_utilization
    if args.kv_cache_memory_bytes:
        budget = args.kv_cache_memory_bytes
    else:
        if stats is None and jax.default_backend() != "cpu":
            stats = device_memory_stats()
        limit = (stats or {}).get("bytes_limit")
        if not limit:
            budget = cap = cpu_kv_cap(util)
            if max_model_len:
                need = args.max_num_seqs * (-(-max_model_len // args.block_size) + 1) + 1
                budget = min(cap, need * bytes_per_block)
            logger.info("KV sizing (CPU): %.2f GiB (%s; cap %.2f GiB: %s)", budget / 2**30,
                        f"{args.max_num_seqs} sequences of {max_model_len} tokens" if max_model_len else "no length",
                        cap / 2**30, "VLLM_CPU_KVCACHE_SPACE" if os.environ.get("VLLM_CPU_KVCACHE_SPACE", "0")
                        .strip() not in ("", "0") else f"2 GiB x gpu_memory_utilization {util} / 0.9")
        else:
            peak = profile(probe_num_blocks) if profile is not None else None
            if peak is None:
                budget = int(limit * util) - weight_bytes - UNMEASURED_HEADROOM
                logger.info("KV sizing: device limit %.2f GiB x %.2f - weights %.2f GiB - %.1f GiB "
                            "unmeasured headroom = %.2f GiB for the KV pool", limit / 2**30, util,
                            weight_bytes / 2**30, UNMEASURED_HEADROOM / 2**30, budget / 2**30)
            else:
                p = MemoryProfile(int(limit), util, weight_bytes, int(peak), probe_num_blocks * bytes_per_block)
                budget = p.kv_budget
                logger.info("KV sizing (profile run): device limit %.2f GiB x %.2f = %.2f GiB; peak in "
                            "use %.2f GiB (weights %.2f, largest step's activations and workspace "
                            "%.2f, probe pool %.2f); KV pool %.2f GiB", limit / 2**30, util,
                            limit * util / 2**30, p.peak / 2**30, weight_bytes / 2**30,
                            p.activations / 2**30, p.probe_pool / 2**30, budget / 2**30)
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise ValueError(f"no memory left for the KV cache (budget {budget} bytes); raise "
                         "gpu_memory_utilization or set kv_cache_memory_bytes")
    return int(blocks)


def profile_peak_bytes(runner) -> int | None:
    """Run the runner's largest step programs (`ModelRunner.profile_run`), free its pool and
    state, and return the device's peak bytes in use (None without memory statistics)."""
    runner.profile_run()
    stats = device_memory_stats()
    runner.release()
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return int(stats["peak_bytes_in_use"])


def allocate_kv_cache(model_config, num_blocks: int, block_size: int, dtype,
                      quantized: bool, platform: str | None = None) -> kvc.KVCache:
    """The zeroed pool, `[L, N, B, K, D]` per K and V (plus scales when quantized). On CPU an fp8
    pool is held as uint8 bit patterns (`KVCache.codes`): XLA:CPU would convert the whole pool
    to f16 and back on every write (issue 11 item 8). `platform`: the devices' (default: this
    process's backend)."""
    return kvc.allocate(model_config.num_layers, num_blocks, block_size,
                        model_config.num_kv_heads, model_config.head_dim, dtype,
                        quantized=quantized, fp8_as_bytes=(platform or jax.default_backend()) == "cpu",
                        latent=is_latent(model_config))


def is_latent(model_config) -> bool:
    """The model's pool has the latent layout (multi-head latent attention: no V pages)."""
    return getattr(model_config, "mla", None) is not None


def kv_cache_sharding(plan, quantized: bool, codes: str | None, latent: bool = False) -> kvc.KVCache:
    """The pool's shardings under `plan` (a `ShardingPlan`) as a KVCache pytree (`codes` is
    static metadata: it must match the pool's; `latent`: no V pages)."""
    pages = plan.sharding(kvc.KV_AXES)
    scales = plan.sharding(kvc.SCALE_AXES) if quantized else None
    return kvc.KVCache(pages, None if latent else pages, scales, None if latent else scales, codes=codes)


def allocate_sharded_kv_cache(model_config, plan, num_blocks: int, block_size: int, dtype,
                              quantized: bool, abstract: bool = False) -> kvc.KVCache:
    """The zeroed pool made on the devices of `plan`, split on KV heads (never whole on one
    device; with TP the heads a KV head count below TP repeats are in it). `abstract`: its shapes
    and shardings only (`jax.ShapeDtypeStruct`s), for compiling without the devices
    (`jaxserve.aot`)."""
    platform = plan.mesh.devices.flat[0].platform
    if plan.tp == 1 and not abstract:
        # on the plan's device (a data-parallel replica's is not the default one)
        with jax.default_device(plan.mesh.devices.flat[0]):
            return allocate_kv_cache(model_config, num_blocks, block_size, dtype, quantized=quantized,
                                     platform=platform)
    make = partial(kvc.allocate, model_config.num_layers, num_blocks, block_size,
                   plan.cache_kv_heads(model_config.num_kv_heads), model_config.head_dim, dtype,
                   quantized=quantized, fp8_as_bytes=platform == "cpu", latent=is_latent(model_config))
    shapes = jax.eval_shape(make)
    shardings = kv_cache_sharding(plan, quantized, shapes.codes, is_latent(model_config))
    if abstract:
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)
    return jax.jit(make, out_shardings=shardings)()
