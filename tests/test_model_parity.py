"""Model parity against Hugging Face transformers (CPU torch, f32), through the paged KV cache.

- The default model (SmolLM2-135M-Instruct GGUF): logits on a few prompts, and greedy tokens on
  16 prompts x 32 new tokens, prefilled whole, in chunks, and all prompts batched ragged.
- Tiny random Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral checkpoints written with
  `save_pretrained`, covering head_dim, GQA ratio, tied embeddings, rope scaling, qkv bias, q/k
  norm, sliding window, experts (top-k, norm_topk_prob on and off) and sharded safetensors:
  logits only (random models have near-tied logits, so no greedy tokens).
- config.json in the transformers-5 `rope_parameters` layout and the older `rope_scaling` layout
  parse to the same ModelConfig.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

# 5-10 minutes on 2 shared CPU cores (greedy decoding of the 135M default model with both
# transformers and jaxserve dominates); still in the default run.
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers_paged import PagedRunner  # noqa: E402

from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.default_model import default_model_path  # noqa: E402
from jaxserve.loader.loader import load_hf_config, load_model  # noqa: E402

# Default model: logits reach ~35 in magnitude; f32 on both sides measures ~7e-5.
DEFAULT_LOGIT_ATOL = 1e-3
# Tiny random models, f32 on both sides; logits are O(1) (checked, so the bound is not vacuous).
TINY_LOGIT_ATOL = 1e-4
# Greedy tokens may differ only where transformers' own top-2 logits are this close (a true tie).
TIE_GAP = 1e-3
NEW_TOKENS = 32
CHUNKED_TOKENS = 8       # the chunked-prefill schedules' greedy tokens

TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 5, 8, 13, 21,",
    "The quick brown fox",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "Photosynthesis is the process by which plants",
    "Q: What is 17 times 3?\nA:",
]
CHAT_PROMPTS = [
    "What is the tallest mountain in the world?",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a five-year-old.",
    "List three primary colors.",
    "Translate 'good morning' into Spanish.",
    "Hi!",
    "Give me a short tip for learning to cook, in one sentence, and explain why it helps beginners.",
    "What does HTTP stand for?",
]


def _default_path_or_skip():
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def default_path():
    return _default_path_or_skip()


@pytest.fixture(scope="module")
def jax_default(default_path):
    cfg, weights = load_model(default_path, "float32")
    return PagedRunner(cfg, weights, block_size=16, num_blocks=160, max_blocks_per_seq=8)


@pytest.fixture(scope="module")
def hf_default(default_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_path.parent), gguf_file=default_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompts(default_path):
    from jaxserve.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_path)
    ids = [tok.encode(t) for t in TEXT_PROMPTS]
    ids += [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True)
            for t in CHAT_PROMPTS]
    assert len(ids) == 16 and all(ids)
    return ids


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.fixture(scope="module")
def hf_greedy(hf_default, prompts):
    """transformers' greedy tokens, one prompt at a time, no padding."""
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            gen = hf_default.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                      max_new_tokens=NEW_TOKENS)
        out.append(gen[0, len(ids):].tolist())
    return out


def _check_greedy(hf_model, prompt, ref, got, eos_ids, new_tokens: int = NEW_TOKENS):
    """Same tokens, except that the comparison may end early at a genuine tie in transformers'
    logits. Returns the number of tokens compared."""
    assert len(got) == new_tokens
    if len(ref) < new_tokens:          # transformers stopped at EOS; jaxserve's loop does not
        assert ref[-1] in eos_ids, ref
    for i, (r, g) in enumerate(zip(ref, got)):
        if r != g:
            print(f"tie check at token {i}: transformers {r} jaxserve {g}")
            logits = _hf_logits(hf_model, prompt + ref[:i])[-1]
            gap = abs(float(logits[r]) - float(logits[g]))
            assert gap < TIE_GAP, (f"token {i} differs: transformers {r}, jaxserve {g}, logit gap "
                                   f"{gap:.2e} is not a tie; ref {ref} got {got}")
            return i
    return len(ref)


def _eos_ids(hf_model):
    eos = hf_model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


# --- default model -------------------------------------------------------------------------------


def test_default_model_logits_match_transformers(jax_default, hf_default, prompts):
    jax_default.reset()
    worst = 0.0
    for ids in prompts[:2] + prompts[8:10]:
        ref = _hf_logits(hf_default, ids)
        got = jax_default.prefill_logits(ids)
        assert got.shape == ref.shape
        assert np.abs(ref).max() > 10          # the tolerance below is relative to this scale
        worst = max(worst, float(np.abs(got - ref).max()))
        assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.95
    print(f"default model max |logit diff| = {worst:.2e}")
    assert worst <= DEFAULT_LOGIT_ATOL


def test_default_model_chunked_prefill_logits_match_whole_prefill(jax_default, prompts):
    jax_default.reset()
    ids = prompts[8]
    whole = jax_default.prefill_logits(ids)
    chunked = jax_default.prefill_logits(ids, chunk_sizes=(1, 3, 7, 16))
    # f32 rounding only: XLA:CPU blocks a dot by its row count, so chunks sum in another order
    # (largest difference 1.9e-4 on logits up to ~30 on an AVX2-only Zen 3, 2026-11-25; under
    # 1e-4 on the AVX-512 machines before). A wrong chunk boundary moves logits by whole units.
    np.testing.assert_allclose(chunked, whole, atol=5e-4, rtol=0)


def test_greedy_prefill_then_decode_matches_transformers(jax_default, hf_default, prompts,
                                                         hf_greedy):
    compared = 0
    for ids, ref in zip(prompts, hf_greedy):
        jax_default.reset()
        got = jax_default.generate(ids, NEW_TOKENS)
        compared += _check_greedy(hf_default, ids, ref, got, _eos_ids(hf_default))
    print(f"compared {compared} of {sum(map(len, hf_greedy))} greedy tokens")
    assert compared >= 0.9 * sum(map(len, hf_greedy))


@pytest.mark.parametrize("chunk_sizes,every", [((1, 3, 7, 16), 1), ((16, 7, 3, 1), 2)])
def test_greedy_with_chunked_prefill_matches_transformers(jax_default, hf_default, prompts,
                                                          hf_greedy, chunk_sizes, every):
    """Prefill in chunks of the given sizes (cycled); the second schedule checks every other
    prompt to keep the file's runtime down. The first CHUNKED_TOKENS greedy tokens: each attends
    to every prompt position, so K/V written at a wrong chunk boundary shows from the first one
    (the whole prefill's 32 are above; the chunks' logits equal the whole prefill's)."""
    compared = expected = 0
    for ids, ref in list(zip(prompts, hf_greedy))[::every]:
        jax_default.reset()
        ref = ref[:CHUNKED_TOKENS]
        got = jax_default.generate(ids, CHUNKED_TOKENS, chunk_sizes=chunk_sizes)
        compared += _check_greedy(hf_default, ids, ref, got, _eos_ids(hf_default), CHUNKED_TOKENS)
        expected += len(ref)
    assert compared >= 0.9 * expected


def test_greedy_all_prompts_batched_ragged_matches_transformers(jax_default, hf_default,
                                                                prompts, hf_greedy):
    jax_default.reset()
    outs = jax_default.generate_batched(prompts, NEW_TOKENS)
    compared = 0
    for ids, ref, got in zip(prompts, hf_greedy, outs):
        compared += _check_greedy(hf_default, ids, ref, got, _eos_ids(hf_default))
    assert compared >= 0.9 * sum(map(len, hf_greedy))


# --- tiny random checkpoints ---------------------------------------------------------------------

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
_LINEAR_ROPE = {"rope_type": "linear", "factor": 4.0}

# name -> (config class, config kwargs, save_pretrained max_shard_size or None)
TINY_MODELS = {
    "llama-mha-d32": ("LlamaConfig", dict(hidden_size=128, num_attention_heads=4,
                                           num_key_value_heads=4), None),
    "llama-gqa2-d64-tied": ("LlamaConfig", dict(hidden_size=256, num_attention_heads=4,
                                                 num_key_value_heads=2,
                                                 tie_word_embeddings=True), None),
    "llama-mqa-llama3-rope": ("LlamaConfig", dict(hidden_size=128, num_attention_heads=4,
                                                   num_key_value_heads=1, rope_theta=500000.0,
                                                   rope_scaling=_LLAMA3_ROPE), None),
    "llama-gqa4-linear-rope-sharded": ("LlamaConfig", dict(hidden_size=128,
                                                            num_attention_heads=8,
                                                            num_key_value_heads=2,
                                                            rope_scaling=_LINEAR_ROPE), "40KB"),
    "llama-head-dim-32-not-hidden-over-heads": ("LlamaConfig", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32), None),
    "mistral-sliding-window-8": ("MistralConfig", dict(hidden_size=128, num_attention_heads=4,
                                                       num_key_value_heads=2,
                                                       sliding_window=8), None),
    "qwen2-bias-gqa2-tied": ("Qwen2Config", dict(hidden_size=128, num_attention_heads=4,
                                                  num_key_value_heads=2,
                                                  tie_word_embeddings=True), None),
    "qwen2-bias-mqa-untied-sharded": ("Qwen2Config", dict(hidden_size=128,
                                                           num_attention_heads=4,
                                                           num_key_value_heads=1,
                                                           tie_word_embeddings=False), "30KB"),
    "qwen3-qk-norm-head-dim-64-tied": ("Qwen3Config", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        tie_word_embeddings=True), None),
    "qwen3-gqa4-linear-rope-untied": ("Qwen3Config", dict(
        hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
        tie_word_embeddings=False, rope_scaling=_LINEAR_ROPE), None),
    # mixture of experts: softmax router, top-k, with and without renormalising the kept weights
    "qwen3-moe-8-experts-top2-norm-topk": ("Qwen3MoeConfig", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True), None),
    "qwen3-moe-4-experts-top3-unnormed-sharded": ("Qwen3MoeConfig", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32, num_experts=4,
        num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=False,
        tie_word_embeddings=True), "40KB"),
    # dense and MoE MLPs mixed: layer 0 dense (mlp_only_layers), 1..3 sparse
    "qwen3-moe-mixed-mlp-only-layer-0": ("Qwen3MoeConfig", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        num_hidden_layers=4, mlp_only_layers=[0], intermediate_size=80), None),
    "mixtral-8-experts-top2-gqa2": ("MixtralConfig", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2), None),
}

_MODEL_CLASSES = {"LlamaConfig": "LlamaForCausalLM", "MistralConfig": "MistralForCausalLM",
                  "Qwen2Config": "Qwen2ForCausalLM", "Qwen3Config": "Qwen3ForCausalLM",
                  "Qwen3MoeConfig": "Qwen3MoeForCausalLM", "MixtralConfig": "MixtralForCausalLM"}


def build_tiny_checkpoint(path, config_class: str, kwargs: dict, max_shard_size=None, seed=0):
    """A random 2-layer model saved with save_pretrained; returns the torch model (f32, eval).

    transformers initialises norms to 1 and biases to 0, which would hide a missing or misplaced
    norm/bias, so every parameter is randomised here."""
    kwargs = dict(kwargs)
    rope = kwargs.pop("rope_scaling", None)
    theta = kwargs.pop("rope_theta", 10000.0)
    params = dict(rope or {"rope_type": "default"}, rope_theta=theta)
    config = getattr(transformers, config_class)(**dict(dict(
        vocab_size=96, intermediate_size=192, num_hidden_layers=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_parameters=params), **kwargs))
    torch.manual_seed(seed)
    model = getattr(transformers, _MODEL_CLASSES[config_class])(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    save = {"safe_serialization": True}
    if max_shard_size:
        save["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **save)
    return model


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tiny_random_checkpoint_logits_match_transformers(tmp_path, name):
    config_class, kwargs, shard = TINY_MODELS[name]
    model = build_tiny_checkpoint(tmp_path, config_class, kwargs, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 2
    cfg, weights = load_model(tmp_path, "float32")
    assert cfg.architecture == _MODEL_CLASSES[config_class]
    assert (weights.lm_head is None) == bool(kwargs.get("tie_word_embeddings", False))
    ids = np.random.default_rng(1).integers(0, 96, size=24).tolist()
    ref = _hf_logits(model, ids)
    assert ref.std() > 0.3          # O(1) logits, so TINY_LOGIT_ATOL is a tight bound

    runner = PagedRunner(cfg, weights, block_size=4, num_blocks=32, max_blocks_per_seq=8)
    got = runner.prefill_logits(ids)
    diff = float(np.abs(got - ref).max())
    print(f"{name}: max |logit diff| {diff:.2e} (logit std {ref.std():.2f})")
    assert diff <= TINY_LOGIT_ATOL
    # Chunked prefill through a cache with small blocks: chunks straddle block boundaries.
    got = runner.prefill_logits(ids, chunk_sizes=(5, 1, 7))
    assert float(np.abs(got - ref).max()) <= TINY_LOGIT_ATOL


# --- config.json layouts -------------------------------------------------------------------------

_BASE_HF = {"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 128,
            "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5}


@pytest.mark.parametrize("rope", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
], ids=["default", "linear", "llama3"])
def test_rope_parameters_and_rope_scaling_layouts_parse_the_same(tmp_path, rope):
    old = dict(_BASE_HF, rope_theta=500000.0)
    if rope:   # the oldest files spell rope_type as "type"
        old["rope_scaling"] = {("type" if k == "rope_type" and v == "linear" else k): v
                               for k, v in rope.items()}
    new = dict(_BASE_HF, rope_parameters=dict(rope or {"rope_type": "default"},
                                              rope_theta=500000.0))
    a, b = ModelConfig.from_hf(old), ModelConfig.from_hf(new)
    assert a == b
    assert a.rope_theta == 500000.0
    assert a.rope_scaling_dict == (dict(rope) if rope else None)
    (tmp_path / "config.json").write_text(json.dumps(new))
    assert load_hf_config(tmp_path) == a


def test_config_written_by_installed_transformers_parses_like_hand_written_old_layout(tmp_path):
    build_tiny_checkpoint(tmp_path, "LlamaConfig",
                          dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                               rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE))
    old = dict(_BASE_HF, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, bos_token_id=1,
               eos_token_id=2, tie_word_embeddings=False)
    written = load_hf_config(tmp_path)
    assert written == ModelConfig.from_hf(old)
