"""GGUF files of Gemma 2, Gemma 3 (text), Phi-3 and gpt-oss (jaxserve/loader/gguf_families.py).

Each family's tiny random checkpoint (tests/test_families.py) is written to a GGUF file as
llama.cpp's converter writes it: tensor names from the gguf package's own map
(`gguf.get_tensor_name_map`), f32 tensors, Gemma's norm weights stored as w + 1, q/k rows not
permuted, Phi-3's fused attn_qkv / ffn_up and its LongRoPE factor tensors, gpt-oss's experts
split and transposed (and MXFP4, as its released files are). jaxserve reads it to
the checkpoint's config and to transformers' logprobs (< 1e-3) on a 300-token prompt.
Metadata llama.cpp's converter does not write but these checkpoints need is written where the
gguf package has a key for it (attention.scale, sliding_window_pattern, rope.freq_base_swa);
`test_gemma_defaults_follow_llama_cpp` covers files without those keys.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from helpers_paged import PagedRunner, prefill_logprobs  # noqa: E402
from helpers_paged import hf_logprobs as _hf_logprobs  # noqa: E402
from test_families import FAMILIES, LOGPROB_ATOL, PROMPTS, write_checkpoint  # noqa: E402

from jaxserve.loader.loader import ModelLoadError, load_model  # noqa: E402

GGUF_ARCH = {"gemma2": "gemma2", "gemma3": "gemma3", "phi4-mini-longrope": "phi3", "gpt-oss": "gpt-oss"}


def _header(w, c, arch: str) -> None:
    """The metadata llama.cpp's converter writes for `arch` from transformers config `c`."""
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if arch.startswith("gemma"):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_sliding_window(c.sliding_window)
        if c.final_logit_softcapping is not None:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_attention_scale(1.0 / math.sqrt(c.query_pre_attn_scalar))
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if arch == "gemma3":
        rope = c.rope_parameters
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    if arch == "gpt-oss":
        rope = c.rope_parameters
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_expert_count(c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_sliding_window(c.sliding_window)
        w.add_expert_feed_forward_length(c.intermediate_size)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_float32("gpt-oss.swiglu_clamp_exp", c.swiglu_limit)    # llama.cpp's key; its converter keeps 7.0
    if arch == "phi3":
        rope = c.rope_parameters if getattr(c, "rope_parameters", None) else c.rope_scaling
        original = c.original_max_position_embeddings
        w.add_rope_dimension_count(int(c.partial_rotary_factor * c.hidden_size) // c.num_attention_heads)
        w.add_rope_freq_base(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_sliding_window(c.sliding_window or 0)
        scale = c.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))


def _converted(params):
    """(name, array) as llama.cpp's converter hands them to its name map: gpt-oss's sinks get a
    `.weight`, its experts' gate_up_proj [X, in, 2F] (gate columns even) splits into gate_proj and
    up_proj [X, F, in], down_proj [X, F, out] turns [X, out, F], their biases split likewise."""
    for name, p in params:
        p = p.detach().numpy()
        if name.endswith("sinks"):
            yield name + ".weight", p
        elif name.endswith("gate_up_proj_bias"):
            yield name.replace("gate_up_proj_bias", "gate_proj.bias"), p[..., ::2]
            yield name.replace("gate_up_proj_bias", "up_proj.bias"), p[..., 1::2]
        elif name.endswith("gate_up_proj"):
            t = p.swapaxes(-1, -2)
            yield name.replace("gate_up_proj", "gate_proj.weight"), t[:, ::2, :]
            yield name.replace("gate_up_proj", "up_proj.weight"), t[:, 1::2, :]
        elif name.endswith("down_proj_bias") and ".experts." in name:
            yield name.replace("down_proj_bias", "down_proj.bias"), p
        elif name.endswith("down_proj") and ".experts." in name:
            yield name.replace("down_proj", "down_proj.weight"), p.swapaxes(-1, -2)
        else:
            yield name, p


def write_gguf(path: Path, model, name: str, experts: str = "F32") -> Path:
    """`experts`: "MXFP4" stores the experts' weights so (as llama.cpp's gpt-oss files do),
    "MXFP4-F32" as f32 values that went through MXFP4."""
    arch = GGUF_ARCH[name]
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    _header(w, c, arch)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "_")], c.num_hidden_layers)
    for hf_name, p in _converted(model.named_parameters()):
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = p.astype(np.float32)
        if arch.startswith("gemma") and gname.endswith("norm.weight"):
            data = data + 1.0          # llama.cpp's converter: its norm scales by the weight alone
        if experts != "F32" and gname.endswith("_exps.weight"):
            raw = gguf.quants.quantize(data, gguf.GGMLQuantizationType.MXFP4)
            if experts == "MXFP4":
                w.add_tensor(gname, raw, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
                continue
            data = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
        w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("name", list(GGUF_ARCH))
def test_gguf_file_gives_the_checkpoints_config_and_transformers_logprobs(name, tmp_path):
    assert name in FAMILIES
    model = write_checkpoint(tmp_path, name)
    path = write_gguf(tmp_path / f"{name}.gguf", model, name)
    cfg, weights = load_model(path, "float32")
    want_cfg, _ = load_model(tmp_path, "float32", load_format="dummy")
    got, want = dataclasses.asdict(cfg), dataclasses.asdict(want_cfg)
    for d in (got, want):      # the GGUF has no tokenizer; LongRoPE's attention factor is its formula
        d.pop("bos_token_id"), d.pop("eos_token_ids")
        d["rms_norm_eps"] = float(np.float32(d["rms_norm_eps"]))     # an f32 in GGUF
        scaling = dict(d.pop("rope_scaling") or {})
        scaling.pop("attention_factor", None)
        d["rope_scaling"] = {k: np.round(v, 5).tolist() if isinstance(v, tuple) else v for k, v in scaling.items()}
    assert got == want
    ids = PROMPTS[-1]
    runner = PagedRunner(cfg, weights, block_size=16, num_blocks=32, max_blocks_per_seq=20)
    lps = prefill_logprobs(runner, ids)
    ref = _hf_logprobs(model, ids)
    assert ref.std() > 0.3
    diff = float(np.abs(lps - ref).max())
    print(f"{name}: max |logprob diff| GGUF vs transformers {diff:.2e}")
    assert diff < LOGPROB_ATOL


def test_gpt_oss_mxfp4_experts_read_as_their_values(tmp_path):
    model = write_checkpoint(tmp_path, "gpt-oss")
    ids = PROMPTS[-1][:64]
    logits = {}
    for kind in ("MXFP4", "MXFP4-F32"):
        cfg, weights = load_model(write_gguf(tmp_path / f"{kind}.gguf", model, "gpt-oss", kind), "float32")
        logits[kind] = PagedRunner(cfg, weights, block_size=16, num_blocks=8, max_blocks_per_seq=4).prefill_logits(ids)
    np.testing.assert_allclose(logits["MXFP4"], logits["MXFP4-F32"], rtol=1e-5, atol=1e-5)


def _metadata_only(path: Path, arch: str, layers: int, **keys) -> Path:
    """A GGUF of `arch` with Gemma 2 27B's attention shape and one tensor."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_embedding_length(4608)
    w.add_feed_forward_length(64)
    w.add_head_count(32)
    w.add_head_count_kv(16)
    w.add_key_length(128)
    w.add_vocab_size(16)
    for key, value in keys.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((16, 4608), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gemma_defaults_follow_llama_cpp(tmp_path):
    from jaxserve.loader.loader import gguf_config_of
    # llama.cpp: 1/sqrt(hidden / heads) for the 27B models (Gemma 2: 46 layers), else 1/sqrt(head_dim);
    # Gemma 2's caps 50 and 30; its layers slide from the first, every other
    cfg = gguf_config_of(_metadata_only(tmp_path / "a.gguf", "gemma2", 46, sliding_window=4096))
    assert cfg.query_pre_attn_scalar == 144 and cfg.attn_logit_softcapping == 50 and cfg.final_logit_softcapping == 30
    assert cfg.layer_windows[:3] == (4096, None, 4096)
    cfg = gguf_config_of(_metadata_only(tmp_path / "b.gguf", "gemma2", 42, sliding_window=4096))
    assert cfg.query_pre_attn_scalar == 128
    # Gemma 3: every 6th layer global, sliding layers on a 10k base, no window: all global
    cfg = gguf_config_of(_metadata_only(tmp_path / "c.gguf", "gemma3", 12, sliding_window=512))
    assert cfg.layer_windows == ((512,) * 5 + (None,)) * 2 and cfg.rope_local_theta == 10000.0
    assert cfg.final_logit_softcapping is None and cfg.qk_norm
    cfg = gguf_config_of(_metadata_only(tmp_path / "d.gguf", "gemma3", 12))
    assert cfg.layer_windows == (None,) * 12


def test_unsupported_architecture_or_family_metadata_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match=r"Unsupported GGUF architecture 'starcoder2'.*gemma2, gemma3, phi3"):
        load_model(_metadata_only(tmp_path / "s.gguf", "starcoder2", 2), "float32")
    path = _metadata_only(tmp_path / "g.gguf", "gemma3", 2, sliding_window=16,
                          rope_scaling_type=gguf.RopeScalingType.YARN)
    with pytest.raises(ModelLoadError, match=r"Unsupported GGUF rope scaling type 'yarn'"):
        load_model(path, "float32")
