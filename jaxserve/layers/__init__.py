"""Building blocks the model files share: linear and its weight types, norms, rotary embeddings."""
