"""KV pool sizing and allocation: how many blocks fit in the memory budget, and the pool itself.

The engine asks `num_kv_blocks` once at start-up (after the weights are placed, so their bytes are
known) and the runner calls `allocate_kv_cache` with the answer.
"""

from __future__ import annotations

import jax

from jaxserve.attention import kv_cache as kvc
from jaxserve.config import EngineArgs

CPU_KV_BUDGET_BYTES = 2 << 30    # the KV pool on CPU when no size is given


def num_kv_blocks(args: EngineArgs, bytes_per_block: int, weight_bytes: int) -> int:
    """Blocks in the pool: `num_gpu_blocks_override`, else `kv_cache_memory_bytes`, else (CPU) a
    fixed 2 GiB scaled by gpu_memory_utilization / 0.9, else (GPU) the device's limit times
    gpu_memory_utilization minus the weights and 2 GiB for activations and XLA's workspace.
    Raises ValueError when not one block fits."""
    if args.num_gpu_blocks_override:
        return args.num_gpu_blocks_override
    if args.kv_cache_memory_bytes:
        budget = args.kv_cache_memory_bytes
    elif jax.default_backend() == "cpu":
        budget = int(CPU_KV_BUDGET_BYTES * args.gpu_memory_utilization / 0.9)
    else:
        stats = jax.devices()[0].memory_stats() or {}
        total = stats.get("bytes_limit", 16 << 30)
        # Leave room for weights, activations of the largest step and XLA's workspace.
        budget = int(total * args.gpu_memory_utilization) - weight_bytes - (2 << 30)
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise ValueError(f"no memory left for the KV cache (budget {budget} bytes); raise "
                         "gpu_memory_utilization or set kv_cache_memory_bytes")
    return int(blocks)


def allocate_kv_cache(model_config, num_blocks: int, block_size: int, dtype,
                      quantized: bool) -> kvc.KVCache:
    """The zeroed pool, `[L, N, B, K, D]` per K and V (plus scales when quantized). On CPU an fp8
    pool is held as uint8 bit patterns (`KVCache.codes`): XLA:CPU would convert the whole pool
    to f16 and back on every write (issue 11 item 8)."""
    return kvc.allocate(model_config.num_layers, num_blocks, block_size,
                        model_config.num_kv_heads, model_config.head_dim, dtype,
                        quantized=quantized, fp8_as_bytes=jax.default_backend() == "cpu")
