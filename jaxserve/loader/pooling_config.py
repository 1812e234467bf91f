"""Which runner a model gets (vLLM's `--runner` / `--convert`) and, for a pooling model, its
`PoolerConfig`: defaults (LAST, normalized), then the checkpoint's sentence-transformers files
(`modules.json` -> the Pooling module's `config.json`, a Normalize module), then
`--pooler-config`.

`runner="auto"` picks pooling when `convert="embed"` or when the checkpoint is a
sentence-transformers model (Qwen3-Embedding ships `Qwen3ForCausalLM` weights with
`modules.json`, `config_sentence_transformers.json` and `1_Pooling/config.json`).
"""

from __future__ import annotations

import json
import logging
import os

from jaxserve.pooling_params import CONVERTS, RUNNERS, PoolerConfig

logger = logging.getLogger("jaxserve")

SENTENCE_TRANSFORMERS_FILES = ("modules.json", "config_sentence_transformers.json",
                               os.path.join("1_Pooling", "config.json"))
# sentence-transformers' Pooling config keys -> our pooling types
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")


def is_sentence_transformers(model_path: str) -> bool:
    return os.path.isdir(model_path) and any(
        os.path.isfile(os.path.join(model_path, f)) for f in SENTENCE_TRANSFORMERS_FILES)


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not read {path}: {e}") from None


def sentence_transformers_pooler(model_path: str) -> dict:
    """{"pooling_type", "normalize"} from a sentence-transformers checkpoint (vLLM's
    get_pooling_config); {} when it has no Pooling module."""
    if not os.path.isdir(model_path):
        return {}
    modules_file = os.path.join(model_path, "modules.json")
    pooling_dir, normalize = "1_Pooling", False
    if os.path.isfile(modules_file):
        modules = _read_json(modules_file)
        if not isinstance(modules, list):
            raise ValueError(f"{modules_file} must be a list of modules")
        types = {m.get("type", ""): m.get("path", "") for m in modules if isinstance(m, dict)}
        normalize = "sentence_transformers.models.Normalize" in types
        pooling_dir = types.get("sentence_transformers.models.Pooling", pooling_dir)
    config_file = os.path.join(model_path, pooling_dir, "config.json")
    if not os.path.isfile(config_file):
        return {}
    st = _read_json(config_file)
    modes = [t for key, t in _ST_MODES.items() if st.get(key)]
    odd = [key for key in _ST_UNSUPPORTED if st.get(key)]
    if odd or len(modes) != 1:
        raise ValueError(f"{config_file}: jaxserve pools with exactly one of "
                         f"{', '.join(_ST_MODES)}; this file sets "
                         f"{', '.join(odd + [k for k in _ST_MODES if st.get(k)]) or 'none'} "
                         "(override with --pooler-config)")
    return {"pooling_type": modes[0], "normalize": normalize}


def matryoshka_of(model_path: str) -> bool | tuple[int, ...]:
    """Whether the checkpoint's config.json declares Matryoshka embeddings (vLLM reads
    `is_matryoshka` and `matryoshka_dimensions`): the tuple of sizes when listed."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return False
    hf = _read_json(path)
    dims = hf.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    return bool(hf.get("is_matryoshka", False))


def resolve_pooler(runner: str, convert: str, pooler_config: dict | None,
                   model_path: str) -> PoolerConfig | None:
    """The pooler of a pooling model, or None for a generating one. Raises ValueError naming
    the field when the combination makes no sense."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)} (classify and reward "
                         f"models are not supported), got {convert!r}")
    if runner == "generate" and convert == "embed":
        raise ValueError("convert 'embed' makes a pooling model; it needs runner 'pooling' or "
                         "'auto', not 'generate'")
    why = None
    if runner == "pooling":
        why = "--runner pooling"
    elif runner == "auto" and convert == "embed":
        why = "--convert embed"
    elif runner == "auto" and is_sentence_transformers(model_path):
        why = "the checkpoint has sentence-transformers files (modules.json ...)"
    if why is None:
        if pooler_config:
            raise ValueError("pooler_config applies to pooling models; add --runner pooling")
        return None
    settings = {**sentence_transformers_pooler(model_path), **(pooler_config or {})}
    pooler = PoolerConfig.from_dict(settings)
    logger.info("pooling model (%s): %s pooling%s", why, pooler.pooling_type,
                ", L2-normalized" if pooler.normalize else "")
    return pooler
