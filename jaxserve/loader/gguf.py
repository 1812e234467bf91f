"""GGUF files (llama.cpp) -> ModelConfig and Hugging Face-layout tensors, via the `gguf` package.

llama.cpp's converter permutes the rows of q/k projections of llama-architecture models into
its interleaved rotary layout; `_unpermute` puts them back so the rotate-half rope of
models/llama.py applies unchanged. Gemma 2/3, Phi-3, gpt-oss and DeepSeek (`deepseek2`) files:
loader/gguf_families.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.loader import gguf_families
from jaxserve.loader.loader import ModelLoadError

_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
          **gguf_families.ARCHS}

_PLAIN_TYPES = ("F32", "F16", "F64")   # read as they are, cast to f32
# Quantized types the gguf package can dequantize and we accept.
_QUANT_TYPES = ("BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4")

_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ModelLoadError(f"Unsupported GGUF architecture {arch!r}; jaxserve supports "
                             f"{', '.join(_ARCHS)}")

    def need(key):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF file lacks the metadata field {arch}.{key}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise ModelLoadError("GGUF file has neither a vocab_size nor a token list")
    stype = _field(reader, f"{arch}.rope.scaling.type")
    if stype not in (None, "none", "linear") and not (arch in ("gpt-oss", "deepseek2") and stype == "yarn"):
        raise ModelLoadError(f"Unsupported GGUF rope scaling type {stype!r}")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    if arch in gguf_families.ARCHS:      # read by the family's config.json reader
        tensors = {t.name: t for t in reader.tensors}
        ffn, layers = int(need("feed_forward_length")), int(need("block_count"))
        try:
            family = gguf_families.hf_config(arch, lambda key, default=None: _field(reader, f"{arch}.{key}", default),
                                             tensors, dequantize)
            return ModelConfig.from_hf({
                "architectures": [_ARCHS[arch]], "vocab_size": int(vocab), "hidden_size": hidden,
                "intermediate_size": ffn, "num_hidden_layers": layers,
                "num_attention_heads": heads,
                "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
                "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
                "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
                "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
                "tie_word_embeddings": "output.weight" not in names,
                "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"), "eos_token_id": eos, **family})
        except ValueError as e:
            raise ModelLoadError(f"GGUF {arch} metadata: {e}") from None
    scaling = None if stype != "linear" else (
        ("factor", float(_field(reader, f"{arch}.rope.scaling.factor"))), ("rope_type", "linear"))
    return ModelConfig(
        architecture=_ARCHS[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: [out, in] interleaved -> rotate-half layout."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def dequantize(tensor) -> np.ndarray:
    """A GGUF tensor -> f32 numpy array in row-major [out, in] order."""
    return dequantize_data(tensor.name, tensor.tensor_type, tensor.data)


def dequantize_data(name: str, tensor_type, data) -> np.ndarray:
    """Raw GGUF data (all of a tensor, or a slice of whole rows: one expert) of `tensor_type` ->
    f32; `name` for the error on a type jaxserve cannot read."""
    import gguf

    kind = tensor_type.name
    if kind in _PLAIN_TYPES:
        return np.asarray(data, dtype=np.float32)
    if kind not in _QUANT_TYPES:
        raise ModelLoadError(f"tensor {name} uses the GGUF quantization type {kind}, which "
                             f"jaxserve cannot dequantize; supported: "
                             f"{', '.join(_PLAIN_TYPES + _QUANT_TYPES)}")
    return gguf.quants.dequantize(data, tensor_type).astype(np.float32, copy=False)


def _drop_pages(reader, tensor) -> None:
    """Let the kernel drop the resident pages of `tensor`'s bytes in the file mapping (they stay in
    the page cache, not in this process's memory): a converted tensor's file bytes are not held
    beside it, so peak memory is the converted weights, not those plus the file."""
    import mmap
    m = getattr(reader.data, "_mmap", None)
    if m is None or not hasattr(m, "madvise"):
        return
    page = mmap.PAGESIZE
    start = -(-int(tensor.data_offset) // page) * page
    end = (int(tensor.data_offset) + int(tensor.n_bytes)) // page * page
    if end > start:
        m.madvise(mmap.MADV_DONTNEED, start, end - start)


def read_gguf(path):
    """Open (parse the header of) a GGUF file, with a clear error for a corrupt one."""
    from jaxserve.loader.gguf_reader import FastGGUFReader

    try:
        return FastGGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError / struct.error / OSError on bad files
        raise ModelLoadError(f"cannot read {path}: corrupt or not a GGUF file ({e})") from None


def open_gguf(path: Path, reader=None, keep_quantized: bool = False) -> tuple[ModelConfig, Callable[[str], np.ndarray]]:
    """`reader`: an already open GGUFReader of `path` (the tokenizer shares it). `get(hf_name)`
    returns the tensor dequantized to f32; with `keep_quantized`, `get.quantized(hf_name)` returns
    a quantized tensor's blocks as loader/gguf_quant.py's `QuantTensor` (None for F32/F16/BF16)."""
    reader = reader if reader is not None else read_gguf(path)
    try:
        cfg = gguf_config(reader)
    except ModelLoadError:
        raise
    except ValueError as e:   # ModelConfig's own range checks on the metadata
        raise ModelLoadError(f"{path}: {e}") from None
    tensors = {t.name: t for t in reader.tensors}
    permuted = cfg.architecture == "LlamaForCausalLM"
    layer_names = gguf_families.NAMES.get(cfg.architecture, _GGUF_NAMES)
    shift = gguf_families.NORM_SHIFT.get(cfg.architecture)

    def tensor(name: str):
        if name not in tensors:
            raise ModelLoadError(f"tensor {name} is missing from {path}")
        return tensors[name]

    def read(name: str) -> np.ndarray:
        return dequantize(tensor(name))

    def read_expert(name: str, expert: int) -> np.ndarray:
        """One expert's matrix of a stacked [X, out, in] tensor, its blocks alone dequantized."""
        t = tensor(name)
        return dequantize_data(name, t.tensor_type, t.data[expert])

    def gguf_name(hf_name: str) -> str:
        if hf_name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[hf_name]
        else:
            _, _, layer, suffix = hf_name.split(".", 3)
            if suffix not in layer_names:
                raise ModelLoadError(f"{path}: no GGUF tensor name for {hf_name} of {cfg.architecture}")
            name = f"blk.{layer}.{layer_names[suffix]}"
        if name not in tensors:
            raise ModelLoadError(f"tensor {name} is missing from {path}")
        return name

    def heads(name: str) -> int | None:
        """The head count whose q/k row permutation `name` carries, None for other tensors."""
        if permuted and name.endswith(("attn_q.weight", "attn_k.weight")):
            return cfg.num_heads if name.endswith("attn_q.weight") else cfg.num_kv_heads
        return None

    def get(hf_name: str) -> np.ndarray:
        if gguf_families.is_joined(cfg.architecture, hf_name):
            try:
                return gguf_families.joined(hf_name, read, tensors.__contains__, read_expert)
            except ValueError as e:
                raise ModelLoadError(f"{path}: {e}") from None
        name = gguf_name(hf_name)
        w = dequantize(tensors[name])
        if shift and name.endswith("norm.weight"):
            return w - np.float32(shift)
        return w if heads(name) is None else _unpermute(w, heads(name))

    def quantized(hf_name: str):
        from jaxserve.loader import gguf_quant

        if gguf_families.is_joined(cfg.architecture, hf_name):    # dequantized by `get`
            return None

        name = gguf_name(hf_name)
        t = tensors[name]
        if t.tensor_type.name not in gguf_quant.KEPT or (shift and name.endswith("norm.weight")):
            return None
        try:
            q = gguf_quant.decode(name, t.tensor_type.name, t.data, tuple(int(s) for s in t.shape))
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from None
        _drop_pages(reader, t)          # decoded into copies: the file's pages need not stay resident
        if heads(name) is not None:
            q = q.take_rows(_unpermute(np.arange(q.codes.shape[0]), heads(name)))
        return q

    if keep_quantized:
        get.quantized = quantized
    return cfg, get

