"""A LoRA adapter to train: its arrays, the weight type that applies it, and PEFT's file format.

An adapter is `{module: LoraAB(a [L, in, r], b [L, r, out])}` for each targeted projection
("q_proj", "v_proj", ...: the Hugging Face module names, read from the family's `declare`), a
pytree optax updates directly. `apply_adapter` wraps each targeted `DenseWeight` of the model in a
`TrainLoraWeight`, whose registered `linear` computes x W + scale (x A) B: the base matrix is
frozen (`stop_gradient`) and never materialised merged, so a backward pass costs no [in, out]
weight gradient. Initialised as PEFT does (A kaiming-uniform, B zero: the adapter starts as the
identity), saved as PEFT's `adapter_config.json` + `adapter_model.safetensors`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.layers.linear import DenseWeight, linear, register_linear
from jaxserve.models import get_model
from jaxserve.models.params import Param


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """PEFT's LoraConfig fields this trainer uses. scale = lora_alpha / r."""
    r: int = 8
    lora_alpha: float = 16.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")

    def __post_init__(self):
        if not (isinstance(self.r, int) and self.r > 0):
            raise ValueError(f"r must be a positive int, got {self.r!r}")
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha!r}")
        if not self.target_modules or isinstance(self.target_modules, str):
            raise ValueError(f"target_modules must be a non-empty tuple of module names, got {self.target_modules!r}")

    @property
    def scale(self) -> float:
        return self.lora_alpha / self.r


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraAB:
    a: jax.Array     # [L, in, r]
    b: jax.Array     # [L, r, out]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainLoraWeight:
    """A frozen base matrix with one trainable low-rank update: x @ w + scale * (x @ a) @ b."""
    base: DenseWeight                 # [..., in, out]
    a: jax.Array                      # [..., in, r]
    b: jax.Array                      # [..., r, out]
    scale: float = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self):
        return self.base.shape

    @property
    def dtype(self):
        return self.base.dtype


@register_linear(TrainLoraWeight)
def _lora_linear(x: jax.Array, weight: TrainLoraWeight, out_dtype=None) -> jax.Array:
    y = linear(x, weight.base, out_dtype=jnp.float32)
    down = jnp.einsum("...i,ir->...r", x, weight.a.astype(x.dtype), preferred_element_type=jnp.float32)
    y = y + weight.scale * jnp.einsum("...r,ro->...o", down, weight.b.astype(jnp.float32))
    return y.astype(out_dtype or x.dtype)


def lora_targets(cfg: ModelConfig) -> dict[str, Param]:
    """Hugging Face module name ("q_proj") -> the declared matrix it adapts: the dense per-layer
    matrices of every layer, as one checkpoint tensor each (not fused, not per expert)."""
    out = {}
    for p in get_model(cfg.architecture).declare(cfg):
        if p.dense and p.stacked and not p.per_expert and p.layers is None and p.rows is None:
            out[p.checkpoint.split(".")[-2]] = p
    return out


def _targets(cfg: ModelConfig, spec: LoraSpec) -> dict[str, Param]:
    known = lora_targets(cfg)
    unknown = [m for m in spec.target_modules if m not in known]
    if unknown:
        raise ValueError(f"target_modules {unknown} are not LoRA targets of {cfg.architecture}; "
                         f"known: {sorted(known)}")
    return {m: known[m] for m in spec.target_modules}


def init_adapter(cfg: ModelConfig, spec: LoraSpec, key: jax.Array) -> dict[str, LoraAB]:
    """A fresh f32 adapter: A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming_uniform_(a=sqrt(5))),
    B = 0, so the adapted model starts equal to the base."""
    out = {}
    for (module, p), k in zip(_targets(cfg, spec).items(),
                              jax.random.split(key, len(spec.target_modules))):
        L, fan_in, fan_out = p.shape
        bound = 1.0 / math.sqrt(fan_in)
        out[module] = LoraAB(jax.random.uniform(k, (L, fan_in, spec.r), jnp.float32, -bound, bound),
                             jnp.zeros((L, spec.r, fan_out), jnp.float32))
    return out


def apply_adapter(weights, cfg: ModelConfig, spec: LoraSpec, adapter: dict[str, LoraAB]):
    """The model pytree with each targeted matrix a `TrainLoraWeight` around its frozen base."""
    changes = {}
    for module, p in _targets(cfg, spec).items():
        field = p.path.split(".", 1)[1]
        base = getattr(weights.layers, field)
        if not isinstance(base, DenseWeight):
            raise ValueError(f"target_modules: {module} is stored as {type(base).__name__}; "
                             "LoRA training needs full-precision (DenseWeight) base weights")
        ab = adapter[module]
        changes[field] = TrainLoraWeight(jax.tree.map(jax.lax.stop_gradient, base), ab.a, ab.b,
                                         spec.scale)
    return dataclasses.replace(weights, layers=dataclasses.replace(weights.layers, **changes))


def save_peft(path: str | Path, cfg: ModelConfig, spec: LoraSpec, adapter: dict[str, LoraAB],
              base_model_name_or_path: str = "") -> Path:
    """Write `adapter_config.json` and `adapter_model.safetensors` (f32) as PEFT does, so
    `peft.PeftModel.from_pretrained` and a LoRA-serving engine read it. Returns the folder."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, p in _targets(cfg, spec).items():
        a, b = np.asarray(adapter[module].a), np.asarray(adapter[module].b)
        for i in range(p.shape[0]):
            prefix = "base_model.model." + p.checkpoint_name(i).removesuffix(".weight")
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i].T)   # [r, in]
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i].T)   # [out, r]
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": spec.r, "lora_alpha": spec.lora_alpha, "lora_dropout": 0.0,
        "target_modules": sorted(spec.target_modules), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "inference_mode": True,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
