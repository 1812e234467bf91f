"""EAGLE-3 draft heads (`speculative_config={"method": "eagle3", "model": DIR}`), in the
published format (`LlamaForCausalLMEagle3`: yuhuili/EAGLE3-*, the SpecForge and speculators
exports, what vLLM loads).

A head is one Llama decoder layer over the target's own features: for each token, the
concatenation of the target's residual stream at the input of three of its layers (low, middle,
high: `eagle_aux_hidden_state_layer_ids`, default 2, L // 2, L - 3, vLLM's choice) is projected
by `fc` [3E, E]; the layer's attention reads `[input_layernorm(embedding of the next token),
hidden_norm(feature)]` (2E wide: q/k/v take 2E inputs) and adds its output to the feature (the
residual), then an MLP; `norm` and `lm_head` score a reduced draft vocabulary, mapped back to
the target's ids by `d2t` (target id = draft id + d2t[draft id]). The embedding is the target's
unless the head ships `embed_tokens.weight`. Chained drafts feed the layer's own pre-norm output
back as the next feature (no `fc`: it is E wide already).

`read_config` / `load` / `save` (safetensors, the published tensor names) / `init` (random,
for tests and as training's start) / `forward` (the layer) / `draft_logits`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.layers.linear import DenseWeight, linear
from jaxserve.layers.norm import rms_norm
from jaxserve.models.llama import LayerWeights, mlp, rope_tables, self_attention

NAME = "EAGLE-3"
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle")


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """model: the draft layer as a one-layer Llama (hidden size E = the target's); aux_layer_ids:
    the target layers whose inputs are the features; draft_vocab_size: the head's rows."""
    model: ModelConfig
    aux_layer_ids: tuple[int, ...]
    draft_vocab_size: int
    target_hidden_size: int
    final_hidden: ClassVar[bool] = False    # the features are the aux layers' inputs

    @property
    def fc_in(self) -> int:
        return len(self.aux_layer_ids) * self.target_hidden_size

    feature_width = fc_in       # the width of the target's features the step returns


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Eagle3Weights:
    fc: DenseWeight             # [n_aux * E_target, E]
    layer: LayerWeights         # one layer: attn_norm (the embedding's norm), wq/wk/wv [2E, .]
    hidden_norm: jax.Array      # [E]
    final_norm: jax.Array       # [E]
    lm_head: DenseWeight        # [E, Vd]
    d2t: jax.Array              # [Vd] int32: target id - draft id
    embed: jax.Array | None = None    # [V, E] the head's own table (None: the target's)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's (2, L // 2, L - 3), kept inside a shallow model's layers."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3))


def config_of(hf: dict, target: ModelConfig, where: str = "speculative_config.model") -> Eagle3Config:
    """A head's config.json (dict) checked against the target's config. ValueError naming
    `where` when it does not fit."""
    arch = (hf.get("architectures") or [""])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"{where}: not an EAGLE-3 head (config.json architectures {arch!r}; "
                         f"expected one of {', '.join(ARCHITECTURES)})")
    E = hf.get("hidden_size")
    if E != target.hidden_size:
        raise ValueError(f"{where}: the head's hidden_size ({E}) differs from the target's "
                         f"({target.hidden_size}); an EAGLE-3 head is trained for one target")
    if hf.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise ValueError(f"{where}: the head's vocab_size ({hf['vocab_size']}) differs from the "
                         f"target's ({target.vocab_size})")
    eagle = hf.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(target.num_layers)
    ids = tuple(int(i) for i in ids)
    if not ids or any(not 0 <= i < target.num_layers for i in ids):
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {list(ids)} must name layers "
                         f"of the target (0..{target.num_layers - 1})")
    text = {k: v for k, v in hf.items() if k not in ("eagle_config", "draft_vocab_size")}
    text.update(architectures=["LlamaForCausalLM"], num_hidden_layers=1,
                vocab_size=target.vocab_size)
    cfg = ModelConfig.from_hf(text)
    return Eagle3Config(cfg, ids, int(hf.get("draft_vocab_size") or target.vocab_size),
                        int(hf.get("target_hidden_size") or target.hidden_size))


def read_config(path: str | Path, target: ModelConfig) -> Eagle3Config:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ValueError(f"speculative_config.model: {str(path)!r} is not an EAGLE-3 head "
                         "directory (config.json + *.safetensors)")
    try:
        hf = json.loads((p / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"speculative_config.model: {p / 'config.json'} is not valid JSON: {e}") from None
    return config_of(hf, target)


def hf_config(ecfg: Eagle3Config) -> dict:
    """The published config.json of a head."""
    c = ecfg.model
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim, "num_hidden_layers": 1, "hidden_act": c.hidden_act,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "draft_vocab_size": ecfg.draft_vocab_size, "target_hidden_size": ecfg.target_hidden_size,
            "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ecfg.aux_layer_ids)}}


def config_for(target: ModelConfig, *, draft_vocab_size: int | None = None,
               aux_layer_ids: tuple[int, ...] | None = None) -> Eagle3Config:
    """A new head's config for `target` (its attention shape, MLP width and rope): what
    training starts from."""
    hf = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": target.hidden_size,
          "intermediate_size": target.intermediate_size, "num_attention_heads": target.num_heads,
          "num_key_value_heads": target.num_kv_heads, "head_dim": target.head_dim,
          "hidden_act": "silu", "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
          "max_position_embeddings": target.max_position_embeddings,
          "vocab_size": target.vocab_size, "draft_vocab_size": draft_vocab_size or target.vocab_size,
          "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                           list(aux_layer_ids or default_aux_layers(target.num_layers))}}
    return config_of(hf, target, "eagle3 head")


# The published tensor names (torch Linear weights are [out, in]; ours [in, out]).
_MATRICES = {"fc": "fc.weight", "wq": "midlayer.self_attn.q_proj.weight",
             "wk": "midlayer.self_attn.k_proj.weight", "wv": "midlayer.self_attn.v_proj.weight",
             "wo": "midlayer.self_attn.o_proj.weight", "w_gate": "midlayer.mlp.gate_proj.weight",
             "w_up": "midlayer.mlp.up_proj.weight", "w_down": "midlayer.mlp.down_proj.weight",
             "lm_head": "lm_head.weight"}
_VECTORS = {"attn_norm": "midlayer.input_layernorm.weight", "hidden_norm": "midlayer.hidden_norm.weight",
            "mlp_norm": "midlayer.post_attention_layernorm.weight", "final_norm": "norm.weight"}


def _canonical(name: str) -> str:
    """Published variants: `model.` prefixes, `layers.0.` for `midlayer.`."""
    if name.startswith("model."):
        name = name[len("model."):]
    return name.replace("layers.0.", "midlayer.")


def _expected_shapes(ecfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    c = ecfg.model
    E, HD, KD, F = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    return {"fc": (ecfg.fc_in, E), "wq": (2 * E, HD), "wk": (2 * E, KD), "wv": (2 * E, KD),
            "wo": (HD, E), "w_gate": (E, F), "w_up": (E, F), "w_down": (F, E),
            "lm_head": (E, ecfg.draft_vocab_size)}


def _assemble(ecfg: Eagle3Config, arrays: dict[str, np.ndarray], dtype) -> Eagle3Weights:
    m = {k: DenseWeight(jnp.asarray(arrays[k], dtype)) for k in _MATRICES}
    v = {k: jnp.asarray(arrays[k], dtype) for k in _VECTORS}
    layer = LayerWeights(attn_norm=v["attn_norm"], wq=m["wq"], wk=m["wk"], wv=m["wv"], wo=m["wo"],
                         mlp_norm=v["mlp_norm"], w_gate=m["w_gate"], w_up=m["w_up"],
                         w_down=m["w_down"])
    embed = arrays.get("embed")
    return Eagle3Weights(m["fc"], layer, v["hidden_norm"], v["final_norm"], m["lm_head"],
                         jnp.asarray(arrays["d2t"], jnp.int32),
                         None if embed is None else jnp.asarray(embed, dtype))


def load(path: str | Path, ecfg: Eagle3Config, dtype) -> Eagle3Weights:
    """The head's weights from `path`/*.safetensors (published names, checked shapes)."""
    from safetensors import safe_open
    p = Path(path)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        extra = " (pytorch_model.bin: convert it to safetensors first)" if (p / "pytorch_model.bin").exists() else ""
        raise ValueError(f"speculative_config.model: {p} holds no *.safetensors{extra}")
    raw = {}
    for f in files:
        with safe_open(str(f), framework="numpy") as h:
            for name in h.keys():
                raw[_canonical(name)] = h.get_tensor(name)
    arrays, shapes = {}, _expected_shapes(ecfg)
    for ours, theirs in _MATRICES.items():
        if theirs not in raw:
            raise ValueError(f"speculative_config.model: {p} has no tensor {theirs!r}")
        arrays[ours] = raw[theirs].T
        if arrays[ours].shape != shapes[ours]:
            raise ValueError(f"speculative_config.model: {theirs} has shape {raw[theirs].shape}, "
                             f"expected {shapes[ours][::-1]}")
    for ours, theirs in _VECTORS.items():
        if theirs not in raw:
            raise ValueError(f"speculative_config.model: {p} has no tensor {theirs!r}")
        arrays[ours] = raw[theirs]
    Vd = ecfg.draft_vocab_size
    arrays["d2t"] = raw["d2t"].astype(np.int64) if "d2t" in raw else np.zeros(Vd, np.int64)
    if arrays["d2t"].shape != (Vd,):
        raise ValueError(f"speculative_config.model: d2t has shape {arrays['d2t'].shape}, expected ({Vd},)")
    if not ((np.arange(Vd) + arrays["d2t"] >= 0) & (np.arange(Vd) + arrays["d2t"] < ecfg.model.vocab_size)).all():
        raise ValueError("speculative_config.model: d2t maps draft ids outside the target's vocabulary")
    if "embed_tokens.weight" in raw:
        arrays["embed"] = raw["embed_tokens.weight"]
    return _assemble(ecfg, arrays, dtype)


def save(path: str | Path, ecfg: Eagle3Config, weights: Eagle3Weights) -> None:
    """Write a head in the published format (config.json, model.safetensors with d2t and t2d)."""
    from safetensors.numpy import save_file
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    w, layer = weights, weights.layer
    mats = {"fc": w.fc, "wq": layer.wq, "wk": layer.wk, "wv": layer.wv, "wo": layer.wo,
            "w_gate": layer.w_gate, "w_up": layer.w_up, "w_down": layer.w_down, "lm_head": w.lm_head}
    vecs = {"attn_norm": layer.attn_norm, "hidden_norm": w.hidden_norm,
            "mlp_norm": layer.mlp_norm, "final_norm": w.final_norm}
    f32 = lambda a: np.ascontiguousarray(np.asarray(a, np.float32))     # noqa: E731
    tensors = {_MATRICES[k]: f32(np.asarray(v.w, np.float32).T) for k, v in mats.items()}
    tensors |= {_VECTORS[k]: f32(v) for k, v in vecs.items()}
    d2t = np.asarray(w.d2t, np.int64)
    t2d = np.zeros(ecfg.model.vocab_size, bool)
    t2d[np.arange(len(d2t)) + d2t] = True
    tensors |= {"d2t": d2t, "t2d": t2d}
    if w.embed is not None:
        tensors["embed_tokens.weight"] = f32(w.embed)
    save_file(tensors, str(p / "model.safetensors"))
    (p / "config.json").write_text(json.dumps(hf_config(ecfg), indent=2) + "\n")


def init(ecfg: Eagle3Config, key: jax.Array, dtype=jnp.float32,
         draft_to_target: np.ndarray | None = None) -> Eagle3Weights:
    """A random head (normal(0, 0.02) matrices, unit norms). `draft_to_target`: the target id of
    each draft id (sorted; default the identity over the first draft_vocab_size ids)."""
    shapes = _expected_shapes(ecfg)
    keys = jax.random.split(key, len(shapes))
    arrays = {k: np.asarray(0.02 * jax.random.normal(kk, s, jnp.float32))
              for kk, (k, s) in zip(keys, shapes.items())}
    arrays |= {k: np.ones(ecfg.model.hidden_size, np.float32) for k in _VECTORS}
    Vd = ecfg.draft_vocab_size
    ids = np.arange(Vd) if draft_to_target is None else np.asarray(draft_to_target)
    arrays["d2t"] = ids - np.arange(Vd)
    return _assemble(ecfg, arrays, dtype)


def forward(ecfg: Eagle3Config, w: Eagle3Weights, cache, embeds: jax.Array, feature: jax.Array,
            positions: jax.Array, meta, *, backend: str, kv_quantize=None, plan=None):
    """The draft layer: embeds [T, E] of the next tokens, feature [T, E] (`fc` of the target's
    aux hidden states, or the layer's own last pre-norm output) -> (normed [T, E] for the head,
    pre-norm [T, E] for the next draft, cache). The head runs whole on every device (`plan`
    unused)."""
    cfg = ecfg.model
    eps = cfg.rms_norm_eps
    cos, sin = rope_tables(cfg, positions)
    h = jnp.concatenate([rms_norm(embeds, w.layer.attn_norm, eps),
                         rms_norm(feature, w.hidden_norm, eps)], axis=-1)
    o, cache = self_attention(cfg, backend, kv_quantize, None, w.layer, h, cache,
                              jnp.int32(0), meta, cos, sin)
    residual = feature + o
    residual = residual + mlp(cfg, None, w.layer, rms_norm(residual, w.layer.mlp_norm, eps))
    return rms_norm(residual, w.final_norm, eps), residual, cache


def project(w: Eagle3Weights, aux: jax.Array) -> jax.Array:
    """The target's concatenated aux hidden states [T, n * E_target] -> features [T, E]."""
    return linear(aux.astype(w.fc.dtype), w.fc)


def draft_logits(w: Eagle3Weights, normed: jax.Array) -> jax.Array:
    """[R, E] -> [R, Vd] f32 logits over the draft vocabulary."""
    return linear(normed, w.lm_head, out_dtype=jnp.float32)


def to_target_ids(w: Eagle3Weights, draft_ids: jax.Array) -> jax.Array:
    return draft_ids + w.d2t[draft_ids]
