"""GGUF tensors of every type llama.cpp's presets write kept quantized in memory
(`quantization="gguf"`, jaxserve/loader/gguf_quant.py): the same numbers as the f32 path, a
fraction of the bytes; stacks whose layers mix types stay quantized (`LayerMixWeight`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxserve.layers.int4 import Int4Weight, ref_int4_matmul
from jaxserve.layers.linear import DenseWeight, linear
from jaxserve.loader import gguf_quant
from jaxserve.loader.loader import ModelLoadError, load_model

sys.path.insert(0, str(Path(__file__).parent))
from helpers_paged import PagedRunner  # noqa: E402

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
KINDS = tuple(gguf_quant.KEPT)
QUANTIZERS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")     # the gguf package quantizes these
# the f16 fields (byte offsets) of the types the gguf package cannot quantize: random blocks get sane ones
_F16_AT = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,),
           "IQ4_XS": (0,)}
# bytes a weight once stacked: the codes (4 or 8 bits) and an f32 scale (and offset) per group
# the K-quants and IQ4_XS keep their two-level scales: int8 per group, f16 per super-block of 256
BYTES_PER_WEIGHT = {"Q4_0": 0.625, "Q4_1": 0.75, "Q5_0": 1.125, "Q5_1": 1.25, "Q8_0": 1.125,
                    "Q2_K": 0.5 + 2 / 16 + 4 / 256, "Q3_K": 0.5 + 1 / 16 + 2 / 256, "Q4_K": 0.5 + 2 / 32 + 4 / 256,
                    "Q5_K": 1 + 2 / 32 + 4 / 256, "Q6_K": 1 + 1 / 16 + 2 / 256, "IQ4_NL": 1.125,
                    "IQ4_XS": 1 + 1 / 32 + 2 / 256, "MXFP4": 1.125}


def _quantized(rng, out: int, k: int, kind: str) -> np.ndarray:
    if kind in QUANTIZERS:
        return gguf.quants.quantize(rng.normal(0, 0.3, (out, k)).astype(np.float32), Q[kind])
    per, size = gguf_quant.BLOCKS[kind]     # random blocks: every code, scale and high bit pattern
    raw = rng.integers(0, 256, (out, k // per, size), dtype=np.uint8)
    for at in _F16_AT.get(kind, ()):
        raw[..., at:at + 2] = rng.uniform(0.001, 0.02, (out, k // per)).astype(np.float16)[..., None].view(np.uint8)
    if kind == "MXFP4":        # e8m0 exponents near 2^-6
        raw[..., 0] = rng.integers(118, 124, (out, k // per))
    return raw.reshape(out, -1)


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_decode_to_what_gguf_dequantizes(kind):
    rng = np.random.default_rng(0)
    for k in ((512, 768) if gguf_quant.BLOCKS[kind][0] == 256 else (96, 160)):   # 768, 160: not powers of 2
        raw = _quantized(rng, 48, k, kind)
        q = gguf_quant.decode("blk.0.ffn_up.weight", kind, raw, (k, 48))
        assert q.shape == (48, k)
        w = gguf_quant.stack([q], (), jax.sharding.NamedSharding(
            jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",)), jax.sharding.PartitionSpec()), "w")
        assert isinstance(w, Int4Weight) and w.shape == (k, 48) and w.group_size == q.group
        x = rng.normal(size=(5, k)).astype(np.float32)
        want = x @ gguf.quants.dequantize(raw, Q[kind]).T
        tol = 1e-6 * np.abs(want).max() * np.sqrt(k)          # f32 sums of k products, in another order
        np.testing.assert_allclose(np.asarray(ref_int4_matmul(x, w)), want, rtol=1e-5, atol=tol)
        np.testing.assert_allclose(np.asarray(linear(x, w)), want, rtol=1e-5, atol=tol)
        # 4- or 8-bit codes plus f32 scales (and offsets): far below f32's 4 bytes a weight
        assert w.nbytes / (k * 48) == BYTES_PER_WEIGHT[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_each_type_through_the_fused_kernel_and_its_layout(kind):
    """Each type in the fused CPU kernel's layout (column blocks, k4 words for 8-bit codes, two-level
    scales kept for the K-quants): f32 activations to f32 rounding, int8 ones (two parts, and
    llama.cpp's one) within their rounding; more rows through the tiles reading the blocks."""
    from jaxserve.layers import int4_cpu
    from jaxserve.layers.int4 import with_fused_kernel, with_q8_rows
    from jaxserve.layers.int4_layout import cpu_layout
    if int4_cpu.load() is not None:
        pytest.skip(int4_cpu.load())
    rng = np.random.default_rng(1)
    k = 512 if gguf_quant.BLOCKS[kind][0] == 256 else 160
    raw = _quantized(rng, 128, k, kind)
    q = gguf_quant.decode("blk.0.ffn_up.weight", kind, raw, (k, 128))
    plain = gguf_quant.stack([q], (), jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",)), jax.sharding.PartitionSpec()), "w")
    assert plain.two_level == (kind in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"))
    dense = gguf.quants.dequantize(raw, Q[kind]).T
    for int8_x in (False,) + ((True,) if int4_cpu.int8_dot() else ()):
        w = cpu_layout(with_fused_kernel(plain, int8_x=int8_x), k4=int8_x and plain.bits == 8)
        assert w.col_block and w.two_level == plain.two_level
        assert int4_cpu.fits(w.q, w.scale, w.zero, w.offset, w.group_size, w.bits, False, w.col_block, w.scale_sup,
                             w.offset_sup)                                       # the kernel takes it
        for rows in (1, 3, 20):
            x = rng.normal(size=(rows, k)).astype(np.float32)
            want = x @ dense
            tol = 1e-6 * np.abs(want).max() * np.sqrt(k)
            if int8_x and rows <= w.fused_max_rows:     # two int8 parts: x to 1.6e-5 of each block's max
                tol = 2e-4 * np.abs(want).max()
            np.testing.assert_allclose(np.asarray(linear(x, w)), want, rtol=1e-5, atol=tol, err_msg=f"{rows}")
        if int8_x and int4_cpu.int8_dot() == "AVX512-VNNI" or (int8_x and plain.bits == 4):
            x = rng.normal(size=(20, k)).astype(np.float32)          # llama.cpp's Q8 activations
            got, want = np.asarray(linear(x, with_q8_rows(w))), x @ dense
            assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()


def write_tiny_gguf(path: Path, types: dict[str, str], tied: bool = False, hidden: int = 64, seed: int = 0):
    """A 2-layer llama GGUF with random weights; `types` maps a tensor kind ("attn", "ffn",
    "embd", "output") to its GGUF type name, and may name single tensors ("attn_v", "ffn_down")
    with a type per layer (a Q4_K_M file's mix)."""
    rng = np.random.default_rng(seed)
    H, K, D, F, V, L = 4, 2, hidden // 4, 96 if hidden < 256 else 256, 96, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(K)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)

    def tensor(name, out, k, kind):
        t = types[kind]
        if name.startswith("blk.") and name.split(".")[2] in types:
            t = types[name.split(".")[2]][int(name.split(".")[1])]
        data = rng.normal(0, 0.3, (out, k)).astype(np.float32)
        if t in ("F32", "F16"):
            w.add_tensor(name, data.astype({"F32": np.float32, "F16": np.float16}[t]))
        elif t in gguf_quant.KEPT:
            w.add_tensor(name, _quantized(rng, out, k, t), raw_dtype=Q[t])
        elif t == "TQ2_0":      # no quantizer in the gguf package: any bytes of the right size
            shape = gguf.quants.quant_shape_to_byte_shape((out, k), Q[t])
            w.add_tensor(name, rng.integers(0, 256, shape, dtype=np.uint8), raw_dtype=Q[t])
        else:
            w.add_tensor(name, gguf.quants.quantize(data, Q[t]), raw_dtype=Q[t])

    tensor("token_embd.weight", V, hidden, "embd")
    if not tied:
        tensor("output.weight", V, hidden, "output")
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.normal(size=hidden)).astype(np.float32))
    for i in range(L):
        for n, out, k in (("attn_q", H * D, hidden), ("attn_k", K * D, hidden), ("attn_v", K * D, hidden),
                          ("attn_output", hidden, H * D)):
            tensor(f"blk.{i}.{n}.weight", out, k, "attn")
        for n, out, k in (("ffn_gate", F, hidden), ("ffn_up", F, hidden), ("ffn_down", hidden, F)):
            tensor(f"blk.{i}.{n}.weight", out, k, "ffn")
        for n in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{n}.weight", (1 + 0.1 * rng.normal(size=hidden)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(cfg, weights, ids):
    return PagedRunner(cfg, weights, block_size=4, num_blocks=32, max_blocks_per_seq=8).prefill_logits(ids)


@pytest.mark.parametrize("types,tied", [
    (dict(attn="Q4_0", ffn="Q4_1", embd="Q8_0", output="Q8_0"), False),
    (dict(attn="Q8_0", ffn="Q4_0", embd="Q4_1", output="Q4_0"), True),
    (dict(attn="Q4_1", ffn="F16", embd="F32", output="Q4_1"), False),    # F16, F32 stay dense
    (dict(attn="Q4_K", ffn="Q8_0", embd="Q4_K", output="Q4_K"), False),
    (dict(attn="Q5_K", ffn="Q3_K", embd="IQ4_XS", output="Q2_K"), False),
    (dict(attn="Q5_0", ffn="IQ4_NL", embd="Q6_K", output="Q5_1"), True),
])
def test_tiny_gguf_kept_quantized_matches_the_dequantized_path(tmp_path, types, tied):
    k_quants = any(gguf_quant.BLOCKS.get(t, (0,))[0] == 256 for t in types.values())
    path = write_tiny_gguf(tmp_path / "tiny.gguf", types, tied, hidden=256 if k_quants else 64)
    cfg, dense = load_model(path, "float32")
    cfg_q, kept = load_model(path, "float32", quantization="gguf")
    assert cfg_q == cfg
    for name in ("wq", "w_down"):
        kind = types["attn" if name == "wq" else "ffn"]
        want = DenseWeight if kind in ("F32", "F16") else Int4Weight
        assert isinstance(getattr(kept.layers, name), want), (name, kind)
    assert isinstance(kept.embed, Int4Weight) == (types["embd"] != "F32")
    assert (kept.lm_head is None) == tied
    ids = np.random.default_rng(1).integers(0, 96, size=13).tolist()
    np.testing.assert_allclose(_logits(cfg, kept, ids), _logits(cfg, dense, ids), rtol=1e-4, atol=1e-4)


# llama.cpp's Q4_K_M: Q4_K, with some layers' attn_v and ffn_down and the (tied) embedding in Q6_K
Q4_K_M = dict(attn="Q4_K", ffn="Q4_K", embd="Q6_K", output="Q6_K", attn_v=("Q6_K", "Q4_K"),
              ffn_down=("Q4_K", "Q6_K"))


def test_stacks_whose_layers_mix_types_stay_quantized(tmp_path):
    from jaxserve.layers import int4_cpu
    from jaxserve.layers.int4 import with_fused_kernel
    from jaxserve.layers.int4_layout import with_cpu_layout
    from jaxserve.layers.layer_mix import LayerMixWeight
    path = write_tiny_gguf(tmp_path / "q4km.gguf", Q4_K_M, tied=True, hidden=256)
    cfg, dense = load_model(path, "float32")
    _, kept = load_model(path, "float32", quantization="gguf")
    for name, q6 in (("wv", 0), ("w_down", 1)):       # the Q6_K layer of each stack
        w = getattr(kept.layers, name)
        assert isinstance(w, LayerMixWeight) and w.shape == getattr(dense.layers, name).shape
        assert w.part_of[q6] != w.part_of[1 - q6] and w.parts[w.part_of[q6]].bits == 8
        assert w.parts[w.part_of[1 - q6]].bits == 4        # each layer in its own bytes
    assert isinstance(kept.layers.wq, Int4Weight) and kept.embed.bits == 8 and kept.embed.group_size == 16
    ids = np.random.default_rng(1).integers(0, 96, size=13).tolist()
    want = _logits(cfg, dense, ids)
    np.testing.assert_allclose(_logits(cfg, kept, ids), want, rtol=1e-4, atol=1e-4)
    if int4_cpu.load() is None:       # the fused kernel reads each part's layer in place, in its layout
        fused = with_cpu_layout(with_fused_kernel(kept))
        assert fused.layers.w_down.parts[0].fused_max_rows is not None and fused.layers.w_down.parts[1].col_block
        np.testing.assert_allclose(_logits(cfg, fused, ids), want, rtol=1e-4, atol=1e-4)


def test_default_model_kept_quantized_is_under_a_third_of_the_bytes():
    from jaxserve.default_model import default_model_path
    path = default_model_path()
    _, dense = load_model(path, "float32")
    _, kept = load_model(path, "float32", quantization="gguf")

    def nbytes(w):
        return sum(a.nbytes for a in jax.tree.leaves(w))

    # Q4_1 layers (0.75 bytes a weight), the Q8_0 embedding (1.125, also the tied head), f32 norms
    assert isinstance(kept.layers.w_up, Int4Weight) and kept.layers.w_up.offset is not None
    assert isinstance(kept.embed, Int4Weight) and kept.embed.bits == 8 and kept.lm_head is None
    assert nbytes(kept) <= 0.3 * nbytes(dense), (nbytes(kept), nbytes(dense))


PROMPTS = [f"Once upon a time, in a kingdom by the sea number {i}, there lived" for i in range(6)] + \
    ["The capital of France is", "def fibonacci(n):"]


def test_default_model_kept_quantized_gives_the_dequantized_greedy_tokens():
    from jaxserve import LLM, SamplingParams
    from jaxserve.layers.int4 import Int4Weight
    from jaxserve.layers.linear import DenseWeight
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {}
    # both through chunked prefill (a 32-token budget splits the 8 prompts' ~100 tokens over
    # steps), the kept one through prefix caching as well (the second pass hits the cache).
    # Kept quantized is the default for a .gguf file; "none" reads its tensors into f32. float32:
    # f32 tiles at every batch size (the CPU default takes batches of 16+ rows through bf16 tiles).
    for q in ("none", None):
        with LLM(quantization=q, dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128,
                 num_gpu_blocks_override=128, enable_prefix_caching=True, warmup=False) as llm:
            wq = llm.llm_engine.runner.weights.layers.wq
            assert isinstance(wq, Int4Weight if q is None else DenseWeight)
            outs = llm.generate(PROMPTS, sp, use_tqdm=False)
            tokens[q] = [list(o.outputs[0].token_ids) for o in outs]
            if q is None:
                again = llm.generate(PROMPTS, sp, use_tqdm=False)
                assert [list(o.outputs[0].token_ids) for o in again] == tokens[q]
                assert sum(o.num_cached_tokens for o in again) > 0
    assert tokens[None] == tokens["none"]


def test_which_quantization_load_model_is_asked_for(tmp_path):
    from jaxserve.config import EngineArgs
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "hf").mkdir()
    assert EngineArgs(quantization=None).load_quantization(gguf) == "gguf"       # vLLM's default for GGUF
    assert EngineArgs(quantization="none").load_quantization(gguf) is None
    assert EngineArgs(quantization="fp8").load_quantization(gguf) == "fp8"
    assert EngineArgs(load_format="dummy").load_quantization(gguf) is None      # random weights: never
    assert EngineArgs().load_quantization(tmp_path / "hf") is None
    assert EngineArgs(quantization="none").load_quantization(tmp_path / "hf") is None
    with pytest.raises(ValueError, match="quantization must be None or one of .*none"):
        EngineArgs(quantization="nf4")


def test_unsupported_type_or_shape_is_an_error_naming_the_tensor(tmp_path):
    raw = _quantized(np.random.default_rng(0), 8, 64, "Q4_0")
    with pytest.raises(ValueError, match=r"tensor blk\.3\.attn_q\.weight: 48 input features are not whole Q4_0 "):
        gguf_quant.decode("blk.3.attn_q.weight", "Q4_0", raw, (48, 8))
    with pytest.raises(ValueError, match=r"tensor blk\.3\.attn_q\.weight: Q4_0 data has shape \(8, 36\), expected"):
        gguf_quant.decode("blk.3.attn_q.weight", "Q4_0", raw, (64, 9))
    # a type jaxserve cannot read at all, kept or not: the load names the tensor and the type
    path = write_tiny_gguf(tmp_path / "tq.gguf", dict(attn="Q4_0", ffn="Q4_0", embd="Q8_0", output="TQ2_0"),
                           hidden=256)
    for q in (None, "gguf"):
        with pytest.raises(ModelLoadError, match=r"tensor output\.weight uses the GGUF quantization type TQ2_0"):
            load_model(path, "float32", quantization=q)


def test_gguf_quantization_is_refused_where_there_is_no_gguf_file(tmp_path):
    from test_model_parity import build_tiny_checkpoint
    build_tiny_checkpoint(tmp_path / "hf", "LlamaConfig", {})
    with pytest.raises(ModelLoadError, match=r"quantization 'gguf' keeps a \.gguf file's .* Hugging Face directory"):
        load_model(tmp_path / "hf", "float32", quantization="gguf")
    path = write_tiny_gguf(tmp_path / "t.gguf", dict(attn="Q4_0", ffn="Q4_0", embd="Q8_0", output="Q8_0"))
    with pytest.raises(ModelLoadError, match=r"--load-format dummy"):
        load_model(path, "float32", quantization="gguf", load_format="dummy")


_TP_CHILD = """
import json, sys
import jax
import numpy as np
from jaxserve import LLM, SamplingParams
assert len(jax.devices()) == 8
res = []
for tp in (1, 3):
    # float32: f32 tiles at every batch size, so the two splits differ only by summation order
    with LLM(quantization="gguf", dtype="float32", tensor_parallel_size=tp, max_model_len=128, max_num_seqs=4,
             warmup=False, max_num_batched_tokens=32, num_gpu_blocks_override=32, compilation_cache_dir="") as llm:
        w = llm.llm_engine.runner.weights
        outs = llm.generate(["The capital of France is", "Once upon a time"],
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0), use_tqdm=False)
        res.append(dict(tokens=[list(o.outputs[0].token_ids) for o in outs],
                        logprobs=[[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                                  for o in outs],
                        in_shards=[w.layers.wo.in_shards, w.layers.w_down.in_shards, w.layers.wq.in_shards],
                        embed_cols=w.embed.q.addressable_shards[0].data.shape[-1],
                        down_groups=w.layers.w_down.scale.addressable_shards[0].data.shape[-2]))
print("RESULT" + json.dumps(res))
"""


def test_kept_gguf_weights_split_over_tensor_parallel_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _TP_CHILD], env=env, capture_output=True, text=True,
                          timeout=900, cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, three = json.loads(proc.stdout.split("RESULT")[-1])
    assert one["in_shards"] == [1, 1, 1] and three["in_shards"] == [3, 3, 1]   # row-parallel wo, w_down
    assert (one["embed_cols"], three["embed_cols"]) == (49152, 49152 // 3)   # the vocabulary splits
    assert (one["down_groups"], three["down_groups"]) == (1536 // 32, 1536 // 32 // 3)
    assert three["tokens"] == one["tokens"]
    np.testing.assert_allclose(np.array(three["logprobs"]), np.array(one["logprobs"]), atol=1e-3)


def test_server_serves_the_default_model_kept_quantized_by_default():
    import openai
    from server_fixtures import ServerProcess
    srv = ServerProcess("--max-num-batched-tokens", "32", "--max-model-len", "128",     # the default: kept
                        "--max-num-seqs", "4").start(timeout=850)
    try:
        assert "quantized tensors kept quantized" in srv.log()
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x")
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                        temperature=0)
        assert out.usage.completion_tokens == 8 and out.choices[0].text
    finally:
        srv.stop()
