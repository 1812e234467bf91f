"""The worker: persistent input batch, token buckets, KV cache sizing and the jitted step."""
