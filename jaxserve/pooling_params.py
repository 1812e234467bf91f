"""Pooling models (`runner="pooling"`): the model-wide `PoolerConfig` and the per-request
`PoolingParams`, shaped as vLLM's.

Host side, no jax. A pooling request is a prompt whose final hidden states (after the model's
last norm) are pooled into one vector: the last token's (LAST, Qwen3-Embedding), the mean over
the prompt (MEAN) or the first token's (CLS); then, per request, truncated to `dimensions`
(Matryoshka models) and L2-normalized (the default for embeddings, as in vLLM).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxserve.sampling_params import RequestOutputKind

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns a prompt's hidden states into one vector (vLLM's
    `--pooler-config`): `pooling_type` LAST / MEAN / CLS, `normalize` (L2, the embedding default)
    and `dimensions`, the output size of requests that give none (None: the hidden size)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of "
                             f"{', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be true or false, got "
                             f"{self.normalize!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"pooler_config.dimensions must be a positive integer, got "
                             f"{self.dimensions!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> PoolerConfig:
        if d is not None and not isinstance(d, dict):
            raise ValueError(f"pooler_config must be a JSON object such as "
                             f"{{\"pooling_type\": \"MEAN\"}}, got {type(d).__name__}")
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"pooler_config: unknown key(s) {', '.join(unknown)}; jaxserve "
                             f"reads {', '.join(sorted(known))}")
        if isinstance(d.get("pooling_type"), str):
            d["pooling_type"] = d["pooling_type"].upper()
        return cls(**d)

    @property
    def needs_every_token(self) -> bool:
        """MEAN and CLS read hidden states of prompt tokens a prefix-cache hit would skip, so
        they run without prefix caching; LAST always computes the last token."""
        return self.pooling_type != "LAST"


@dataclass
class PoolingParams:
    """One pooling request's options (vLLM's `PoolingParams`).

    truncate_prompt_tokens: keep only the last k prompt tokens (-1: as many as max_model_len);
    dimensions: Matryoshka truncation of the output (only models that declare it);
    normalize: L2-normalize (None: the model's pooler config, True for embeddings)."""

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    task: str | None = None          # "embed" or "encode" (the same vector here)
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self):
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {k!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int)
                                            or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.task not in (None, "embed", "encode"):
            raise ValueError(f"task must be 'embed' or 'encode', got {self.task!r}")

    def clone(self) -> PoolingParams:
        return dataclasses.replace(self)


def check_dimensions(dimensions: int | None, hidden_size: int,
                     matryoshka: bool | tuple[int, ...]) -> None:
    """Raise ValueError naming `dimensions` unless the model can return that many: a Matryoshka
    model (`matryoshka` True, or the tuple of its supported sizes) and at most hidden_size."""
    if dimensions is None or dimensions == hidden_size:
        return
    if not matryoshka:
        raise ValueError("dimensions: this model does not support Matryoshka representations "
                         f"(its embeddings have {hidden_size} dimensions); leave dimensions unset")
    if dimensions > hidden_size:
        raise ValueError(f"dimensions must be at most the model's hidden size {hidden_size}, got "
                         f"{dimensions}")
    if isinstance(matryoshka, tuple) and dimensions not in matryoshka:
        raise ValueError(f"dimensions: this model supports the Matryoshka sizes "
                         f"{list(matryoshka)}, got {dimensions}")


def finish_vector(pooled: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """The pooled vector [E] -> the request's output: truncated to `dimensions` first, then
    L2-normalized (vLLM's order, so a truncated Matryoshka embedding has unit length)."""
    v = np.asarray(pooled, np.float32)
    if dimensions is not None:
        v = v[:dimensions]
    if normalize:
        v = v / max(float(np.linalg.norm(v)), 1e-12)
    return v
