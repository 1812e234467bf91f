"""Host bookkeeping with no jax import: requests, the waiting queue, the scheduler, the block pool
and the KV cache manager (prefix-cache hash chain)."""
