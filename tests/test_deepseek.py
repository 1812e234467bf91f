"""DeepSeek V2-Lite / V3 (multi-head latent attention, DeepSeek MoE) against transformers.

Two tiny random checkpoints written here with transformers' own config classes (every parameter
and V3's routing bias randomised):
  - "v2-lite": no q_lora (q_proj), a dense first layer, softmax routing limited to the 2 best of
    4 expert groups, routed_scaling_factor, a shared expert;
  - "v3": q_lora (q_a_proj, q_a_layernorm, q_b_proj), sigmoid routing with e_score_correction_bias
    and noaux_tc groups, renormalised top-k, a dense first layer, YaRN rope with mscale /
    mscale_all_dim (the attention scale too), over a 300-token prompt past the original context.
Each read by the engine (`LLM`):
  - prompt logprobs equal transformers' (< 1e-3, f32), prefilled whole and in 48-token chunks, and
    the decode steps' logprobs too;
  - greedy tokens equal under chunked prefill, preemption and prefix caching;
  - TP=2 (and TP=2 with expert parallelism) tokens equal TP=1 on simulated CPU devices;
  - the KV pool holds one latent (kv_lora_rank + qk_rope_head_dim) per token and layer, no V;
  - the router equals transformers' routers; the attention kernels refuse the latent layout.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import engine_variant

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers_paged import PagedRunner  # noqa: E402
from helpers_paged import hf_logprobs as _hf_logprobs  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.loader.loader import load_model  # noqa: E402
from jaxserve.tokenizer.tokenizer import Tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB = 96
LOGPROB_ATOL = 1e-3
KV_LORA, ROPE = 32, 8
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
             num_experts_per_tok=2, kv_lora_rank=KV_LORA, qk_nope_head_dim=16, qk_rope_head_dim=ROPE, v_head_dim=12,
             max_position_embeddings=512, first_k_dense_replace=1, attn_implementation="eager")

FAMILIES = {
    "v2-lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        _BASE, q_lora_rank=None, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.5)),
    "v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        _BASE, q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, mscale=1.0,
                             mscale_all_dim=0.8, beta_fast=32, beta_slow=1, rope_theta=10000.0))),
}

PROMPT_LENGTHS = (7, 40, 130, 300)
NEW_TOKENS = 12


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


PROMPTS = [_prompt(n, seed) for seed, n in enumerate(PROMPT_LENGTHS)]


def write_checkpoint(path, name: str, seed: int = 0):
    """A random checkpoint of `name` saved with save_pretrained; returns the torch model."""
    config_class, model_class, kwargs = FAMILIES[name]
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if "norm" in pname else 0.1 * torch.randn_like(p))
        for bname, b in model.named_buffers():
            if "e_score_correction_bias" in bname:      # moves the choice away from the plain scores
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(path, safe_serialization=True)
    Tokenizer.synthetic(VOCAB, config.eos_token_id).backend.save(str(path / "tokenizer.json"))
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, checkpoint dir, transformers model, LLM) of one checkpoint."""
    path = tmp_path_factory.mktemp(request.param)
    model = write_checkpoint(path, request.param)
    llm = LLM(model=str(path), dtype="float32", max_model_len=512, max_num_batched_tokens=512,
              max_num_seqs=8, num_gpu_blocks_override=128, block_size=16, enable_prefix_caching=False,
              warmup=False, compilation_cache_dir="", seed=0)
    yield request.param, path, model, llm
    llm.shutdown()


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _greedy(llm, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("budget", [None, 48], ids=["whole", "chunks_of_48"])
def test_prompt_and_decode_logprobs_equal_transformers(family, budget):
    name, _, model, llm = family
    ids = PROMPTS[-1]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=1, logprobs=0)
    variant = engine_variant(llm, max_num_batched_tokens=budget) if budget else contextlib.nullcontext()
    with variant:
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
    gen = list(out.outputs[0].token_ids)
    ref = _hf_logprobs(model, ids + gen)
    lps = out.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    got = np.array([lps[p][ids[p]].logprob for p in range(1, len(ids))])
    want = ref[np.arange(len(ids) - 1), ids[1:]]
    assert want.std() > 0.3             # logprobs far from uniform, so the bound is not vacuous
    diff = float(np.abs(got - want).max())
    print(f"{name} {budget}: max |prompt logprob diff| {diff:.2e}")
    assert diff < LOGPROB_ATOL
    for i, (tok, step) in enumerate(zip(gen, out.outputs[0].logprobs)):
        row = ref[len(ids) - 1 + i]
        assert abs(step[tok].logprob - row[tok]) < LOGPROB_ATOL, i
        assert row.max() - row[tok] < LOGPROB_ATOL, i


def test_greedy_tokens_equal_under_chunked_prefill_preemption_and_prefix_caching(family):
    _, _, _, llm = family
    alone = [_greedy(llm, [p])[0] for p in PROMPTS]
    with engine_variant(llm, max_num_batched_tokens=32) as sched:
        assert _greedy(llm, PROMPTS) == alone
        assert sched.num_preemptions_total == 0
    # four 94-token prompts fill 24 blocks of 16 tokens; their decodes need more: preemption
    prompts = [_prompt(94, 10 + i) for i in range(4)]
    alone = [_greedy(llm, [p])[0] for p in prompts]
    with engine_variant(llm, num_blocks=24) as sched:
        assert _greedy(llm, prompts) == alone
        assert sched.num_preemptions_total > 0
    # prefix caching: the second run of a prompt reads its first blocks' latents from the cache
    with engine_variant(llm, enable_prefix_caching=True):
        first = llm.generate([{"prompt_token_ids": PROMPTS[2]}], GREEDY, use_tqdm=False)[0]
        again = llm.generate([{"prompt_token_ids": PROMPTS[2]}], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 112
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids) == _greedy(llm, [PROMPTS[2]])[0]


def test_the_pool_holds_one_latent_per_token_and_layer(family):
    """The point of MLA: a token costs kv_lora_rank + qk_rope_head_dim values per layer, not a
    K and a V per head (here 40 vs 2 x 4 heads x 24 dims = 192)."""
    _, _, _, llm = family
    from jaxserve.attention import kv_cache as kvc
    engine = llm.llm_engine
    cfg = engine.model_config
    cache = engine.runner.cache
    assert cache.latent and cache.v is None
    assert cache.k.shape == (cfg.num_layers, 128, 16, 1, KV_LORA + ROPE)
    pool_bytes = sum(a.nbytes for a in (cache.k,))
    per_token = pool_bytes / (128 * 16 * cfg.num_layers)
    assert per_token == (KV_LORA + ROPE) * 4
    assert kvc.bytes_per_block(cfg.num_layers, 16, 1, cfg.head_dim, np.float32, False, latent=True) == \
        cfg.num_layers * 16 * (KV_LORA + ROPE) * 4
    # a K/V pool of the same heads would be 2 * H * (nope + rope) per token: 4.8x more
    assert 2 * cfg.num_heads * (16 + ROPE) / (KV_LORA + ROPE) == pytest.approx(4.8)


def test_kv_sizing_counts_latent_bytes(tmp_path):
    """kv_cache_memory_bytes buys budget / (layers x block x latent bytes) blocks."""
    write_checkpoint(tmp_path, "v2-lite")
    budget = 3 * 16 * (KV_LORA + ROPE) * 4 * 50         # 50 blocks of a 3-layer f32 latent pool
    with LLM(model=str(tmp_path), dtype="float32", max_model_len=256, max_num_batched_tokens=64,
             kv_cache_memory_bytes=budget, warmup=False, compilation_cache_dir="") as llm:
        assert llm.llm_engine.cache_config.num_blocks == 50


_TP_CHILD = textwrap.dedent("""
    import json, sys
    import jax
    from jaxserve import LLM, SamplingParams
    path, prompts = sys.argv[1], json.loads(sys.argv[2])
    assert len(jax.devices()) >= 2
    result = {}
    for tp, ep in ((1, False), (2, False), (2, True)):
        with LLM(model=path, tensor_parallel_size=tp, enable_expert_parallel=ep, dtype="float32", max_model_len=512,
                 max_num_batched_tokens=64, max_num_seqs=8, num_gpu_blocks_override=64, warmup=False,
                 compilation_cache_dir="", seed=0) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
            result[f"{tp}{'ep' if ep else ''}"] = [o.outputs[0].token_ids for o in outs]
    print("RESULT" + json.dumps(result))
""")


def test_tensor_parallel_2_tokens_equal_one_device(family):
    _, path, _, _ = family
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _TP_CHILD, str(path), json.dumps(PROMPTS[1:3])],
                         capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    res = json.loads(lines[0][len("RESULT"):])
    assert res["1"] == res["2"] == res["2ep"] and all(len(t) == 8 for t in res["1"])


def test_dummy_weights_run_and_export_reads_back_in_transformers(family, tmp_path):
    _, path, model, _ = family
    cfg, weights = load_model(path, "float32", load_format="dummy")
    runner = PagedRunner(cfg, weights, block_size=16, num_blocks=8, max_blocks_per_seq=4)
    assert np.isfinite(runner.prefill_logits(PROMPTS[1])).all()

    from safetensors.numpy import save_file

    from jaxserve.loader.export import _host_arrays, hf_config
    cfg, weights = load_model(path, "float32")
    (tmp_path / "config.json").write_text(json.dumps(hf_config(cfg, "float32")))
    save_file(_host_arrays(cfg, weights, np.float32), str(tmp_path / "model.safetensors"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    ids = PROMPTS[2]
    np.testing.assert_allclose(_hf_logprobs(back, ids), _hf_logprobs(model, ids), atol=1e-5)


@pytest.mark.parametrize("kind", ["greedy", "group_limited_greedy", "noaux_tc"])
def test_router_equals_transformers(kind):
    import jax.numpy as jnp

    from jaxserve.layers import moe
    X, k, T = 16, 3, 64
    v3 = kind == "noaux_tc"
    cfg = (transformers.DeepseekV3Config if v3 else transformers.DeepseekV2Config)(
        hidden_size=32, num_attention_heads=4, n_routed_experts=X, num_experts_per_tok=k, n_group=4, topk_group=2,
        routed_scaling_factor=1.7, norm_topk_prob=v3, **({} if v3 else dict(topk_method=kind)))
    router = (transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter if v3 else
              transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter)(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn_like(router.weight))
        if v3:
            router.e_score_correction_bias.copy_(0.3 * torch.randn(X))
        h = torch.randn(T, 32)
        _, want_w, want_ids = router(h)
        logits = jnp.asarray((h @ router.weight.T).numpy())
    bias = jnp.asarray(router.e_score_correction_bias.numpy()) if v3 else None
    w, ids = moe.route_grouped(logits, k, scoring="sigmoid" if v3 else "softmax", method=kind, n_group=4,
                               topk_group=2, renormalize=v3, scale=1.7, bias=bias)
    dense = np.zeros((T, X))
    np.put_along_axis(dense, np.asarray(ids), np.asarray(w), axis=1)
    ref = np.zeros((T, X))
    np.put_along_axis(ref, want_ids.numpy(), want_w.numpy(), axis=1)
    np.testing.assert_allclose(dense, ref, atol=1e-6)


def test_attention_kernels_refuse_the_latent_cache():
    from jaxserve.attention.backend import AttentionCase, Platform, select_backend
    case = AttentionCase("bfloat16", "bfloat16", 16, 1, 576, 16, latent=True)
    hopper = Platform("gpu", "9.0", (0, 11))
    for name in ("pallas", "mosaic", "triton"):
        with pytest.raises(ValueError, match="latent"):
            select_backend(name, case, hopper)
    assert select_backend("auto", case, hopper) == "reference"
    assert select_backend("reference", case, hopper) == "reference"


def test_deepseek_configs_jaxserve_cannot_serve_are_refused_naming_the_field():
    from jaxserve.config import ModelConfig
    hf = dict(architectures=["DeepseekV2ForCausalLM"], vocab_size=96, hidden_size=64, intermediate_size=96,
              moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, n_routed_experts=8,
              num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=12)
    cfg = ModelConfig.from_hf(hf)
    assert cfg.num_kv_heads == 1 and cfg.head_dim == 40 and cfg.moe.sparse_layers(2) == (0, 1)
    assert ModelConfig.from_hf(dict(hf, first_k_dense_replace=1, moe_layer_freq=2, num_hidden_layers=5)
                               ).moe.sparse_layers(5) == (2, 4)
    with pytest.raises(ValueError, match="topk_method"):
        ModelConfig.from_hf(dict(hf, topk_method="noaux_tc"))
    with pytest.raises(ValueError, match="n_group"):
        ModelConfig.from_hf(dict(hf, topk_method="group_limited_greedy", n_group=3, topk_group=1))
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        ModelConfig.from_hf(dict(hf, qk_rope_head_dim=7))
    with pytest.raises(ValueError, match="kv_lora_rank"):
        ModelConfig.from_hf({k: v for k, v in hf.items() if k != "kv_lora_rank"})


def _block_fp8(w: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] f32 -> (e4m3 codes, weight_scale_inv [ceil(out/b), ceil(in/b)]): amax / 448 per block."""
    import ml_dtypes
    n, k = w.shape
    s = np.zeros((-(-n // b), -(-k // b)), np.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            s[i, j] = max(np.abs(w[i * b:(i + 1) * b, j * b:(j + 1) * b]).max(), 1e-12) / 448.0
    full = np.repeat(np.repeat(s, b, 0), b, 1)[:n, :k]
    return (w / full).astype(ml_dtypes.float8_e4m3fn), s


def test_v3_fp8_block_checkpoint_loads_every_tensor(tmp_path):
    """DeepSeek V3 ships 128x128 block FP8 (weight_scale_inv): every linear layer loads as an
    Fp8Weight, MLA's kv_b (absorbed, no matmul operand) dequantised; the logits follow transformers
    on the dequantised weights (fp8 activations: near, not equal)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from safetensors import safe_open
    from safetensors.flax import save_file

    from jaxserve.layers.fp8 import Fp8Weight
    model = write_checkpoint(tmp_path, "v3")
    B = 16          # blocks smaller than the tiny matrices, with partial edge blocks (kv_a: 40 rows)
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    state = dict(model.named_parameters())
    for name in list(tensors):
        w = tensors[name]
        if w.ndim != 2 or not name.endswith("proj.weight") and "proj_with_mqa" not in name:
            continue
        q, s = _block_fp8(w, B)
        tensors[name[:-len("weight")] + "weight_scale_inv"] = s
        deq = q.astype(np.float32) * np.repeat(np.repeat(s, B, 0), B, 1)[:w.shape[0], :w.shape[1]]
        with torch.no_grad():
            if name in state:
                state[name].copy_(torch.from_numpy(deq))
            else:       # transformers holds each layer's experts fused: gate_up_proj [X, 2 Fe, E], down_proj
                layer, expert, proj = name.split(".")[2], int(name.split(".")[5]), name.split(".")[6]
                experts = model.model.layers[int(layer)].mlp.experts
                if proj == "down_proj":
                    target = experts.down_proj[expert]
                else:
                    Fe = deq.shape[0]
                    target = experts.gate_up_proj[expert, :Fe] if proj == "gate_proj" else \
                        experts.gate_up_proj[expert, Fe:]
                target.copy_(torch.from_numpy(deq))
        tensors[name] = q
    assert "model.layers.1.self_attn.kv_b_proj.weight_scale_inv" in tensors
    save_file({k: jnp.asarray(v) for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": [B, B]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg, weights = load_model(tmp_path, "float32")
    w = weights.layers
    for name in ("wq_a", "wq_b", "wkv_a", "wo", "w_gate", "ws_down"):
        assert isinstance(getattr(w, name), Fp8Weight), name
    assert isinstance(w.we_gate.w, Fp8Weight) and w.wkv_b.dtype == jnp.float32
    kv_b = state["model.layers.1.self_attn.kv_b_proj.weight"].detach().numpy()
    np.testing.assert_array_equal(np.asarray(w.wkv_b[1]), kv_b.T)
    ids = PROMPTS[2]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    # with f32 activations (W8A16) the model is the dequantised one: transformers' logits
    is_fp8 = lambda x: isinstance(x, Fp8Weight)     # noqa: E731
    w8a16 = jax.tree.map(lambda x: dataclasses.replace(x, activations="none") if is_fp8(x) else x, weights,
                         is_leaf=is_fp8)
    got = PagedRunner(cfg, w8a16, block_size=16, num_blocks=16, max_blocks_per_seq=16).prefill_logits(ids)
    assert np.abs(got - ref).max() < 1e-3
    # the checkpoint's own dynamic fp8 activations (e4m3: 2^-4 relative steps, per token, every
    # layer; routing choices flip): near (measured mean |diff| 0.13 std; unrelated logits: ~1.4 std)
    got = PagedRunner(cfg, weights, block_size=16, num_blocks=16, max_blocks_per_seq=16).prefill_logits(ids)
    assert np.abs(got - ref).mean() < 0.25 * ref.std()


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_quantized_kv_cache_holds_quantized_latents(tmp_path, kv):
    """--kv-cache-dtype fp8|int8: the latent pool quantized with one scale per token and layer (no
    V scales); prompt logprobs stay near transformers', nearer with int8's finer steps."""
    model = write_checkpoint(tmp_path, "v2-lite")
    ids = PROMPTS[2]
    ref = _hf_logprobs(model, ids)
    with LLM(model=str(tmp_path), dtype="float32", kv_cache_dtype=kv, max_model_len=256,
             max_num_batched_tokens=256, num_gpu_blocks_override=32, warmup=False, compilation_cache_dir="") as llm:
        cache = llm.llm_engine.runner.cache
        assert cache.latent and cache.dtype == np.dtype("float8_e4m3fn" if kv == "fp8" else "int8")
        assert cache.v_scale is None and cache.k_scale.shape == cache.k.shape[:-1]
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)[0]
    got = np.array([out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))])
    diff = np.abs(got - ref[np.arange(len(ids) - 1), ids[1:]])
    print(f"{kv} latent cache: |prompt logprob diff| max {diff.max():.3f} mean {diff.mean():.4f}")
    # measured on this checkpoint: int8 max 0.028 mean 0.006, fp8 max 0.23 mean 0.023
    assert (diff.max() < 0.05 and diff.mean() < 0.01) if kv == "int8" else diff.mean() < 0.05


def test_v3_routing_bias_stays_float32_in_a_bfloat16_model(tmp_path):
    """e_score_correction_bias keeps f32 (as vLLM keeps it): bf16 would round away the digits in
    which DeepSeek V3's per-expert biases differ, and with them the routing choices."""
    import jax.numpy as jnp
    write_checkpoint(tmp_path, "v3")
    for load_format in ("auto", "dummy"):
        cfg, weights = load_model(tmp_path, "bfloat16", load_format=load_format)
        assert weights.layers.e_bias.dtype == jnp.float32 and weights.layers.wkv_b.dtype == jnp.bfloat16
    runner = PagedRunner(cfg, weights, block_size=16, num_blocks=8, max_blocks_per_seq=4)
    assert np.isfinite(runner.prefill_logits(PROMPTS[1])).all()
