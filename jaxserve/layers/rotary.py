"""Rotary position embeddings: inverse frequencies (with linear / llama3 / dynamic NTK / YaRN
scaling), cos/sin, rotation.

YaRN follows transformers' `_compute_yarn_parameters` (and vLLM's YaRNScalingRotaryEmbedding):
frequencies ramp from extrapolated (fast dimensions) to interpolated by `factor` (slow ones)
between the correction dimensions of beta_fast / beta_slow rotations over
original_max_position_embeddings, and cos/sin are multiplied by an attention factor (0.1 ln(factor)
+ 1, or DeepSeek's mscale / mscale_all_dim ratio), which scales q.k by its square.

Dynamic NTK ("dynamic") follows vLLM, not transformers. transformers recomputes the base on each
forward from the longest position seen so far, once it passes max_position_embeddings, so the
same token gets another rotation as the sequence grows, and the keys a paged KV cache already
holds were rotated with an older base. vLLM (`DynamicNTKScalingRotaryEmbedding`) uses one base
for every position: the one transformers computes for a sequence of max_position_embeddings x
factor tokens. jaxserve does the same, so cached keys stay valid, and matches transformers
exactly on a sequence of that length (tests/test_rope_scaling.py). On shorter sequences the
two differ by design (transformers there uses the unscaled base).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] (host numpy), with linear, llama3, dynamic NTK or YaRN
    scaling applied (YaRN reads original_max_position_embeddings from `scaling`: ModelConfig
    fills it in)."""
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "dynamic":
        # transformers' base for seq_len = max_position_embeddings * factor, where its
        # factor * seq_len / max_position_embeddings - (factor - 1) is factor^2 - factor + 1
        factor = float(scaling["factor"])
        theta = theta * (factor * factor - factor + 1) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def _yarn_inv_freq(inv_freq: np.ndarray, head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001           # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp      # 1: the dimension keeps its frequency, 0: divided by factor
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by (1.0 but for YaRN): `attention_factor` when given,
    else DeepSeek's mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set,
    else 0.1 ln(factor) + 1, as transformers computes it."""
    scaling = scaling or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor)


def mla_softmax_scale_factor(scaling: dict | None) -> float:
    """What DeepSeek's attention scale 1/sqrt(qk_head_dim) is multiplied by: mscale(factor,
    mscale_all_dim)^2 when the rope is scaled and mscale_all_dim is set (transformers'
    `yarn_apply_mscale`), else 1."""
    scaling = scaling or {}
    m = scaling.get("mscale_all_dim")
    if scaling.get("rope_type", "default") == "default" or not m:
        return 1.0
    return _yarn_mscale(float(scaling["factor"]), float(m)) ** 2


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [T] -> cos, sin [T, head_dim // 2] in f32."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half rotary embedding (the Hugging Face layout). x [T, heads, D]."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


# --- LongRoPE (Phi-3 / Phi-4-mini: rope_type "longrope", formerly "su") -------------------------
# One set of factors for every position, chosen once as vLLM does (Phi3LongRoPEScaledRotaryEmbedding:
# the long factors when the served context, max_model_len, exceeds original_max_position_embeddings,
# else the short ones), so the keys a paged KV cache holds never need another rotation.
# transformers picks per forward call by the longest position in it; the two agree whenever the
# sequence is on the same side of original_max_position_embeddings as max_model_len.


def longrope_inv_freq(rotary_dim: int, theta: float, scaling: dict, long: bool) -> np.ndarray:
    """Inverse frequencies [rotary_dim // 2]: each pair's base frequency divided by its factor."""
    factors = np.asarray(scaling["long_factor" if long else "short_factor"], np.float64)
    inv_freq = 1.0 / (factors * theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    return inv_freq.astype(np.float32)


def longrope_attention_factor(scaling: dict, max_position_embeddings: int) -> float:
    """The factor cos and sin are multiplied by: `attention_factor`, else sqrt(1 + ln(s) / ln(L0))
    for s = `factor` (default max_position_embeddings / L0) > 1, L0 = original_max_position_embeddings."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_position_embeddings / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
