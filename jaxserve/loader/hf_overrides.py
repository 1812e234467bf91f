"""`--hf-overrides` and `--rope-scaling`: JSON merged into a model's config.json before it is read,
as vLLM merges them (`ModelConfig._apply_dict_overrides`).

A key's value replaces the file's, except where both are objects and the key names a sub-config
(`text_config`, `vision_config`, ...): those merge key by key. `--rope-scaling` is vLLM's older
spelling of `--hf-overrides '{"rope_scaling": ...}'`. A file in transformers 5's layout keeps its rope
settings in `rope_parameters` (which `ModelConfig.from_hf` prefers): a `rope_scaling` or `rope_theta`
override is written there too, so it is not shadowed.
"""

from __future__ import annotations

from typing import Any


def merge_overrides(hf_overrides: dict | None, rope_scaling: dict | None) -> dict | None:
    """The one overrides dict of EngineArgs' hf_overrides and rope_scaling (None: nothing to do).
    A ValueError names the field that is not a JSON object."""
    for name, value in (("hf_overrides", hf_overrides), ("rope_scaling", rope_scaling)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{name} must be a JSON object (a dict), got {type(value).__name__}")
    merged = dict(hf_overrides or {})
    if rope_scaling:
        merged["rope_scaling"] = dict(rope_scaling)
    return merged or None


def apply_hf_overrides(hf: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of the config.json dict `hf` with `overrides` merged in (the file is not touched)."""
    if not overrides:
        return hf
    out = dict(hf)
    for key, value in overrides.items():
        old = out.get(key)
        if key.endswith("_config") and isinstance(old, dict) and isinstance(value, dict):
            out[key] = apply_hf_overrides(old, value)
        else:
            out[key] = value
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = dict(out["text_config"])      # written below; `hf`'s stays as it was
    for text in (out, out.get("text_config")):
        params = text.get("rope_parameters") if isinstance(text, dict) else None
        if not isinstance(params, dict):
            continue
        if "rope_scaling" in overrides:
            scaling = dict(overrides["rope_scaling"] or {})
            params = {"rope_theta": params.get("rope_theta", text.get("rope_theta", 10000.0)), **scaling}
        if "rope_theta" in overrides:
            params = {**params, "rope_theta": overrides["rope_theta"]}
        text["rope_parameters"] = params
    return out
