"""Attention: the per-step metadata, the jnp reference path, backend selection, and the paged KV
cache pytree (with its quantisation) that attention reads and the model layers write."""

from jaxserve.attention.backend import AttentionCase, cpu_backend, paged_attention, resolve_backend, select_backend
from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.attention.reference import ragged_paged_attention_ref

__all__ = ["AttentionCase", "AttentionMetadata", "cpu_backend", "paged_attention", "ragged_paged_attention_ref",
           "resolve_backend",
           "select_backend"]
