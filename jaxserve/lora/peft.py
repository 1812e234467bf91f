"""Read a PEFT LoRA checkpoint (`adapter_config.json` + `adapter_model.safetensors`) into host
arrays shaped for the model's declared weights, refusing what jaxserve cannot serve with the
offending field named.

Served targets: the attention projections and the dense MLP (`LORA_TARGETS`), whatever the
checkpoint calls them (the model's declaration maps `q_proj` or Phi-3's fused `qkv_proj` to
`layers.wq`...; a fused module's A is shared by its parts and its B split by their rows).
Refused: DoRA (`use_dora`), biases (`bias` other than "none"), embedding and lm_head targets,
`modules_to_save`, per-module `rank_pattern`/`alpha_pattern`, a rank above `max_lora_rank`, and
tensors that do not fit the model's shapes (an adapter of another base model).

PEFT key names: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]; the scale `lora_alpha / r` (`/ sqrt(r)` with `use_rslora`) is folded
into B here, so the device kernel is `x @ A @ B`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from jaxserve.lora.request import LoRARequest

# The model pytree paths an adapter may change (llama.py's LayerWeights names).
LORA_TARGETS = ("layers.wq", "layers.wk", "layers.wv", "layers.wo", "layers.w_gate", "layers.w_up",
                "layers.w_down")
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.weight$")
_UNSUPPORTED_MODULES = ("embed_tokens", "lm_head", "wte", "embed", "output")


@dataclasses.dataclass
class LoraAdapter:
    """One adapter on the host. weights: model path -> (a [L, in, r] f32, b [L, r, out] f32 with
    the scale folded in); a layer the adapter leaves alone holds zeros; a target it leaves alone
    is absent. rank: the adapter's r."""

    request: LoRARequest
    rank: int
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _config(path: Path) -> dict:
    f = path / "adapter_config.json"
    try:
        is_dir = path.is_dir()
    except OSError as e:      # a name too long for the filesystem, ...: a client's bad value, not a 500
        raise ValueError(f"lora_path: {e.strerror or e}") from None
    if not is_dir:
        raise ValueError(f"lora_path: {str(path)!r} is not a folder holding a PEFT adapter")
    if not f.is_file():
        raise ValueError(f"lora_path: {str(path)!r} has no adapter_config.json")
    try:
        cfg = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"lora_path: cannot read {f}: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"lora_path: {f} must hold a JSON object")
    return cfg


def _check_config(cfg: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scale) of an adapter_config.json, or ValueError naming the field."""
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"peft_type: only LORA adapters are supported, got {peft_type!r}")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"r: the adapter rank must be an int >= 1, got {r!r}")
    if r > max_rank:
        raise ValueError(f"r: the adapter's rank {r} is above max_lora_rank {max_rank} "
                         "(raise --max-lora-rank)")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise ValueError(f"lora_alpha must be a number, got {alpha!r}")
    if cfg.get("use_dora"):
        raise ValueError("use_dora: DoRA adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"bias: only bias='none' adapters are supported, got {cfg.get('bias')!r}")
    for field in ("rank_pattern", "alpha_pattern"):
        if cfg.get(field):
            raise ValueError(f"{field}: per-module ranks and alphas are not supported")
    for field in ("lora_bias", "fan_in_fan_out", "target_parameters", "trainable_token_indices",
                  "layer_replication", "use_qalora", "alora_invocation_tokens"):
        if cfg.get(field):
            raise ValueError(f"{field}: adapters using {field} are not supported")
    if cfg.get("modules_to_save"):
        raise ValueError(f"modules_to_save: fully trained modules ({cfg['modules_to_save']}) are not "
                         "supported, only LoRA matrices")
    targets = cfg.get("target_modules")
    names = [targets] if isinstance(targets, str) else (targets or [])
    bad = [t for t in names if any(t == u or t.endswith("." + u) for u in _UNSUPPORTED_MODULES)]
    if bad:
        raise ValueError(f"target_modules: LoRA on {bad} (embeddings, lm_head) is not supported; "
                         "jaxserve serves adapters on the attention and MLP projections")
    scale = alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)
    return r, float(scale)


def _modules(params) -> dict[str, list]:
    """checkpoint module name ("model.layers.3.self_attn.q_proj") -> [(param, stack index, rows)]
    for the declared LoRA targets."""
    out: dict[str, list] = {}
    for p in params:
        if p.path not in LORA_TARGETS or not p.stacked or p.per_expert:
            continue
        ids = p.layers if p.layers is not None else range(p.shape[0])
        for i, layer in enumerate(ids):
            name = p.checkpoint.format(layer=layer).removesuffix(".weight")
            out.setdefault(name, []).append((p, i, p.rows))
    return out


def load_adapter(request: LoRARequest, params, max_rank: int) -> LoraAdapter:
    """The adapter at `request.lora_path` for a model declared by `params` (its `declare(cfg)`)."""
    path = Path(request.lora_path)
    cfg = _config(path)
    r, scale = _check_config(cfg, max_rank)
    f = path / "adapter_model.safetensors"
    if not f.is_file():
        raise ValueError(f"lora_path: {str(path)!r} has no adapter_model.safetensors (only the "
                         "safetensors format is read)")
    from safetensors import safe_open
    try:
        handle = safe_open(str(f), framework="numpy")
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    except Exception as e:     # safetensors raises its own error types
        raise ValueError(f"lora_path: cannot read {f}: {e}") from None
    modules = _modules(params)
    served = sorted({m.rsplit(".", 1)[-1] for m in modules})
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            what = "use_dora" if "magnitude" in key else "target_modules"
            raise ValueError(f"{what}: adapter tensor {key!r} is not a LoRA A/B matrix of a module "
                             f"jaxserve serves ({', '.join(served)})")
        module = m["module"]
        if module not in modules:
            raise ValueError(f"target_modules: adapter tensor {key!r} targets {module!r}, which this "
                             f"model has no LoRA-servable projection for (served: {', '.join(served)})")
        pairs.setdefault(module, {})[m["kind"]] = np.asarray(t, np.float32)
    if not pairs:
        raise ValueError(f"target_modules: {f} holds no LoRA tensors")
    base = cfg.get("base_model_name_or_path")
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for module, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"target_modules: {module} has only {sorted(ab)} in {f}")
        A, B = ab["lora_A"], ab["lora_B"]             # [r, in], [out, r]
        parts = modules[module]
        total_out = max((rows[1] if rows else p.shape[2]) for p, _, rows in parts)
        p0 = parts[0][0]
        if A.ndim != 2 or B.ndim != 2 or A.shape != (r, p0.shape[1]) or B.shape != (total_out, r):
            raise ValueError(f"base_model_name_or_path: {module}'s lora_A {list(A.shape)} / lora_B "
                             f"{list(B.shape)} do not fit this model (expected [{r}, {p0.shape[1]}] / "
                             f"[{total_out}, {r}] for r={r}); the adapter was trained for "
                             f"{base!r}, not for the served model")
        for p, i, rows in parts:
            if p.path not in weights:
                L, n_in, n_out = p.shape
                weights[p.path] = (np.zeros((L, n_in, r), np.float32), np.zeros((L, r, n_out), np.float32))
            a, b = weights[p.path]
            a[i] = A.T
            b[i] = (B[rows[0]:rows[1]] if rows else B).T * scale
    return LoraAdapter(request, r, weights)
