"""The on-device sampler (greedy, seeded random, filters, penalties, logprobs)."""
