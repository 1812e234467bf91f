"""Int4 (W4A16) checkpoints: GPTQ, AWQ and compressed-tensors `pack-quantized` ones (packed here from
random weights, following each format's own packing code) matching transformers running the
dequantised weights as a plain model. The kernel itself is tests/test_int4_kernel.py's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers.int4 import Int4Weight
from jaxserve.layers.linear import DenseWeight

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers_paged import PagedRunner  # noqa: E402
from test_model_parity import build_tiny_checkpoint  # noqa: E402

from jaxserve.loader.loader import ModelLoadError, load_model  # noqa: E402

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256)


# -- packers written from each format's reference code ------------------------------------------------

def _quantize(w: np.ndarray, g: int, sym: bool, gidx: np.ndarray):
    """w [out, in] f32 -> (codes uint8 [in, out], scale f16 [G, out], zero uint8 [G, out], dequantised f32
    [out, in]); input row i in group gidx[i]."""
    wt = w.T.astype(np.float32)
    G = wt.shape[0] // g
    scale, zero = np.zeros((G, wt.shape[1]), np.float16), np.zeros((G, wt.shape[1]), np.uint8)
    for j in range(G):
        rows = wt[gidx == j]
        if sym:
            scale[j] = np.maximum(np.abs(rows).max(0), 1e-6) / 7.5
            zero[j] = 8
        else:
            lo, hi = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
            scale[j] = np.maximum(hi - lo, 1e-6) / 15
            zero[j] = np.clip(np.round(-lo / scale[j].astype(np.float32)), 0, 15)
    s, z = scale.astype(np.float32)[gidx], zero.astype(np.float32)[gidx]
    codes = np.clip(np.round(wt / s) + z, 0, 15).astype(np.uint8)
    return codes, scale, zero, np.ascontiguousarray(((codes - z) * s).T)


def _words(x) -> np.ndarray:
    return np.ascontiguousarray(x, np.uint32).view(np.int32)


def gptq_tensors(codes, scale, zero, gidx, v1=True):
    """AutoGPTQ's pack: qweight row r |= code[8r + j] << 4j; qzeros column c |= (zero[8c + j] - 1) << 4j."""
    k, n = codes.shape
    qweight = np.zeros((k // 8, n), np.uint32)
    for j in range(8):
        qweight |= codes[j::8].astype(np.uint32) << (4 * j)
    zs = (zero.astype(np.int64) - (1 if v1 else 0)) & 0xF
    qzeros = np.zeros((zero.shape[0], n // 8), np.uint32)
    for j in range(8):
        qzeros |= zs[:, j::8].astype(np.uint32) << (4 * j)
    return {"qweight": _words(qweight), "qzeros": _words(qzeros), "scales": scale, "g_idx": gidx.astype(np.int32)}


def awq_tensors(codes, scale, zero, gidx):
    """AutoAWQ's GEMM pack: word c |= value[8c + order[i]] << 4i, order [0, 2, 4, 6, 1, 3, 5, 7]."""
    def pack_cols(v):
        out = np.zeros((v.shape[0], v.shape[1] // 8), np.uint32)
        for i, col in enumerate(AWQ_ORDER):
            out |= v[:, col::8].astype(np.uint32) << (4 * i)
        return _words(out)
    return {"qweight": pack_cols(codes), "qzeros": pack_cols(zero), "scales": scale}


def ct_tensors(codes, scale, zero, gidx, sym=True, act_order=False):
    """compressed-tensors' pack_to_int32: signed values + 8, value[:, i::8] << 4i along the last dim;
    zero points packed the same way along dim 0."""
    n, k = codes.shape[1], codes.shape[0]
    packed = np.zeros((n, k // 8), np.uint32)
    for i in range(8):
        packed |= codes.T[:, i::8].astype(np.uint32) << (4 * i)   # codes are already signed + 8
    t = {"weight_packed": _words(packed), "weight_scale": np.ascontiguousarray(scale.T),
         "weight_shape": np.array([n, k], np.int64)}
    if not sym:
        zp = np.zeros((n // 8, zero.shape[0]), np.uint32)
        for i in range(8):
            zp |= zero.T[i::8].astype(np.uint32) << (4 * i)
        t["weight_zero_point"] = _words(zp)
    if act_order:
        t["weight_g_idx"] = gidx.astype(np.int32)
    return t


def test_awq_word_order_is_the_interleaved_one():
    codes = np.arange(8, dtype=np.uint8).reshape(1, 8)
    assert awq_tensors(codes, None, codes, None)["qweight"].view(np.uint32)[0, 0] == 0x75316420
    from jaxserve.loader.int4 import AWQ_ORDER as LOADER_ORDER
    from jaxserve.loader.int4 import unpack_np
    assert LOADER_ORDER == AWQ_ORDER
    assert np.array_equal(unpack_np(np.array([[0x75316420]], np.uint32).view(np.int32), 1, AWQ_ORDER), codes)


def _qconfig(method, g, sym, act_order):
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": g, "sym": sym, "desc_act": act_order,
                "checkpoint_format": "gptq"}
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True, "version": "gemm"}
    w = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group", "group_size": g}
    if act_order:
        w["actorder"] = "group"
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": None,
                                          "format": "pack-quantized"}}, "ignore": ["lm_head"]}


def write_int4_checkpoint(root: Path, method: str, g: int, sym: bool, act_order: bool, seed=0,
                          config_class="LlamaConfig", kwargs=TINY, quantize_head=False):
    """A tiny random model saved by transformers, every `*_proj` linear of its layers (experts included,
    the router not) replaced by `method`'s int4 tensors; returns transformers' model of the same
    weights dequantised (saved plainly next to `root` and loaded back)."""
    from safetensors.numpy import load_file, save_file
    build_tiny_checkpoint(root, config_class, kwargs, seed=seed)
    tensors = load_file(str(root / "model.safetensors"))
    rng = np.random.default_rng(seed)
    plain = dict(tensors)
    linears = [k for k in tensors if k.startswith("model.layers.") and
               (k.endswith("_proj.weight") or re.search(r"\.experts\.\d+\.w[123]\.weight$", k))]  # Mixtral's w1..w3
    for key in linears + (["lm_head.weight"] if quantize_head else []):
        w = tensors.pop(key)
        k = w.shape[1]
        gk = k if g == -1 else g              # -1: one group over the whole input (per channel)
        gidx = (rng.permutation(k) // gk) if act_order else np.arange(k) // gk
        codes, scale, zero, plain[key] = _quantize(w, gk, sym, gidx)
        if method == "gptq":
            new = gptq_tensors(codes, scale, zero, gidx)
        elif method == "awq":
            new = awq_tensors(codes, scale, zero, gidx)
        else:
            new = ct_tensors(codes, scale, zero, gidx, sym, act_order)
        tensors.update({key[: -len("weight")] + t: v for t, v in new.items()})
    dequantized = root.parent / (root.name + "-dequantized")
    dequantized.mkdir()
    (dequantized / "config.json").write_text((root / "config.json").read_text())
    save_file(plain, str(dequantized / "model.safetensors"))
    save_file(tensors, str(root / "model.safetensors"))
    cfg = json.loads((root / "config.json").read_text())
    cfg["quantization_config"] = _qconfig(method, g, sym, act_order)
    (root / "config.json").write_text(json.dumps(cfg))
    return transformers.AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()


CASES = {   # method, group size, symmetric, act order
    "gptq-sym-g128": ("gptq", 128, True, False),
    "gptq-asym-actorder-g32": ("gptq", 32, False, True),
    "gptq-sym-actorder-g64": ("gptq", 64, True, True),
    "gptq-asym-g64": ("gptq", 64, False, False),
    "gptq-asym-per-channel": ("gptq", -1, False, False),
    "awq-g128": ("awq", 128, False, False),
    "awq-g32": ("awq", 32, False, False),
    "ct-sym-g128": ("compressed-tensors", 128, True, False),
    "ct-asym-g32": ("compressed-tensors", 32, False, False),
    "ct-sym-actorder-g64": ("compressed-tensors", 64, True, True),
}


def _logprobs(logits: np.ndarray) -> np.ndarray:
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))


@pytest.mark.parametrize("case", list(CASES))
def test_int4_checkpoint_matches_transformers_on_dequantised_weights(tmp_path, case):
    method, g, sym, act_order = CASES[case]
    model = write_int4_checkpoint(tmp_path / "q", method, g, sym, act_order)
    cfg, weights = load_model(tmp_path / "q", "float32")
    # per channel (-1) is stored as groups of 128 rows sharing one scale, so it tiles and splits
    assert isinstance(weights.layers.wq, Int4Weight) and weights.layers.wq.group_size == (128 if g == -1 else g)
    assert weights.layers.w_down.scale.shape[-2] == 256 // (128 if g == -1 else g)
    assert (weights.layers.w_down.perm is not None) == act_order
    assert (weights.layers.w_up.zero is None) == sym
    assert isinstance(weights.lm_head, DenseWeight)
    ids = np.random.default_rng(1).integers(0, 96, size=24).tolist()
    with torch.no_grad():
        ref = _logprobs(model(torch.tensor([ids])).logits[0].float().numpy())
    got = _logprobs(PagedRunner(cfg, weights, block_size=4, num_blocks=32, max_blocks_per_seq=8).prefill_logits(ids))
    diff = float(np.abs(got - ref).max())
    print(f"{case}: max |logprob diff| {diff:.2e}")
    assert diff < 1e-3


# -- bad input: a load error naming the field, never a silent wrong load ----------------------------

def _edit(root: Path, qconfig: dict | None = None, drop=(), change=None):
    from safetensors.numpy import load_file, save_file
    if qconfig is not None:
        cfg = json.loads((root / "config.json").read_text())
        cfg["quantization_config"] = cfg["quantization_config"] | qconfig
        (root / "config.json").write_text(json.dumps(cfg))
    if drop or change:
        t = load_file(str(root / "model.safetensors"))
        t = {k: v for k, v in t.items() if not any(k.endswith(d) for d in drop)}
        for k in t:
            if change and k.endswith(change[0]):
                t[k] = change[1](t[k])
        save_file(t, str(root / "model.safetensors"))


BAD = {   # case: (method, act_order, edit, error pattern)
    "gptq-bits-3": ("gptq", False, dict(qconfig={"bits": 3}), r"quantization_config\.bits must be one of \[4\]"),
    "gptq-bits-8": ("gptq", False, dict(qconfig={"bits": 8}), r"quantization_config\.bits .* got 8"),
    "gptq-actorder-gidx-unbalanced": ("gptq", True, dict(change=("g_idx", lambda g: np.sort(g) * 0)),
                                      r"g_idx does not match group_size 32"),
    "gptq-gidx-without-desc-act": ("gptq", True, dict(qconfig={"desc_act": False}),
                                   r"g_idx does not match quantization_config: desc_act is false"),
    "gptq-actorder-gidx-missing": ("gptq", True, dict(drop=("g_idx",)), r"g_idx is missing"),
    "gptq-qzeros-missing": ("gptq", False, dict(drop=("qzeros",)), r"qzeros is missing"),
    "gptq-sym-with-zeros": ("gptq", False, dict(qconfig={"sym": True}), r"sym is true but the stored zero"),
    "gptq-group-does-not-divide": ("gptq", False, dict(qconfig={"group_size": 96}),
                                   r"128 input features do not divide into groups of 96"),
    "gptq-format": ("gptq", False, dict(qconfig={"checkpoint_format": "marlin"}), r"checkpoint_format"),
    "awq-no-zero-point": ("awq", False, dict(qconfig={"zero_point": False}), r"quantization_config\.zero_point"),
    "awq-gemv": ("awq", False, dict(qconfig={"version": "gemv"}), r"quantization_config\.version"),
    "ct-asym-zero-point-missing": ("compressed-tensors", False, dict(drop=("weight_zero_point",)),
                                   r"weight_zero_point is missing"),
    "ct-actorder-gidx-missing": ("compressed-tensors", True, dict(drop=("weight_g_idx",)),
                                 r"weight_g_idx is missing"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_int4_checkpoint_is_a_load_error_naming_the_field(tmp_path, case):
    method, act_order, edit, pattern = BAD[case]
    write_int4_checkpoint(tmp_path / "q", method, 32, False, act_order)
    _edit(tmp_path / "q", **edit)
    with pytest.raises(ModelLoadError, match=pattern):
        load_model(tmp_path / "q", "float32")


def test_quantization_flag_must_name_the_checkpoint_method(tmp_path):
    write_int4_checkpoint(tmp_path / "q", "awq", 32, False, False)
    with pytest.raises(ModelLoadError, match=r"quantization 'gptq' names a gptq checkpoint.*quant_method 'awq'"):
        load_model(tmp_path / "q", "float32", quantization="gptq")
    _, weights = load_model(tmp_path / "q", "float32", quantization="awq_marlin")    # vLLM's kernel alias
    assert isinstance(weights.layers.wo, Int4Weight)
    with pytest.raises(ModelLoadError, match=r"quantization 'fp8' quantises a full-precision checkpoint"):
        load_model(tmp_path / "q", "float32", quantization="fp8")
    with pytest.raises(ModelLoadError, match=r"--load-format dummy makes full-precision random weights"):
        load_model(tmp_path / "q", "float32", quantization="gptq", load_format="dummy")
    gguf = tmp_path / "model.gguf"          # refused before the file is read
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match=r"quantization 'gptq' names a gptq checkpoint, but .* is a GGUF file"):
        load_model(gguf, "float32", quantization="gptq")


# -- tensor parallelism: codes, scales and zeros split with the matrix ---------------------------------

_TP_CHILD = """
import json, sys
import jax
from jaxserve import LLM, SamplingParams
from jaxserve.layers.int4 import Int4Weight
assert len(jax.devices()) == 8
result = []
for path, tp, ep in json.loads(sys.argv[1]):
    try:
        llm = LLM(model=path, tensor_parallel_size=tp, dtype="float32", max_model_len=64, max_num_seqs=4,
                  num_gpu_blocks_override=32, warmup=False, compilation_cache_dir="", enable_expert_parallel=ep)
    except ValueError as e:
        result.append(dict(error=str(e)))
        continue
    with llm:
        w = llm.llm_engine.runner.weights.layers
        moe = w.w_down is None
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}],
                            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0),
                            use_tqdm=False)
        c = outs[0].outputs[0]
        result.append(dict(tokens=list(c.token_ids), logprobs=[e[t].logprob for e, t in zip(c.logprobs, c.token_ids)],
                           in_shards=None if moe else [w.wo.in_shards, w.w_down.in_shards, w.wq.in_shards],
                           wq_codes_per_device=w.wq.q.addressable_shards[0].data.shape[-1],
                           wo_codes_per_device=w.wo.q.addressable_shards[0].data.shape[-2],
                           expert_down_words_per_device=moe and w.we_down.w.q.addressable_shards[0].data.shape[-2]))
print("RESULT" + json.dumps(result))
"""


def test_int4_weights_split_over_tensor_parallel_devices(tmp_path):
    import os
    import subprocess
    import sys
    write_int4_checkpoint(tmp_path / "g32", "gptq", 32, False, True)
    write_int4_checkpoint(tmp_path / "g64", "awq", 64, False, False)
    moe = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
               num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    write_int4_checkpoint(tmp_path / "moe", "compressed-tensors", 16, False, False, config_class="Qwen3MoeConfig",
                          kwargs=moe)
    mixtral = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                   num_experts_per_tok=2, intermediate_size=64)
    write_int4_checkpoint(tmp_path / "mixtral", "gptq", 32, False, True, config_class="MixtralConfig", kwargs=mixtral)
    from jaxserve.tokenizer.tokenizer import Tokenizer
    for d in ("g32", "g64", "moe", "mixtral"):       # prompts are token ids; the engine still wants a tokenizer
        Tokenizer.synthetic(96).backend.save(str(tmp_path / d / "tokenizer.json"))
    runs = [(str(tmp_path / "g32"), tp, False) for tp in (1, 2, 4)]
    runs += [(str(tmp_path / "moe"), 1, False), (str(tmp_path / "moe"), 2, False), (str(tmp_path / "moe"), 2, True)]
    runs += [(str(tmp_path / "g64"), 4, False)]
    runs += [(str(tmp_path / "mixtral"), tp, ep) for tp, ep in ((1, False), (2, True), (2, False))]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _TP_CHILD, json.dumps(runs)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, *split, moe_one, moe_two, moe_ep, refused, mx_one, mx_ep, mx_tp = json.loads(proc.stdout.split("RESULT")[-1])
    assert "error" not in one, one["error"]
    assert one["in_shards"] == [1, 1, 1]
    for tp, r in zip((2, 4), split):
        assert r["tokens"] == one["tokens"], tp
        np.testing.assert_allclose(r["logprobs"], one["logprobs"], atol=1e-4)
        assert r["in_shards"] == [tp, tp, 1]                      # row-parallel wo, w_down; column wq
        assert r["wq_codes_per_device"] == 128 // tp and r["wo_codes_per_device"] == 128 // 8 // tp
    assert "not a whole number of 64-row groups" in refused["error"], refused
    assert "error" not in moe_two, moe_two["error"]
    assert moe_two["tokens"] == moe_one["tokens"]                 # int4 experts split over the MoE MLP
    assert (moe_one["expert_down_words_per_device"], moe_two["expert_down_words_per_device"]) == (4, 2)
    assert "error" not in moe_ep, moe_ep["error"]
    assert moe_ep["tokens"] == moe_one["tokens"] and moe_ep["expert_down_words_per_device"] == 4   # whole experts
    np.testing.assert_allclose(moe_ep["logprobs"], moe_one["logprobs"], atol=1e-4)
    np.testing.assert_allclose(moe_two["logprobs"], moe_one["logprobs"], atol=1e-4)
    # Mixtral names, act-order int4 experts: whole experts per device (EP) give one device's tokens;
    # splitting each expert's input rows (TP without EP) cannot carry a per-expert permutation
    assert "error" not in mx_one and "error" not in mx_ep, (mx_one, mx_ep)
    assert mx_ep["tokens"] == mx_one["tokens"] and mx_ep["expert_down_words_per_device"] == 8
    np.testing.assert_allclose(mx_ep["logprobs"], mx_one["logprobs"], atol=1e-4)
    assert "act-order" in mx_tp["error"] and "--enable-expert-parallel" in mx_tp["error"], mx_tp


MOE_CASES = {   # config class, method, group size, symmetric, act order, hidden, expert width
    "qwen3moe-gptq-asym-actorder-g32": ("Qwen3MoeConfig", "gptq", 32, False, True, 64, 32),
    "qwen3moe-awq-g64": ("Qwen3MoeConfig", "awq", 64, False, False, 128, 64),
    "qwen3moe-ct-sym-g128": ("Qwen3MoeConfig", "compressed-tensors", 128, True, False, 128, 128),
    "mixtral-gptq-sym-g64": ("MixtralConfig", "gptq", 64, True, False, 128, 64),
    "mixtral-ct-asym-actorder-g32": ("MixtralConfig", "compressed-tensors", 32, False, True, 64, 32),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_int4_experts_match_transformers(tmp_path, case):
    """Mixture-of-experts experts stored as int4 (one set of tensors per expert, Qwen3-MoE's
    `mlp.experts.N.*_proj` and Mixtral's `block_sparse_moe.experts.N.w1..w3` names) stack into an
    `ExpertWeight` around one `Int4Weight` [L, X, in, out]; the router stays dense. Logprobs equal
    transformers running the dequantised weights as a plain model."""
    from jaxserve.layers.experts import ExpertWeight
    config_class, method, g, sym, act_order, hidden, width = MOE_CASES[case]
    kwargs = dict(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                  num_experts_per_tok=2)
    if config_class == "MixtralConfig":
        kwargs.update(num_local_experts=4, intermediate_size=width)
    else:
        kwargs.update(num_experts=4, moe_intermediate_size=width, norm_topk_prob=True)
    model = write_int4_checkpoint(tmp_path / "q", method, g, sym, act_order, config_class=config_class,
                                  kwargs=kwargs)
    cfg, weights = load_model(tmp_path / "q", "float32")
    for name in ("we_gate", "we_up", "we_down"):
        we = getattr(weights.layers, name)
        assert isinstance(we, ExpertWeight) and isinstance(we.w, Int4Weight), name
        # act order over a single group (K == g) permutes nothing: no perm is kept
        assert we.w.group_size == g and (we.w.zero is None) == sym
        assert (we.w.perm is not None) == (act_order and we.shape[-2] > g), name
    assert weights.layers.we_down.shape == (2, 4, width, hidden)
    assert isinstance(weights.layers.router, DenseWeight)
    ids = np.random.default_rng(1).integers(0, 96, size=24).tolist()
    with torch.no_grad():
        ref = _logprobs(model(torch.tensor([ids])).logits[0].float().numpy())
    got = _logprobs(PagedRunner(cfg, weights, block_size=4, num_blocks=32, max_blocks_per_seq=8).prefill_logits(ids))
    diff = float(np.abs(got - ref).max())
    print(f"{case}: max |logprob diff| {diff:.2e}")
    assert diff < 1e-3


def test_engine_args_accept_vllm_quantization_names():
    from jaxserve.config import EngineArgs
    for q in ("awq", "gptq", "compressed-tensors", "awq_marlin", "gptq_marlin", "fp8"):
        assert EngineArgs(quantization=q).quantization == q
    with pytest.raises(ValueError, match="quantization must be None or one of fp8, awq, gptq"):
        EngineArgs(quantization="bitsandbytes")


def test_int4_checkpoint_runs_in_bfloat16_as_close_as_dense_bfloat16(tmp_path):
    """bf16 activations with int4 weights (on CPU the tiles are multiplied in f32: XLA:CPU's fused
    dot has no bf16 x bf16 -> f32) stay as close to the f32 reference as the dequantised model in bf16."""
    model = write_int4_checkpoint(tmp_path / "q", "gptq", 32, False, True)
    ids = np.random.default_rng(1).integers(0, 96, size=24).tolist()
    with torch.no_grad():
        ref = _logprobs(model(torch.tensor([ids])).logits[0].float().numpy())
    diffs = {}
    for name in ("q", "q-dequantized"):
        cfg, weights = load_model(tmp_path / name, "bfloat16")
        runner = PagedRunner(cfg, weights, block_size=4, num_blocks=32, max_blocks_per_seq=8)
        diffs[name] = float(np.abs(_logprobs(runner.prefill_logits(ids)) - ref).max())
    print(f"bf16 max |logprob diff|: int4 {diffs['q']:.3f}, dense {diffs['q-dequantized']:.3f}")
    assert diffs["q"] < max(0.1, 1.5 * diffs["q-dequantized"])


def test_int4_lm_head_is_dequantised_to_the_model_dtype(tmp_path):
    """GPTQ's `lm_head: true` checkpoints quantise the head too; jaxserve dequantises it at load (the
    head's f32 logits path stays a DenseWeight)."""
    model = write_int4_checkpoint(tmp_path / "q", "gptq", 32, False, True, quantize_head=True)
    cfg, weights = load_model(tmp_path / "q", "float32")
    assert isinstance(weights.lm_head, DenseWeight)
    ids = np.random.default_rng(1).integers(0, 96, size=24).tolist()
    with torch.no_grad():
        ref = _logprobs(model(torch.tensor([ids])).logits[0].float().numpy())
    got = _logprobs(PagedRunner(cfg, weights, block_size=4, num_blocks=32, max_blocks_per_seq=8).prefill_logits(ids))
    assert float(np.abs(got - ref).max()) < 1e-3


@pytest.mark.parametrize("case", ["awq-g32", "gptq-asym-actorder-g32"])
def test_int4_checkpoint_on_the_cpu_engine_path_computes_its_dequantized_weights(tmp_path, case):
    """A W4A16 checkpoint as the engine lays it out on the CPU (`cpu_matmuls_for(..., w4a16=True)`):
    f32 activations in the fused kernel (few rows) and f32 tiles (many), so its logprobs are its own
    dequantized weights' to f32 rounding; `--q8-activations` opts into int8 ones."""
    from jaxserve.layers import int4_cpu
    from jaxserve.loader.loader import cpu_matmuls_for
    method, g, sym, act_order = CASES[case]
    write_int4_checkpoint(tmp_path / "q", method, g, sym, act_order)
    cfg, weights = load_model(tmp_path / "q", "float32")
    runner = lambda w: PagedRunner(cfg, w, block_size=4, num_blocks=32, max_blocks_per_seq=8)   # noqa: E731
    engine = cpu_matmuls_for(load_model(tmp_path / "q", "float32")[1], "auto", w4a16=True)
    leaves = [x for x in jax.tree.leaves(engine, is_leaf=lambda x: isinstance(x, Int4Weight))
              if isinstance(x, Int4Weight)]
    assert leaves and not any(x.fused_int8_x or x.bf16_min_rows or x.amx_min_rows or x.q8_min_rows for x in leaves)
    if int4_cpu.load() is None and not act_order:
        assert all(x.fused_max_rows for x in leaves)               # the fused kernel, f32 activations
    for n in (3, 24):                                               # the kernel's rows, and the tiles'
        ids = np.random.default_rng(n).integers(0, 96, size=n).tolist()
        want = _logprobs(runner(weights).prefill_logits(ids))
        assert float(np.abs(_logprobs(runner(engine).prefill_logits(ids)) - want).max()) < 1e-4
    if int4_cpu.load() is None and int4_cpu.int8_dot() is not None:
        q8 = cpu_matmuls_for(load_model(tmp_path / "q", "float32")[1], "auto", w4a16=True, q8=True)
        assert any(x.q8_min_rows == 1 for x in jax.tree.leaves(q8, is_leaf=lambda x: isinstance(x, Int4Weight))
                   if isinstance(x, Int4Weight))
