"""The configs of the blocks some families have in place of the dense MLP or plain attention:
`MoeConfig` (a sparse mixture-of-experts MLP: Qwen3-MoE, Mixtral, gpt-oss), `DeepseekMoeConfig`
(DeepSeek's grouped routing with shared experts) and `MlaConfig` (DeepSeek's multi-head latent
attention), each validated where it is built. `ModelConfig.moe` / `ModelConfig.mla` hold them and
the per-family config.json readers (`jaxserve.model_config_hf`) build them. Host side: never
imports jax. (`jaxserve.model_config` re-exports these.)"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeConfig:
    """A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): the router scores `num_experts`
    experts per token with a softmax, keeps the top `num_experts_per_tok`, and (when
    `norm_topk_prob`) renormalises the kept weights to sum to 1. Mixtral's "top-k, then softmax
    over the k logits" is exactly softmax -> top-k -> renormalise, so it is `norm_topk_prob=True`.
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # gpt-oss's experts: a router with a bias, experts with biases and the clamped SwiGLU
    # (up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g), g = gate.clamp(max=limit); None: SwiGLU
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None

    def __post_init__(self):
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "decoder_sparse_step"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"model config field {name} must be a positive integer, "
                                 f"got {getattr(self, name)!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                             f"num_experts ({self.num_experts})")
        if (self.swiglu_alpha is None) != (self.swiglu_limit is None) or not all(
                v is None or v > 0 for v in (self.swiglu_alpha, self.swiglu_limit)):
            raise ValueError(f"model config fields swiglu_alpha and swiglu_limit must both be positive numbers, "
                             f"got {self.swiglu_alpha!r} and {self.swiglu_limit!r}")
        if not all(isinstance(i, int) and i >= 0 for i in self.mlp_only_layers):
            raise ValueError(f"model config field mlp_only_layers must list layer indices >= 0, "
                             f"got {list(self.mlp_only_layers)}")

    def sparse_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers whose MLP is the mixture of experts; the others have a dense MLP of the
        model's intermediate_size. Transformers' rule (Qwen3-MoE, Qwen2-MoE): layer i is sparse
        unless listed in mlp_only_layers, and only every decoder_sparse_step-th layer is
        ((i + 1) % step == 0). Indices past the last layer are ignored, as transformers does."""
        return tuple(i for i in range(num_layers)
                     if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek's multi-head latent attention: q from the hidden state directly (q_lora_rank None,
    V2-Lite) or through a q_lora_rank-wide normed bottleneck; K and V of every head up-projected
    (kv_b) from one kv_lora_rank-wide normed latent per token, beside a qk_rope_head_dim-wide rope
    key shared by all heads. q.k covers qk_nope_head_dim + qk_rope_head_dim dims per head, values
    v_head_dim. `rope_interleave`: the rope dims are rotated in adjacent pairs (DeepSeek's layout)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"model config field {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ValueError(f"model config field q_lora_rank must be a positive integer or null, "
                             f"got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even for rotary embeddings, got {self.qk_rope_head_dim}")

    @property
    def latent_dim(self) -> int:
        """What the KV cache holds per token and layer: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


DEEPSEEK_ROUTING = {("softmax", "greedy"), ("softmax", "group_limited_greedy"), ("sigmoid", "noaux_tc")}


@dataclass(frozen=True)
class DeepseekMoeConfig(MoeConfig):
    """DeepSeek's MoE (V2: softmax scores, top-k greedy or within the best `topk_group` of
    `n_group` expert groups by their best score; V3: sigmoid scores plus a per-expert
    correction bias for the choice, groups ranked by the sum of their two best, "noaux_tc"),
    the kept weights (renormalised when `norm_topk_prob`) times `routed_scaling_factor`, plus
    `n_shared_experts` experts every token uses (one SwiGLU of that many times the experts'
    width). Layers before `first_k_dense_replace`, and those off every `moe_layer_freq`-th, are
    dense (vLLM's rule)."""

    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1

    def __post_init__(self):
        super().__post_init__()
        if (self.scoring_func, self.topk_method) not in DEEPSEEK_ROUTING:
            raise ValueError(f"scoring_func {self.scoring_func!r} with topk_method {self.topk_method!r} is not "
                             f"supported; supported: {sorted(DEEPSEEK_ROUTING)}")
        for name in ("n_group", "topk_group", "moe_layer_freq"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"model config field {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.topk_method != "greedy":
            if self.num_experts % self.n_group or self.topk_group > self.n_group:
                raise ValueError(f"n_group ({self.n_group}) must divide n_routed_experts ({self.num_experts}) "
                                 f"and topk_group ({self.topk_group}) be at most n_group")
            if self.topk_group * (self.num_experts // self.n_group) < self.num_experts_per_tok:
                raise ValueError(f"topk_group ({self.topk_group}) groups of {self.num_experts // self.n_group} "
                                 f"experts hold fewer than num_experts_per_tok ({self.num_experts_per_tok})")

    def sparse_layers(self, num_layers: int) -> tuple[int, ...]:
        return tuple(i for i in range(num_layers)
                     if i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0)
