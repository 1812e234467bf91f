"""The model's recommended sampling defaults (vLLM's `--generation-config`).

`default_sampling_params(...)` returns what vLLM's `ModelConfig.get_diff_sampling_param()`
returns: `SamplingParams` field names -> values, applied to every request field the request
leaves unset (the server's `to_sampling_params`, `LLM.get_default_sampling_params()`).

Where the defaults come from (`generation_config`):
- "auto": the model's own: a Hugging Face directory's `generation_config.json`, or a GGUF file's
  `general.sampling.*` keys (llama.cpp's converter writes them from that same file);
- "vllm": none (vLLM's neutral defaults: temperature 1.0, no top-k/top-p/min-p, ...);
- any other value: a folder holding a `generation_config.json`.
`override_generation_config` (Hugging Face names) is merged over that, as vLLM does. Only the
sampling fields below are read; `max_new_tokens` becomes `max_tokens`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from jaxserve.sampling_params import SamplingParams

# Hugging Face generation-config name -> SamplingParams field (vLLM's `available_params`)
SAMPLING_FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature",
                   "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                   "max_new_tokens": "max_tokens"}
# llama.cpp's recommended-sampler keys (gguf-py `Keys.General.SAMPLING_*`) that have a field here
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                      "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}
FILE_NAME = "generation_config.json"


def read_generation_config(source: str, model_path: str | os.PathLike,
                           gguf_reader=None) -> tuple[dict[str, Any], str | None]:
    """The generation config named by `source` ("auto", "vllm" or a folder) as a dict of
    Hugging Face names, and where it was read from (None: nowhere). A folder without the
    file is a ValueError naming the field; a model without one has no defaults."""
    if source == "vllm":
        return {}, None
    if source == "auto":
        if gguf_reader is not None:
            found = {hf: _gguf_value(gguf_reader, key) for key, hf in GGUF_SAMPLING_KEYS.items()}
            found = {k: v for k, v in found.items() if v is not None}
            return found, (f"{model_path} (general.sampling.*)" if found else None)
        path = Path(model_path) / FILE_NAME
        if not path.is_file():
            return {}, None
    else:
        path = Path(source) / FILE_NAME
        if not path.is_file():
            raise ValueError(f"generation_config: {source!r} is not a folder holding "
                             f"{FILE_NAME} (use 'auto' for the model's own, 'vllm' for none)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"generation_config: {path} must hold a JSON object")
    return data, str(path)


def default_sampling_params(source: str, model_path: str | os.PathLike,
                            overrides: dict[str, Any] | None = None,
                            gguf_reader=None) -> tuple[dict[str, Any], str | None]:
    """(SamplingParams field -> value, where they came from). Values are checked by building
    a SamplingParams from them, so a bad file fails at start-up, naming the field."""
    config, origin = read_generation_config(source, model_path, gguf_reader)
    if overrides:
        config = {**config, **overrides}
        origin = f"{origin} + override_generation_config" if origin \
            else "override_generation_config"
    defaults = {field: config[hf] for hf, field in SAMPLING_FIELDS.items()
                if config.get(hf) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"generation config ({origin}): {e}") from None
    return defaults, (origin if defaults else None)


def generation_eos_token_ids(source: str, model_path: str | os.PathLike) -> tuple[int, ...]:
    """The `eos_token_id`(s) of the generation config, which end generation besides config.json's
    (Llama 3 Instruct lists <|eot_id|> only there). As vLLM does, "auto" and "vllm" both read the
    model directory's own file here (the ids are the model's, not a sampling default); a folder
    reads that folder's. A GGUF has none beyond its tokenizer's."""
    folder = Path(model_path) if source in ("auto", "vllm") else Path(source)
    path = folder / FILE_NAME
    if not path.is_file():
        return ()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()       # read_generation_config reports a broken file where it matters
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool))


def check_overrides(overrides: Any) -> None:
    """`override_generation_config`: a dict of the sampling fields (Hugging Face names)."""
    if overrides is None:
        return
    if not isinstance(overrides, dict):
        raise ValueError("override_generation_config must be a JSON object, got "
                         f"{type(overrides).__name__}")
    unknown = sorted(set(overrides) - set(SAMPLING_FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config has unknown key(s) {unknown}; allowed: "
                         f"{sorted(SAMPLING_FIELDS)}")


def _gguf_value(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()
