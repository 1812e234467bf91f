"""DeepSeek V2 / V3 GGUF files (llama.cpp's `deepseek2`, jaxserve/loader/gguf_families.py).

Two tiny random transformers checkpoints (transformers' own config classes, every parameter and
V3's routing bias randomised) are saved with save_pretrained and their safetensors written to a
GGUF file as llama.cpp's converter (convert_hf_to_gguf.py, DeepseekV2Model) writes them:
  - "v2-lite": no q_lora_rank (attn_q), softmax greedy routing without renormalisation,
    routed_scaling_factor, a shared expert, a dense first layer, plain rope;
  - "v3": q_lora (attn_q_a, attn_q_a_norm, attn_q_b), sigmoid routing with the correction bias
    (exp_probs_b.bias) in noaux_tc groups (expert_group_count / _used_count), renormalised top-k,
    a dense first layer, YaRN with mscale = mscale_all_dim (yarn_log_multiplier 0.1 * that);
each in the two layouts converters have written:
  - "kv_b": older converters: attn_kv_b whole, key_length / value_length the per-head sizes,
    head_count_kv the head count (and, for V2, no expert_gating_func: softmax by default);
  - "k_b_v_b": newer ones: kv_b split per head into attn_k_b (transposed) and attn_v_b,
    head_count_kv 1, key_length / value_length kv_lora_rank + rope dims / kv_lora_rank, the
    per-head sizes as key_length_mla / value_length_mla.
Experts stacked into ffn_{gate,up,down}_exps, shared experts ffn_*_shexp, rope dims not permuted.
jaxserve reads each to the checkpoint's config and to transformers' prompt logprobs (< 1e-3, f32).
Q8_0 experts (and other Q8_0 matrices) read as the values their blocks hold, each expert's
blocks sliced from the stacked tensor. Files without the optional keys follow llama.cpp's defaults
(softmax, ungrouped, no YaRN scaling of the scores); a deepseek2 file without a required key is
refused naming it.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from helpers_paged import PagedRunner, prefill_logprobs  # noqa: E402
from helpers_paged import hf_logprobs as _hf_logprobs  # noqa: E402

from jaxserve.loader.loader import ModelLoadError, load_model  # noqa: E402

VOCAB = 96
LOGPROB_ATOL = 1e-3
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
             num_experts_per_tok=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
             max_position_embeddings=512, first_k_dense_replace=1, attn_implementation="eager")
FAMILIES = {
    "v2-lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        _BASE, q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.5,
        norm_topk_prob=False)),
    "v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        _BASE, q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, mscale=0.707,
                             mscale_all_dim=0.707, beta_fast=32, beta_slow=1, rope_theta=10000.0))),
}
PROMPT = np.random.default_rng(0).integers(3, VOCAB, size=48).tolist()


def _checkpoint(path: Path, name: str, seed: int = 0):
    """(transformers model, config, its saved tensors by checkpoint name)."""
    config_class, model_class, kwargs = FAMILIES[name]
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in pname else 0.1 * torch.randn_like(p))
        for bname, b in model.named_buffers():
            if "e_score_correction_bias" in bname:
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(path, safe_serialization=True)
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(safetensors_numpy.load_file(str(f)))
    return model, config, tensors


def _header(w, c, name: str, layout: str) -> None:
    """deepseek2 metadata as llama.cpp's converter writes it from transformers config `c`."""
    v3, split = name == "v3", layout == "k_b_v_b"
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(1 if split else c.num_key_value_heads)      # MLA as MQA in newer converters
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_used_count(c.num_experts_per_tok)
    if v3 or split:
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_vocab_size(c.vocab_size)
    if c.q_lora_rank is not None:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    if split:
        w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        w.add_value_length(c.kv_lora_rank)
        w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_value_length_mla(c.v_head_dim)
    else:
        w.add_key_length(c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_value_length(c.v_head_dim)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if c.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    rope = c.rope_parameters
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if split:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _converted(tensors: dict[str, np.ndarray], c, layout: str):
    """(name, array) as llama.cpp's converter hands them to its name map: each layer's experts
    stacked, kv_b_proj split per head (k_b transposed) in the newer layout, the correction bias
    renamed to e_score_correction.bias."""
    H, dn, dv = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
    for name, p in tensors.items():
        expert = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name)
        if expert:
            layer, x, proj = expert.groups()
            if x == "0" and proj == "gate_proj":       # the layer's experts, once
                for w_name in ("down_proj", "gate_proj", "up_proj"):
                    stacked = np.stack([tensors[f"model.layers.{layer}.mlp.experts.{x}.{w_name}.weight"]
                                        for x in range(c.n_routed_experts)])
                    yield f"model.layers.{layer}.mlp.experts.{w_name}.weight", stacked
        elif name.endswith("e_score_correction_bias"):
            yield name.replace("e_score_correction_bias", "e_score_correction.bias"), p
        elif name.endswith("kv_b_proj.weight") and layout == "k_b_v_b":
            kv_b = p.reshape(H, dn + dv, p.shape[-1])
            yield name.replace("kv_b_proj", "k_b_proj"), np.ascontiguousarray(kv_b[:, :dn].swapaxes(1, 2))
            yield name.replace("kv_b_proj", "v_b_proj"), np.ascontiguousarray(kv_b[:, dn:])
        else:
            yield name, p


def write_gguf(path: Path, tensors: dict[str, np.ndarray], c, name: str, layout: str, quantize: str = "F32") -> Path:
    """`quantize`: "Q8_0" stores the matrices whose rows are whole Q8_0 blocks (the embedding
    aside) so, "Q8_0-F32" as f32 values that went through Q8_0."""
    w = gguf.GGUFWriter(str(path), "deepseek2")
    q8 = gguf.GGMLQuantizationType.Q8_0
    _header(w, c, name, layout)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, c.num_hidden_layers)
    for hf_name, p in _converted(tensors, c, layout):
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, hf_name
        data = np.asarray(p, np.float32)
        if quantize != "F32" and data.ndim >= 2 and data.shape[-1] % 32 == 0 and gname != "token_embd.weight":
            raw = gguf.quants.quantize(data, q8)
            if quantize == "Q8_0":
                w.add_tensor(gname, raw, raw_dtype=q8)
                continue
            data = gguf.quants.dequantize(raw, q8)
        w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("layout", ["kv_b", "k_b_v_b"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_deepseek2_gguf_gives_the_checkpoints_config_and_transformers_logprobs(name, layout, tmp_path):
    model, c, tensors = _checkpoint(tmp_path, name)
    path = write_gguf(tmp_path / f"{name}.gguf", tensors, c, name, layout)
    gnames = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert ("blk.1.attn_k_b.weight" in gnames) == (layout == "k_b_v_b") != ("blk.1.attn_kv_b.weight" in gnames)
    assert ("blk.0.attn_q.weight" in gnames) == (name == "v2-lite") and "blk.1.ffn_gate_exps.weight" in gnames
    cfg, weights = load_model(path, "float32")
    want_cfg, _ = load_model(tmp_path, "float32", load_format="dummy")
    got, want = dataclasses.asdict(cfg), dataclasses.asdict(want_cfg)
    for d in (got, want):      # the GGUF has no tokenizer; its floats are f32; YaRN's betas default to 32 / 1
        d.pop("bos_token_id"), d.pop("eos_token_ids")
        d["rms_norm_eps"] = float(np.float32(d["rms_norm_eps"]))
        d["moe"]["routed_scaling_factor"] = float(np.float32(d["moe"]["routed_scaling_factor"]))
        d["rope_scaling"] = {k: round(v, 5) if isinstance(v, float) else v for k, v in (d["rope_scaling"] or ())
                             if (k, v) not in (("beta_fast", 32), ("beta_slow", 1))}
    assert got == want
    runner = PagedRunner(cfg, weights, block_size=16, num_blocks=8, max_blocks_per_seq=4)
    lps = prefill_logprobs(runner, PROMPT)
    ref = _hf_logprobs(model, PROMPT)
    assert ref.std() > 0.3
    diff = float(np.abs(lps - ref).max())
    print(f"{name} {layout}: max |logprob diff| GGUF vs transformers {diff:.2e}")
    assert diff < LOGPROB_ATOL


def test_deepseek2_q8_0_experts_read_as_their_values(tmp_path):
    _, c, tensors = _checkpoint(tmp_path, "v3")
    logits = {}
    for kind in ("Q8_0", "Q8_0-F32"):
        path = write_gguf(tmp_path / f"{kind}.gguf", tensors, c, "v3", "k_b_v_b", quantize=kind)
        for quantization in ("gguf", "none") if kind == "Q8_0" else ("none",):
            cfg, weights = load_model(path, "float32", quantization=quantization)
            runner = PagedRunner(cfg, weights, block_size=16, num_blocks=8, max_blocks_per_seq=4)
            logits[kind, quantization] = runner.prefill_logits(PROMPT)
    assert {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "Q8_0.gguf")).tensors}[
        "blk.1.ffn_gate_exps.weight"] == "Q8_0"
    for key in (("Q8_0", "gguf"), ("Q8_0", "none")):
        np.testing.assert_allclose(logits[key], logits["Q8_0-F32", "none"], rtol=1e-5, atol=1e-5)


def test_deepseek2_gguf_without_a_required_key_is_refused_naming_it(tmp_path):
    _, c, tensors = _checkpoint(tmp_path, "v2-lite")
    path = write_gguf(tmp_path / "full.gguf", tensors, c, "v2-lite", "k_b_v_b")
    reader = gguf.GGUFReader(str(path))
    for key in ("deepseek2.attention.kv_lora_rank", "deepseek2.leading_dense_block_count",
                "deepseek2.attention.key_length_mla"):
        w = gguf.GGUFWriter(str(tmp_path / "cut.gguf"), "deepseek2")
        for field in reader.fields.values():
            if field.name in (key, "general.architecture") or field.name.startswith("GGUF."):
                continue
            w.add_key_value(field.name, field.contents(), field.types[0],
                            sub_type=field.types[-1] if len(field.types) > 1 else None)
        for t in reader.tensors:
            w.add_tensor(t.name, np.asarray(t.data))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(ModelLoadError, match=key.replace(".", r"\.")):
            load_model(tmp_path / "cut.gguf", "float32")


def _metadata_only(path: Path, **keys) -> Path:
    """A deepseek2 file of V2's attention shape, `keys` (add_* name -> value) added, one tensor."""
    w = gguf.GGUFWriter(str(path), "deepseek2")
    for key, value in dict(block_count=4, embedding_length=64, feed_forward_length=96, head_count=4, vocab_size=16,
                           rope_dimension_count=8, kv_lora_rank=32, key_length=24, value_length=12,
                           leading_dense_block_count=1, expert_count=8, expert_used_count=2,
                           expert_feed_forward_length=32, expert_shared_count=2, **keys).items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_deepseek2_defaults_follow_llama_cpp(tmp_path):
    from jaxserve.loader.loader import gguf_config_of
    # no gating function, groups, scale or norm: V2's softmax, greedy over all experts, weights as they are
    cfg = gguf_config_of(_metadata_only(tmp_path / "a.gguf", rope_scaling_type=gguf.RopeScalingType.YARN,
                                        rope_scaling_factor=4.0, rope_scaling_orig_ctx_len=128))
    assert cfg.architecture == "DeepseekV2ForCausalLM" and cfg.mla.q_lora_rank is None
    assert (cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim, cfg.num_kv_heads) == (16, 8, 12, 1)
    m = cfg.moe
    assert (m.scoring_func, m.topk_method, m.n_group, m.routed_scaling_factor, m.norm_topk_prob) == (
        "softmax", "greedy", 1, 1.0, False)
    assert (m.first_k_dense_replace, m.n_shared_experts) == (1, 2)
    # no yarn_log_multiplier: neither the scores nor cos / sin scaled
    assert dict(cfg.rope_scaling)["attention_factor"] == 1.0 and "mscale_all_dim" not in dict(cfg.rope_scaling)
    cfg = gguf_config_of(_metadata_only(tmp_path / "b.gguf", expert_gating_func=gguf.ExpertGatingFuncType.SIGMOID,
                                        expert_group_count=4, expert_group_used_count=2, q_lora_rank=24))
    assert cfg.architecture == "DeepseekV3ForCausalLM" and cfg.mla.q_lora_rank == 24
    m = cfg.moe
    assert (m.scoring_func, m.topk_method, m.n_group, m.topk_group) == ("sigmoid", "noaux_tc", 4, 2)
    cfg = gguf_config_of(_metadata_only(tmp_path / "c.gguf", expert_group_count=4, expert_group_used_count=2))
    assert cfg.moe.topk_method == "group_limited_greedy"
