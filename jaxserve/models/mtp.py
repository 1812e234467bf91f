"""DeepSeek V3 / R1 multi-token prediction (`speculative_config={"method": "mtp"}`, vLLM's name;
"deepseek_mtp" is its older spelling): the checkpoint's next-token layer as the drafter.

A V3 checkpoint with `num_nextn_predict_layers: 1` holds, as `model.layers.{N}.*` (N =
num_hidden_layers, the layer past the last), one more decoder layer (MLA attention, an MoE MLP
with shared experts) and around it `enorm`, `hnorm`, `eh_proj` and `shared_head` (`norm`, `head`).
For position p it reads the target's hidden state at p (after the model's final norm: what
vLLM hands it) and the embedding of the token at p + 1 (the target's table), and predicts the
token at p + 2:

    x = eh_proj([enorm(embed(t[p + 1])), hnorm(h[p])])      (the embedding zeroed at position 0, as vLLM)
    x = decoder_layer(x)                                    (its own latent KV cache)
    draft = argmax(shared_head.head(shared_head.norm(x)))

Chained drafts feed the layer's own output x (before `shared_head.norm`) back as the next h (one
layer serves every depth, vLLM's `spec_step_idx % num_mtp_layers`). The runner is EAGLE-3's
(`worker/head_runner.py`): this module gives it the same functions as `models/eagle3.py`
(`project`, `forward`, `draft_logits`, `to_target_ids`). Unlike an EAGLE-3 head, the layer runs
split like the target under tensor parallelism (heads, experts; its latent cache repeated per
device as the target's), since it is one of the target's own layers.

`read_config` / `load` (the layer through the engine's loader: FP8 block checkpoints and
`--quantization fp8` as the target's layers) / `forward`.
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.layers.linear import DenseWeight, linear
from jaxserve.layers.norm import rms_norm
from jaxserve.models import deepseek, llama

NAME = "MTP"
ARCHITECTURES = ("DeepseekV3ForCausalLM",)


@dataclasses.dataclass(frozen=True)
class MtpConfig:
    """model: the MTP layer as a one-layer DeepSeek model (its MLP kind kept); layer_index: its
    index in the checkpoint (the target's num_hidden_layers)."""
    model: ModelConfig
    layer_index: int
    aux_layer_ids: ClassVar[tuple[int, ...]] = ()   # none: the feature is the target's final hidden state
    final_hidden: ClassVar[bool] = True

    @property
    def feature_width(self) -> int:
        return self.model.hidden_size


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MtpWeights:
    enorm: jax.Array                # [E]
    hnorm: jax.Array                # [E]
    eh_proj: DenseWeight            # [2E, E]
    layer: deepseek.LayerWeights    # stacked over one layer
    final_norm: jax.Array           # [E]  shared_head.norm
    lm_head: DenseWeight            # [E, V]  shared_head.head (the target's lm_head when absent)
    embed: jax.Array | None = None  # always the target's table


def check_target(target: ModelConfig, where: str = "speculative_config") -> None:
    """ValueError naming `where` unless `target` is a family with an MTP layer."""
    if target.architecture not in ARCHITECTURES:
        raise ValueError(f"{where}.method 'mtp': multi-token prediction runs on DeepSeek V3 / R1 "
                         f"checkpoints ({', '.join(ARCHITECTURES)}); the target is {target.architecture}")


def config_of(hf: dict, target: ModelConfig, where: str = "speculative_config") -> MtpConfig:
    """The MTP layer's config from the checkpoint's config.json (dict); ValueError naming
    `where` when the checkpoint has none or does not fit the target."""
    check_target(target, where)
    arch = (hf.get("architectures") or [""])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"{where}.model: the MTP checkpoint is {arch or 'unnamed'}, not a DeepSeek V3 / R1 "
                         f"one ({', '.join(ARCHITECTURES)})")
    n = hf.get("num_nextn_predict_layers") or 0
    if n < 1:
        raise ValueError(f"{where}.method 'mtp': the checkpoint has no multi-token prediction layer "
                         "(config.json num_nextn_predict_layers is 0 or missing)")
    if hf.get("hidden_size") != target.hidden_size or hf.get("num_hidden_layers") != target.num_layers:
        raise ValueError(f"{where}.model: the MTP checkpoint's hidden_size / num_hidden_layers "
                         f"({hf.get('hidden_size')}, {hf.get('num_hidden_layers')}) differ from the "
                         f"target's ({target.hidden_size}, {target.num_layers})")
    index = target.num_layers
    moe = target.moe
    if moe is not None:     # the layer's MLP kind: the rule at its index in the checkpoint
        sparse = index in moe.sparse_layers(index + 1)
        moe = dataclasses.replace(moe, first_k_dense_replace=0 if sparse else 1, moe_layer_freq=1)
    model = dataclasses.replace(target, num_layers=1, moe=moe, tie_word_embeddings=False)
    return MtpConfig(model, index)


def read_config(path: str | Path, target: ModelConfig) -> MtpConfig:
    p = Path(path)
    try:
        hf = json.loads((p / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"speculative_config.model: {p} has no readable config.json ({e})") from None
    return config_of(hf.get("text_config", hf), target)


def load(path: str | Path, mcfg: MtpConfig, dtype, mesh, *, quantization: str | None = None,
         expert_parallel: bool = False) -> MtpWeights:
    """The MTP layer of the safetensors checkpoint at `path`, placed on `mesh` as the target's
    layers are (`loader.assemble` on the one-layer config, the names mapped to layer N). The
    target's embedding is used; `shared_head.head` is read (the target's lm_head when absent)."""
    from jaxserve.loader.loader import _dequantized_fp8, _safetensors_getter, assemble, fp8_scheme_of
    from jaxserve.sharding.plan import plan_for
    p = Path(path)
    if not any(p.glob("*.safetensors")):
        raise ValueError(f"speculative_config.method 'mtp' reads the MTP layer from a safetensors "
                         f"checkpoint; {p} has none (a GGUF file drops the layer)")
    get = _safetensors_getter(p)
    prefix = f"model.layers.{mcfg.layer_index}."
    names = get.names
    own_head = prefix + "shared_head.head.weight" in names
    # the one-layer model's names <-> the checkpoint's (FP8 scales follow their weights' names)
    renames = [("model.layers.0.", prefix), ("model.norm.", prefix + "shared_head.norm.")] + \
        ([("lm_head.", prefix + "shared_head.head.")] if own_head else [])

    def mapped(name: str) -> str:
        for ours, theirs in renames:
            if name.startswith(ours):
                return theirs + name[len(ours):]
        return name

    def declared(name: str) -> str | None:
        for ours, theirs in sorted(renames, key=lambda r: -len(r[1])):     # shared_head.* before layer N
            if name.startswith(theirs):
                return ours + name[len(theirs):]
        return None if any(name.startswith(ours) for ours, _ in renames) or \
            name.startswith("model.layers.") else name

    def remapped(name: str) -> np.ndarray:
        return get(mapped(name))

    remapped.names = frozenset(n for n in map(declared, names) if n is not None)
    if prefix + "eh_proj.weight" not in names:
        raise ValueError(f"speculative_config.method 'mtp': {p} holds no {prefix}eh_proj.weight (the "
                         "checkpoint's config names an MTP layer its files do not have)")
    scheme = fp8_scheme_of(p)
    built = assemble(mcfg.model, remapped, dtype, mesh, quantization=quantization, fp8_scheme=scheme,
                     expert_parallel=expert_parallel)
    built.embed.delete()        # the target's table is used (V3's MTP layer ships a copy)
    rep = plan_for(mcfg.model, mesh, expert_parallel).replicated
    E = mcfg.model.hidden_size

    def read(name, shape):
        x = get(prefix + name)
        if x.dtype.name == "float8_e4m3fn":
            x = _dequantized_fp8(scheme, get, prefix + name, x.shape)
        if x.shape != shape:
            raise ValueError(f"speculative_config.method 'mtp': tensor {prefix}{name} has shape "
                             f"{tuple(x.shape)}, expected {shape} from the model config")
        return jax.device_put(np.asarray(x, np.dtype(jnp.dtype(dtype))), rep)

    eh = read("eh_proj.weight", (E, 2 * E))
    return MtpWeights(enorm=read("enorm.weight", (E,)), hnorm=read("hnorm.weight", (E,)),
                      eh_proj=DenseWeight(eh.T), layer=built.layers, final_norm=built.final_norm,
                      lm_head=built.lm_head)


def forward(mcfg: MtpConfig, w: MtpWeights, cache, embeds: jax.Array, feature: jax.Array,
            positions: jax.Array, meta, *, backend: str, kv_quantize=None, plan=None):
    """embeds [T, E] of the next tokens, feature [T, E] (the target's final hidden state, or the
    layer's own last output) -> (normed [T, E] for the head, output [T, E] for the next draft,
    cache)."""
    cfg = mcfg.model
    eps = cfg.rms_norm_eps
    embeds = jnp.where((positions == 0)[:, None], 0, embeds)
    x = linear(jnp.concatenate([rms_norm(embeds, w.enorm, eps), rms_norm(feature, w.hnorm, eps)], axis=-1),
               w.eh_proj)
    cos, sin = deepseek.rope_tables(cfg, positions)
    body = partial(deepseek.decoder_layer, cfg, backend, kv_quantize, plan, None)
    x, cache = llama.run_layers(body, (x, cache, cos, sin, meta),
                                (w.layer, jnp.zeros(1, jnp.int32)), 1)[:2]
    return rms_norm(x, w.final_norm, eps), x, cache


def project(w: MtpWeights, aux: jax.Array) -> jax.Array:
    """The target's final hidden states are the features as they are."""
    return aux.astype(w.final_norm.dtype)


def draft_logits(w: MtpWeights, normed: jax.Array) -> jax.Array:
    """[R, E] -> [R, V] f32 logits (shared_head.head)."""
    return linear(normed, w.lm_head, out_dtype=jnp.float32)


def to_target_ids(w: MtpWeights, ids: jax.Array) -> jax.Array:
    return ids
