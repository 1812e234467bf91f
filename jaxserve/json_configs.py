"""The JSON-valued engine sub-configs (vLLM's `--speculative-config`, `--structured-outputs-config`,
`--kv-events-config`): frozen dataclasses built from a dict (`from_dict`, unknown keys refused
naming the flag) and validated once. Host side: never imports jax. `jaxserve.config` re-exports
them with the rest of the engine's configuration.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys. `method`: "ngram" (prompt lookup), "suffix" (suffix
    trie over the request's tokens and, with suffix_cache_requests > 0, earlier outputs) or
    "draft_model" (`model`: a smaller model sharing the target's tokenizer proposes greedily;
    giving `model` without `method` means "draft_model"), "eagle3" (`model`: an EAGLE-3 head
    directory for this target, `models/eagle3.py`) or "mtp" (DeepSeek V3/R1's multi-token
    prediction layer, `models/mtp.py`: `model` defaults to the target's checkpoint; vLLM's older
    name "deepseek_mtp" is taken as "mtp").
    Opt-out: no drafts for a request whose prompt is longer than `max_prompt_len` or while the
    running batch has `disable_by_batch_size` requests or more."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None
    max_prompt_len: int | None = 4096
    suffix_max_depth: int = 16
    suffix_min_count: int = 1
    suffix_cache_requests: int = 0
    # Adaptive opt-out: pause a request's drafts while fewer than this many are accepted per
    # verification (moving average); 0 = never pause.
    min_expected_accepted: float = 0.5
    # The draft's path: a Hugging Face directory or a .gguf file (method "draft_model"), an
    # EAGLE-3 head directory (method "eagle3"), the checkpoint holding the MTP layer (method
    # "mtp"; default the target's); a Hub name is resolved by the engine.
    model: str | None = None
    # vLLM's key: the devices the draft runs on. jaxserve runs an EAGLE-3 head whole on every
    # tensor-parallel device (1 means that) and a draft model split like the target.
    draft_tensor_parallel_size: int | None = None

    METHODS = ("ngram", "suffix", "draft_model", "eagle3", "mtp")
    MODEL_METHODS = ("draft_model", "eagle3", "mtp")     # the methods whose drafts a model computes
    MODEL_REQUIRED = ("draft_model", "eagle3")    # "mtp" defaults to the target's checkpoint
    ALIASES = {"deepseek_mtp": "mtp"}     # vLLM's older names

    @classmethod
    def from_dict(cls, d: dict | None) -> SpeculativeConfig | None:
        if not d:
            return None
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        if d.get("model") is not None and "method" not in d:
            d = {**d, "method": "draft_model"}      # vLLM: a model alone means a draft model
        if d.get("method") in cls.ALIASES:
            d = {**d, "method": cls.ALIASES[d["method"]]}
        if d.get("method") == "mtp" and "num_speculative_tokens" not in d:
            # vLLM's default for MTP: the checkpoint's num_nextn_predict_layers, 1 on V3 / R1
            d = {**d, "num_speculative_tokens": 1}
        if d.get("method", "ngram") not in cls.METHODS:    # before the keys: an unknown method has its own
            raise ValueError(f"speculative_config.method must be one of {', '.join(cls.METHODS)}, got "
                             f"{d['method']!r}")
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; allowed: "
                             f"{sorted(names)}")
        if "method" not in d:
            raise ValueError("speculative_config.method is required: one of "
                             f"{', '.join(cls.METHODS)}")
        return cls(**d)

    def __post_init__(self):
        if self.method in self.ALIASES:
            object.__setattr__(self, "method", self.ALIASES[self.method])
        if self.method not in self.METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(self.METHODS)}"
                             f", got {self.method!r}")
        for name, lo in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1),
                         ("prompt_lookup_max", 1), ("suffix_max_depth", 1),
                         ("suffix_min_count", 1), ("suffix_cache_requests", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"speculative_config.{name} must be an int >= {lo}, got {v!r}")
        if self.num_speculative_tokens > 16:
            raise ValueError("speculative_config.num_speculative_tokens must be <= 16, got "
                             f"{self.num_speculative_tokens}")
        if (self.method in self.MODEL_REQUIRED and self.model is None
                or self.method not in self.MODEL_METHODS and self.model is not None):
            raise ValueError("speculative_config.model (a draft model or EAGLE-3 head path) is "
                             "required with methods 'draft_model' and 'eagle3' and only allowed "
                             f"with them and 'mtp', got method {self.method!r} and model {self.model!r}")
        v = self.draft_tensor_parallel_size
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"speculative_config.draft_tensor_parallel_size must be an int >= 1, got {v!r}")
        if self.model is not None and not isinstance(self.model, str | os.PathLike):
            raise ValueError(f"speculative_config.model must be a path, got {self.model!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        v = self.min_expected_accepted
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= \
                self.num_speculative_tokens:
            raise ValueError("speculative_config.min_expected_accepted must be a number in "
                             f"[0, num_speculative_tokens], got {v!r}")
        for name in ("disable_by_batch_size", "max_prompt_len"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"speculative_config.{name} must be None or an int >= 1, "
                                 f"got {v!r}")


def _from_dict(cls, d: dict | None, key: str):
    """A JSON sub-config (`--structured-outputs-config`, `--kv-events-config`) as `cls`, its keys
    checked (ValueError naming `key`); None gives the defaults."""
    if d is None:
        return cls()
    if not isinstance(d, dict):
        raise ValueError(f"{key} must be a dict, got {type(d).__name__}")
    names = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise ValueError(f"{key} has unknown key(s) {unknown}; allowed: {names}")
    return cls(**d)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's `structured_outputs_config` keys that apply here: the JSON whitespace rule for
    requests that set none. `disable_any_whitespace`: no whitespace between JSON tokens;
    `whitespace_pattern` (jaxserve's; the request field's name): the regex of the whitespace
    allowed between two tokens, e.g. "[\\x20\\x0A\\x0D\\x09]+" for vLLM's unbounded default;
    None: one space or a line break and bounded indentation (structured_output/grammar.py).
    `backend` is accepted as vLLM spells it; llguidance ("guidance") is the only one."""

    backend: str = "auto"
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> StructuredOutputsConfig:
        return _from_dict(cls, d, "structured_outputs_config")

    def __post_init__(self):
        if self.backend not in ("auto", "guidance"):
            raise ValueError("structured_outputs_config.backend must be 'auto' or 'guidance' "
                             f"(llguidance), got {self.backend!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs_config.disable_any_whitespace must be a bool, "
                             f"got {self.disable_any_whitespace!r}")
        if self.whitespace_pattern is not None and (not isinstance(self.whitespace_pattern, str)
                                                    or not self.whitespace_pattern):
            raise ValueError("structured_outputs_config.whitespace_pattern must be a non-empty "
                             f"regex string, got {self.whitespace_pattern!r}")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `kv_events_config` (`--kv-events-config`): KV-cache events (`core/kv_events.py`)
    published over ZeroMQ for an external indexer (llm-d's KV-cache manager, a prefix-aware
    router). `publisher`: "zmq" or "null" (default "zmq" when enabled). `endpoint`: the PUB
    socket (bound when it holds "*", "::", "ipc://" or "inproc://", else connected);
    `replay_endpoint`: a ROUTER socket that resends buffered batches from a sequence number;
    `buffer_steps`: batches kept for replay; `hwm`: the PUB socket's high-water mark;
    `max_queue_size`: batches waiting for the sending thread (beyond it the newest are dropped,
    with a warning); `topic`: the first frame of each message. jaxserve's own key `wire`: "map"
    (events as msgpack maps tagged with their type, what newer vLLM sends) or "array" (the
    positional form older vLLM sends)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    wire: str = "map"

    @classmethod
    def from_dict(cls, d: dict | None) -> KVEventsConfig:
        return _from_dict(cls, d, "kv_events_config")

    def __post_init__(self):
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be a bool, got "
                             f"{self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config.{name} must be a string, got {getattr(self, name)!r}")
        if self.publisher == "zmq" and not self.endpoint:
            raise ValueError("kv_events_config.endpoint must name a ZeroMQ endpoint, e.g. 'tcp://*:5557'")
        if self.replay_endpoint is not None and (not isinstance(self.replay_endpoint, str)
                                                 or not self.replay_endpoint):
            raise ValueError("kv_events_config.replay_endpoint must be None or a ZeroMQ endpoint, "
                             f"got {self.replay_endpoint!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"kv_events_config.{name} must be an int >= 1, got {v!r}")
        if self.wire not in ("map", "array"):
            raise ValueError(f"kv_events_config.wire must be 'map' or 'array', got {self.wire!r}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"
