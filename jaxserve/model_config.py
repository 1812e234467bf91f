"""`ModelConfig`: the network as the engine sees it, read from a Hugging Face `config.json`
(`ModelConfig.from_hf`: the common decoder fields here, each family's own in
`jaxserve.model_config_hf`) or GGUF metadata, with its rope scaling read and checked. The MoE and
MLA block configs (`MoeConfig`, `DeepseekMoeConfig`, `MlaConfig`) live in
`jaxserve.model_config_blocks` and are re-exported here. Host side: never imports jax.
(`jaxserve.config` re-exports these beside the engine's other configuration.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxserve.model_config_blocks import DeepseekMoeConfig, MlaConfig, MoeConfig  # noqa: F401  (re-exported)
from jaxserve.model_config_hf import family_defaults, family_fields
from jaxserve.models.registry import check_architecture

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder of one of the registered families, independent of where its
    weights come from. Family-specific fields (q/k norm, qkv bias, sliding window, `moe`) are
    read from config.json by that family's parser (`model_config_hf.family_fields`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Normalised rope scaling: None or {"rope_type": ..., "factor": ..., ...}.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False          # per-head RMSNorm on q and k before rope (Qwen3)
    sliding_window: int | None = None
    moe: MoeConfig | None = None   # sparse MLP (Qwen3-MoE, Mixtral); None: dense MLP
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 2/3: the gated MLP's activation, per-layer attention kinds ("sliding_attention" uses
    # sliding_window, "full_attention" none; None: every layer as sliding_window says), the
    # attention scale 1/sqrt(query_pre_attn_scalar) (None: 1/sqrt(head_dim)), tanh soft caps of
    # the attention scores and of the final logits, and (Gemma 3) the sliding layers' own rope
    # base, unscaled (rope_theta and rope_scaling are the global layers').
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    partial_rotary_factor: float = 1.0   # rope turns the first head_dim * this dims (Phi-4-mini)
    attention_sinks: bool = False  # a learned logit per head in every softmax denominator (gpt-oss)
    # The longest context served (the engine's max_model_len; None: derived_max_model_len).
    # LongRoPE picks its short or long factors by it, once (vLLM's rule; layers/rotary.py).
    max_model_len: int | None = None
    # DeepSeek V2/V3: multi-head latent attention. The KV cache then holds one latent "head" per
    # token (num_kv_heads 1, head_dim kv_lora_rank + qk_rope_head_dim), no separate values.
    mla: MlaConfig | None = None

    def __post_init__(self):
        check_architecture(self.architecture)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"model config field {name} must be a positive integer, "
                                 f"got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_scaling is not None:
            _check_rope_scaling(dict(self.rope_scaling))
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {', '.join(HIDDEN_ACTS)}, got {self.hidden_act!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise ValueError(f"layer_types must name one of {', '.join(LAYER_TYPES)} for each of the "
                                 f"{self.num_layers} layers, got {list(self.layer_types)}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "rope_local_theta"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"model config field {name} must be a positive number or null, got {v!r}")
        scaling = self.rope_scaling_dict or {}
        if scaling.get("rope_type") == "longrope":
            half = int(self.head_dim * self.partial_rotary_factor) // 2
            for name in ("short_factor", "long_factor"):
                if len(scaling[name]) != half:
                    raise ValueError(f"rope_scaling.{name} must have one factor per rotary dim pair ({half}), "
                                     f"got {len(scaling[name])}")
        if not 0 < self.partial_rotary_factor <= 1 or int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ValueError(f"partial_rotary_factor must be in (0, 1] and turn an even number of the "
                             f"{self.head_dim} head dims, got {self.partial_rotary_factor}")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: global attention)."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def derived_max_model_len(self) -> int:
        """The longest context the model takes (vLLM's `_get_and_verify_max_len`):
        max_position_embeddings, times the factor for linear and dynamic NTK rope scaling (the
        dynamic fixed base is made for that length); for YaRN original_max_position_embeddings
        times the factor (Qwen3: 32768 x 4)."""
        scaling = self.rope_scaling_dict or {}
        if scaling.get("rope_type") in ("linear", "dynamic"):
            return int(self.max_position_embeddings * float(scaling["factor"]))
        if scaling.get("rope_type") == "yarn":
            return int(scaling["original_max_position_embeddings"] * float(scaling["factor"]))
        return self.max_position_embeddings

    def resolve_max_model_len(self, requested: int | None) -> int:
        """--max-model-len (None: the model's own) checked against derived_max_model_len."""
        limit = self.derived_max_model_len
        if requested is None:
            return limit
        if requested > limit:
            yarn = (self.rope_scaling_dict or {}).get("rope_type") == "yarn"
            raise ValueError(f"max_model_len ({requested}) is larger than the model's "
                             + (f"rope_scaling.original_max_position_embeddings x rope_scaling.factor ({limit})"
                                if yarn else f"max_position_embeddings ({self.max_position_embeddings})"
                                + (f" x rope_scaling.factor ({limit})" if limit != self.max_position_embeddings
                                   else "")))
        return requested

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (transformers 4.x or 5.x layout)."""
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' field; cannot tell which model "
                             "this is")
        arch = archs[0]
        check_architecture(arch)
        text = hf.get("text_config") or hf
        text = {**family_defaults(arch), **text}
        try:
            hidden = int(text["hidden_size"])
            num_heads = int(text["num_attention_heads"])
            cfg = dict(
                vocab_size=int(text["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(text["intermediate_size"]),
                num_layers=int(text["num_hidden_layers"]),
                num_heads=num_heads,
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing the required field {e.args[0]!r}") from None
        num_kv = text.get("num_key_value_heads") or num_heads
        head_dim = text.get("head_dim") or hidden // num_heads
        theta, scaling = _rope_from_hf(text, int(text.get("max_position_embeddings", 2048)))
        eos = text.get("eos_token_id", hf.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        try:
            family = family_fields(arch, text)
        except KeyError as e:
            raise ValueError(f"config.json is missing the required field {e.args[0]!r}") from None
        # a family's parser may replace a common field (DeepSeek's MLA: one latent "head")
        return cls(**{**dict(
            architecture=arch,
            num_kv_heads=int(num_kv),
            head_dim=int(head_dim),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(text.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings",
                                            text.get("tie_word_embeddings", False))),
            bos_token_id=text.get("bos_token_id", hf.get("bos_token_id")),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            **cfg), **family})


def _rope_from_hf(text: dict[str, Any], max_position_embeddings: int = 2048
                  ) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """Read rope settings from either `rope_parameters` (transformers 5) or
    `rope_theta` + `rope_scaling` (older files). YaRN's original_max_position_embeddings defaults
    to max_position_embeddings and its factor to their ratio, as transformers fills them."""
    params = text.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]     # Gemma 3 in transformers 5: the global layers' rope
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", text.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(text.get("rope_theta", 10000.0))
        scaling = dict(text.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    scaling.pop("partial_rotary_factor", None)      # a ModelConfig field of its own
    if scaling.get("rope_type") == "su":             # LongRoPE's first name (Phi-3 configs)
        scaling["rope_type"] = "longrope"
    if scaling.get("rope_type") == "longrope":       # older files keep L0 beside the scaling
        scaling.setdefault("original_max_position_embeddings", text.get("original_max_position_embeddings"))
    if scaling.get("rope_type") == "yarn":
        scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
        if scaling.get("factor") is None and isinstance(scaling["original_max_position_embeddings"], int):
            scaling["factor"] = max_position_embeddings / scaling["original_max_position_embeddings"]
    _check_rope_scaling(scaling)
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    # lists (LongRoPE's factors) as tuples: the config stays hashable
    return theta, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))


def _check_rope_scaling(scaling: dict[str, Any]) -> None:
    """A ValueError naming the field when jaxserve cannot apply these rope settings."""
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type {rope_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            f = scaling.get(name)
            if not isinstance(f, (list, tuple)) or not f or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in f):
                raise ValueError(f"rope_scaling.{name} must be a list of positive numbers for rope_type "
                                 f"'longrope', got {f!r}")
        original = scaling.get("original_max_position_embeddings")
        if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
            raise ValueError("rope_scaling.original_max_position_embeddings (or the config's "
                             f"original_max_position_embeddings) must be a positive int, got {original!r}")
    if rope_type in ("linear", "llama3", "dynamic", "yarn"):
        factor = scaling.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"rope_scaling.factor must be a positive number for rope_type "
                             f"{rope_type!r}, got {factor!r}")
    if rope_type == "yarn":
        original = scaling.get("original_max_position_embeddings")
        if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
            raise ValueError("rope_scaling.original_max_position_embeddings must be a positive integer "
                             f"for rope_type 'yarn', got {original!r}")
        for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
            value = scaling.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"rope_scaling.{key} must be a number, got {value!r}")
