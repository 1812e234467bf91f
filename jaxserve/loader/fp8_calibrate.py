"""Calibrated FP8 weights: GPTQ rounding of the linear layers (`jaxserve quantize`).

`--quantization fp8` rounds every weight to its nearest e4m3 value, as vLLM's dynamic FP8 does.
e4m3 keeps 3 mantissa bits, and no choice of scale changes that relative error: on the default
135M model about 7% of greedy choices flip (benchmarks/RESULTS.md). GPTQ (Frantar et al., 2022)
chooses the roundings instead. A matrix's input dimensions are quantised one at a time, and each
one's error is pushed onto the dimensions not yet quantised, through the inverse of the Hessian
H = 2 X^T X of the layer's inputs X on calibration tokens. That minimises ||X W - X Q||^2, the
error the next layer sees, rather than ||W - Q||^2.

The stored format does not change: e4m3 codes with per-output-channel scales, an ordinary
`Fp8Weight` that every kernel runs and that `loader/export.py` writes as a compressed-tensors
checkpoint.

The layers are quantised in order ("true sequential"). One eager pass over the calibration tokens
runs the model's own forward (`forward(..., each_layer=...)`). Each matrix quantises itself when
its input first arrives, so the inputs of later matrices already carry the earlier ones' error.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention import kv_cache as kvc
from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.config import ModelConfig
from jaxserve.layers.fp8 import Fp8Weight
from jaxserve.layers.linear import DenseWeight, linear, register_linear
from jaxserve.loader.fp8 import SKIP_ON_THE_FLY, fp8_weight, replace_dense
from jaxserve.models.registry import get_model
from jaxserve.pallas.fp8_matmul import FP8, FP8_MAX, quantize_weight

BLOCK = 128          # input dimensions quantised per inner loop (GPTQ's lazy batch update)
PAGE = 16            # KV block size of the calibration pass's own pool


@partial(jax.jit, static_argnames=("block", "act_order"))
def gptq_fp8(w: jax.Array, h: jax.Array, damp: float = 0.01, block: int = BLOCK, act_order: bool = True):
    """w [K, N] (input dimensions first, as `DenseWeight` stores it) and its inputs' Hessian
    h [K, K] -> (e4m3 codes [K, N], f32 per-output-channel scales [1, N]), the scales amax / 448
    of the full-precision columns. `act_order`: the input dimensions with the largest Hessian
    diagonal (the most used) are quantised first, while the most dimensions are left to absorb
    their error (GPTQ's desc_act).

    `damp`: a fraction of the mean diagonal added to H (GPTQ's dampening; larger is closer to
    round-to-nearest). Input dimensions no calibration token used (zero diagonal) are zeroed.
    A Hessian whose inverse's Cholesky factor is not finite in f32 falls back to round-to-nearest."""
    k, n = w.shape
    w = w.astype(jnp.float32)
    h = h.astype(jnp.float32)
    _, scale = quantize_weight(w, "channel")       # round-to-nearest's scales (its codes unused)
    dead = jnp.diag(h) == 0
    w = jnp.where(dead[:, None], 0.0, w)
    h = h + jnp.diag(jnp.where(dead, 1.0, 0.0))
    h = h + damp * jnp.mean(jnp.diag(h)) * jnp.eye(k)
    order = jnp.argsort(-jnp.diag(h)) if act_order else jnp.arange(k)
    w, h = w[order], h[order][:, order]
    kp = -(-k // block) * block                     # padded dimensions: identity, zero weights
    w = jnp.pad(w, ((0, kp - k), (0, 0)))
    h = jnp.pad(h, ((0, kp - k), (0, kp - k))) + jnp.diag((jnp.arange(kp) >= k).astype(jnp.float32))
    u = jnp.linalg.cholesky(jnp.linalg.inv(h)).T    # upper: H^-1 = U^T U
    # A Hessian too ill-conditioned for f32 (non-finite factor): U = I is round-to-nearest.
    u = jnp.where(jnp.all(jnp.isfinite(u)), u, jnp.eye(kp))

    def rounded(row):
        return jnp.clip(row / scale[0], -FP8_MAX, FP8_MAX).astype(FP8).astype(jnp.float32) * scale[0]

    def one_block(b, carry):
        w, q = carry
        start = b * block
        wb = jax.lax.dynamic_slice(w, (start, 0), (block, n))
        ub = jax.lax.dynamic_slice(u, (start, start), (block, block))

        def one_dim(i, c):
            wb, qb, eb = c
            qi = rounded(wb[i])
            e = (wb[i] - qi) / ub[i, i]
            return wb - ub[i][:, None] * e[None, :], qb.at[i].set(qi), eb.at[i].set(e)

        zeros = jnp.zeros_like(wb)
        _, qb, eb = jax.lax.fori_loop(0, block, one_dim, (wb, zeros, zeros))
        later = jax.lax.dynamic_slice(u, (start, 0), (block, kp)) * (jnp.arange(kp) >= start + block)
        return w - later.T @ eb, jax.lax.dynamic_update_slice(q, qb, (start, 0))

    _, q = jax.lax.fori_loop(0, kp // block, one_block, (w, jnp.zeros_like(w)))
    q = jnp.zeros((k, n), jnp.float32).at[order].set(q[:k])
    codes = jnp.clip(q / scale, -FP8_MAX, FP8_MAX).astype(FP8)
    return codes, scale


@dataclasses.dataclass
class _Calibrating:
    """One layer's slice of a linear layer during the calibration pass: on its first call it
    quantises itself with GPTQ on that call's inputs, records the codes, and computes with them
    (W8A16) from then on."""

    w: jax.Array                   # [K, N] full precision
    out: list                      # where (codes, scale) go
    rows: jax.Array | None         # the token rows that enter the Hessian (None: all)
    damp: float
    act_order: bool
    done: Fp8Weight | None = None

    def quantise(self, x: jax.Array) -> Fp8Weight:
        if self.done is None:
            x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
            if self.rows is not None:
                x = x[self.rows]
            codes, scale = gptq_fp8(self.w, 2.0 * (x.T @ x) / x.shape[0], self.damp,
                                    act_order=self.act_order)
            self.out.append((codes, scale))
            self.done = Fp8Weight(codes, scale, activations="none", kernel="xla")
        return self.done


@register_linear(_Calibrating)
def _calibrating(x: jax.Array, weight: _Calibrating) -> jax.Array:
    return linear(x, weight.quantise(x))


def prefill_batch(cfg: ModelConfig, sequences: Sequence[Sequence[int]], dtype=jnp.float32):
    """One prefill step over whole `sequences`: (tokens [T], positions [T], AttentionMetadata,
    a zeroed KV pool of exactly their pages) for `forward`."""
    lens = [len(s) for s in sequences]
    per_seq = [math.ceil(n / PAGE) for n in lens]
    tables = np.zeros((len(lens), max(per_seq)), np.int32)
    for i, (start, count) in enumerate(zip(np.cumsum([0] + per_seq[:-1]), per_seq)):
        tables[i, :count] = np.arange(start, start + count)
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    slots = tables[np.repeat(np.arange(len(lens)), lens), positions // PAGE] * PAGE + positions % PAGE
    meta = AttentionMetadata(jnp.asarray(slots, jnp.int32), jnp.asarray(tables), jnp.asarray(lens, jnp.int32),
                             jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32),
                             jnp.asarray([len(lens)], jnp.int32))
    cache = kvc.allocate(cfg.num_layers, int(sum(per_seq)), PAGE, cfg.num_kv_heads, cfg.head_dim, dtype,
                         latent=cfg.mla is not None)
    tokens = jnp.asarray(np.concatenate([np.asarray(s, np.int32) for s in sequences]))
    return tokens, jnp.asarray(positions), meta, cache


def calibrate_fp8(cfg: ModelConfig, weights, sequences: Sequence[Sequence[int]], *,
                  damp: float = 0.01, skip_first: int = 0, act_order: bool = True,
                  activations: str | None = None,
                  kernel: str = "auto", skip: tuple[str, ...] = SKIP_ON_THE_FLY):
    """The model's linear layers (those `--quantization fp8` quantises: every `DenseWeight` but
    `skip`) as GPTQ-rounded `Fp8Weight`s with per-output-channel scales, calibrated on
    `sequences` (token ids, each a separate sequence attended causally from position 0).

    `skip_first`: positions at the start of each sequence left out of the Hessians. 0 by default:
    the first token is the attention sink every later token reads, so its K and V projections
    matter most (leaving it out measured 0.922 teacher-forced agreement on the default model
    against 0.949 with it, benchmarks/RESULTS.md).
    `damp`, `act_order`: as `gptq_fp8`. `activations`, `kernel`: as `loader.fp8.quantize_array`
    (W8A8 on FP8 GPUs, else W8A16).
    Runs eagerly, one pass; memory is the KV of all the tokens plus one layer's activations."""
    lens = [len(s) for s in sequences]
    if not lens or min(lens) <= skip_first:
        raise ValueError(f"calibration needs sequences longer than skip_first={skip_first} tokens")
    if max(lens) > cfg.max_position_embeddings:
        raise ValueError(f"calibration sequences are at most max_position_embeddings="
                         f"{cfg.max_position_embeddings} tokens, got {max(lens)}")
    model = get_model(cfg.architecture)
    names = [f.name for f in dataclasses.fields(weights.layers)
             if isinstance(getattr(weights.layers, f.name), DenseWeight) and f"layers.{f.name}" not in skip]
    if not names:
        raise ValueError("the model has no full-precision linear layers to calibrate (is it an FP8 checkpoint "
                         "already?)")
    tokens, positions, meta, cache = prefill_batch(cfg, sequences, weights.embed.dtype)
    rows = None if skip_first == 0 else jnp.nonzero(positions >= skip_first)[0].astype(jnp.int32)
    found: dict[str, list] = {n: [] for n in names}

    def each_layer(index, layer):
        return dataclasses.replace(layer, **{n: _Calibrating(getattr(layer, n).w, found[n], rows, damp,
                                                                 act_order)
                                             for n in names})

    model.forward(weights, cache, tokens, positions, meta, cfg=cfg, backend="reference",
                  each_layer=each_layer)

    def replace(path, w):
        name = path.removeprefix("layers.")
        if name not in found:
            return w
        codes = jnp.stack([c for c, _ in found[name]])
        scales = jnp.stack([s for _, s in found[name]])
        return fp8_weight(codes, scales, like=w.w, activations=activations, kernel=kernel)
    return replace_dense(weights, replace)
