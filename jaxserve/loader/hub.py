"""Hugging Face Hub model names -> local paths, through `huggingface_hub` (vLLM's behaviour).

`resolve_model("org/name")` downloads what jaxserve loads (safetensors weights, JSON configs,
tokenizer files, chat templates; never `.bin`/`.pt`/`.gguf` or files in sub-folders) into the
Hugging Face cache (or `download_dir`, laid out the same way) and returns the snapshot folder.
`org/name/FILE.gguf` downloads that one GGUF file. A name that exists on disk is a local path
and is returned as given. huggingface_hub does the rest: `HF_TOKEN` (sent as the Authorization
header), `HF_ENDPOINT`, `HF_HUB_OFFLINE=1` (resolve from the cache only), a tqdm progress bar,
and resuming a partial download (`blobs/*.incomplete`) with a Range request.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from jaxserve.loader.loader import ModelLoadError

# Top-level files only (IGNORE_PATTERNS drops sub-folders: other formats, "original/" checkpoints).
ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]
CONFIG_PATTERNS = ["*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]   # no weights
IGNORE_PATTERNS = ["*/*"]
# org/name, or org/name/FILE.gguf; names as the Hub allows them (letters, digits, - _ .).
_HUB_NAME = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)(?:/(?P<file>[^/]+\.gguf))?")


def looks_like_hub_name(name: str) -> bool:
    """`org/name` or `org/name/FILE.gguf` (not starting with '.', '~' or '/')."""
    return bool(_HUB_NAME.fullmatch(name)) and not name.startswith((".", "~", "/")) \
        and ".." not in name


def resolve_model(name: str | os.PathLike, *, revision: str | None = None,
                  download_dir: str | None = None, weights: bool = True) -> str:
    """A local path for `name`: the path itself when it exists; else, for a hub name, the
    downloaded (or, offline, cached) snapshot folder or GGUF file. `weights=False` fetches
    configs and tokenizer files only (`--load-format dummy`, a `--tokenizer` name).
    Raises ModelLoadError naming the model (and HF_HUB_OFFLINE when that is why)."""
    text = os.fspath(name)
    if os.path.exists(os.path.expanduser(text)):
        return text
    if not looks_like_hub_name(text):
        raise ModelLoadError(f"model path {text!r} does not exist (jaxserve loads a local Hugging "
                             "Face directory, a .gguf file, or a Hub name such as org/name or "
                             "org/name/FILE.gguf)")
    match = _HUB_NAME.fullmatch(text)
    repo, gguf_file = match["repo"], match["file"]
    import huggingface_hub as hf
    from huggingface_hub import constants
    cache_dir = os.path.expanduser(download_dir) if download_dir else None
    try:
        if gguf_file is not None:
            return hf.hf_hub_download(repo, gguf_file, revision=revision, cache_dir=cache_dir)
        folder = hf.snapshot_download(repo, revision=revision, cache_dir=cache_dir,
                                      allow_patterns=ALLOW_PATTERNS if weights else CONFIG_PATTERNS,
                                      ignore_patterns=IGNORE_PATTERNS)
    # huggingface_hub's errors: repo/revision/file not found, offline and not cached, 401, network
    except (OSError, ValueError, hf.errors.HfHubHTTPError, hf.errors.EntryNotFoundError) as e:
        where = f" at revision {revision!r}" if revision else ""
        offline = (" HF_HUB_OFFLINE is set, so only the local Hugging Face cache "
                   f"({cache_dir or constants.HF_HUB_CACHE}) was searched and the model is not "
                   "(completely) there: run once without HF_HUB_OFFLINE to download it."
                   if constants.HF_HUB_OFFLINE else "")
        raise ModelLoadError(f"could not get the Hub model {text!r}{where}: "
                             f"{type(e).__name__}: {_first_line(e)}.{offline}") from e
    if weights and not any(Path(folder).glob("*.safetensors")):
        raise ModelLoadError(_no_safetensors(repo, revision, cache_dir, folder))
    return folder


def _no_safetensors(repo: str, revision: str | None, cache_dir: str | None, folder: str) -> str:
    """The refusal of a repo without top-level safetensors, naming its GGUF files if it has any."""
    ggufs: list[str] = []
    try:
        from huggingface_hub import get_cached_repo_tree
        ggufs = sorted(f.path for f in get_cached_repo_tree(repo, revision=revision, cache_dir=cache_dir)
                       if f.path.endswith(".gguf"))
    except Exception:       # no cached listing (offline): the message just omits the files
        pass
    if ggufs:
        return (f"Hub model {repo!r} has no .safetensors weights but GGUF files: name one, e.g. "
                f"{repo}/{ggufs[0]} (files: {', '.join(ggufs[:8])}{' ...' if len(ggufs) > 8 else ''})")
    return (f"Hub model {repo!r} has no top-level .safetensors weights (downloaded to {folder}); "
            "jaxserve loads safetensors checkpoints or a GGUF file named as org/name/FILE.gguf")


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else ""
