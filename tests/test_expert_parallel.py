"""Mixture-of-experts models over 8 simulated CPU devices, and tiny Qwen3 over TP 2/4/8: greedy
tokens equal to one device's, the collectives of the compiled step (no expert weight gathered),
per-device expert bytes, and the errors for sizes that do not divide.

Tiny random Qwen3-MoE and Mixtral checkpoints are written with transformers (seeded) and loaded
from safetensors, so the per-expert tensors are cut shard by shard under each placement. All
runs share one child process (XLA_FLAGS must be set before jax is imported).
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
from test_tensor_parallel import _check_collectives, _run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HIDDEN, VOCAB, EXPERTS = 64, 128, 8


def _save(path, config_class: str, model_class: str, **kw):
    config = getattr(transformers, config_class)(**dict(dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5), **kw))
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():       # O(1) activations: routing and tokens are not decided by noise
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(path, max_shard_size="200KB")
    from jaxserve.tokenizer.tokenizer import Tokenizer  # word-level "t0".."t127" (ids only here)
    Tokenizer.synthetic(VOCAB).backend.save(str(path / "tokenizer.json"))
    return str(path)


def _expert_bytes(r: dict, num_layers: int = 2) -> int:
    """Device 0's bytes of the stacked expert weights [L, X, ...] (L: the sparse layers)."""
    return sum(b for s, b in zip(r["weight_shapes"], r["leaf_bytes"])
               if len(s) == 4 and s[:2] == [num_layers, EXPERTS])


def test_moe_expert_and_tensor_parallel_match_one_device(tmp_path):
    """Qwen3-MoE (8 experts, top 2) and Mixtral (8 experts, top 2): TP without expert parallelism
    splits every expert's intermediate dimension; with --enable-expert-parallel each device holds
    8 / tp whole experts. Same greedy tokens as one device either way; each layer body
    all-reduces only [T, E] activations (attention output, the experts' psum), never gathers an
    expert weight; device 0's expert bytes fall as 1 / tp. A Qwen3-MoE mixing dense and MoE
    layers (decoder_sparse_step 2: dense, sparse, dense, sparse) under TP and TP x EP. (Dense
    models at TP 2, 4, 8: tests/test_tensor_parallel.py.)"""
    qwen3_moe = _save(tmp_path / "qwen3-moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, intermediate_size=96)
    mixtral = _save(tmp_path / "mixtral", "MixtralConfig", "MixtralForCausalLM",
                    num_local_experts=EXPERTS, num_experts_per_tok=2, intermediate_size=48)
    mixed = _save(tmp_path / "qwen3-moe-mixed", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=32,
                  norm_topk_prob=True, intermediate_size=96, num_hidden_layers=4,
                  decoder_sparse_step=2)
    f32 = dict(dtype="float32")
    runs = ([dict(model=qwen3_moe, tp=tp, enable_expert_parallel=ep, **f32)
             for tp, ep in ((1, False), (2, False), (2, True), (8, True))]
            + [dict(model=mixtral, tp=tp, enable_expert_parallel=ep, **f32)
               for tp, ep in ((1, False), (4, False), (4, True))]
            + [dict(model=mixed, tp=tp, enable_expert_parallel=ep, **f32)
               for tp, ep in ((1, False), (4, False), (4, True))])
    res = _run(runs)
    for name, group in (("qwen3-moe", res[0:4]), ("mixtral", res[4:7]), ("qwen3-moe-mixed", res[7:10])):
        one = group[0]
        assert not any(one["ops"].values()), name
        for run, r in zip(runs[res.index(one) + 1:], group[1:]):
            tag = (name, run["tp"], run.get("enable_expert_parallel"))
            assert r["tokens"] == one["tokens"], tag
            # embedding, attention output, the MLP (mixed: each branch of the layer's cond)
            _check_collectives(r, 4 if name == "qwen3-moe-mixed" else 3, HIDDEN, VOCAB)
            assert _expert_bytes(r) * run["tp"] == _expert_bytes(one) > 0, tag
    print({f"{run['model'].rsplit('/', 1)[1]} tp{run['tp']} ep={run.get('enable_expert_parallel')}":
           _expert_bytes(r) for run, r in zip(runs, res)})


def test_mixed_dense_and_moe_layers_load_dummy_and_quantised(tmp_path):
    """A config.json mixing dense and MoE MLPs (layers 0 and 2 dense, 1 and 3 sparse): each kind
    of MLP is stacked over its own layers, with the checkpoint layer of each stacked index;
    `--load-format dummy` generates, alone and with `--quantization fp8` (the dense MLP
    matrices and the experts become FP8, the router stays dense)."""
    import json

    from jaxserve import LLM, SamplingParams
    from jaxserve.config import ModelConfig
    from jaxserve.layers.fp8 import Fp8Weight
    from jaxserve.models.registry import get_model
    config = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": VOCAB, "hidden_size": HIDDEN,
              "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "num_experts": EXPERTS,
              "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 2,
              "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_hf(config)
    params = {p.path: p for p in get_model(cfg.architecture).declare(cfg)}
    assert params["layers.w_gate"].shape == (2, HIDDEN, 96)
    assert params["layers.we_gate"].shape == (2, EXPERTS, HIDDEN, 32)
    assert [n for _, n in params["layers.w_down"].checkpoint_names()] == [
        "model.layers.0.mlp.down_proj.weight", "model.layers.2.mlp.down_proj.weight"]
    assert params["layers.router"].checkpoint_name(1) == "model.layers.3.mlp.gate.weight"
    assert params["layers.wq"].shape[0] == 4

    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 17, 30, 42, 7]}]
    outs = {}
    for quantization in (None, "fp8"):
        with LLM(model=str(tmp_path), load_format="dummy", seed=3, max_model_len=64,
                 kv_cache_memory_bytes=8 << 20, warmup=False, quantization=quantization) as llm:
            layers = llm.llm_engine.runner.weights.layers
            if quantization:
                assert isinstance(layers.w_gate, Fp8Weight) and layers.w_gate.shape[0] == 2
                assert isinstance(layers.we_down.w, Fp8Weight) and layers.we_down.shape[:2] == (2, EXPERTS)
                assert not isinstance(layers.router, Fp8Weight)
            outs[quantization] = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert len(outs[None]) == 8 and len(set(outs[None])) > 1
    assert len(outs["fp8"]) == 8


def _cfg(**moe):
    from jaxserve.config import MoeConfig
    return types.SimpleNamespace(num_heads=8, num_kv_heads=4, intermediate_size=96, vocab_size=128,
                                 num_layers=2,
                                 moe=MoeConfig(**dict(dict(num_experts=6, num_experts_per_tok=2,
                                                           moe_intermediate_size=24), **moe)))


def _mesh(tp, ep=1):
    return types.SimpleNamespace(shape={"dp": 1, "ep": ep, "tp": tp})


def test_expert_sharding_rules_and_sizes_that_do_not_divide():
    from jaxserve.sharding.plan import plan_for
    tp = plan_for(_cfg(), _mesh(4))                     # 24 / 4: experts whole count, F split
    assert tp.mesh_axis("moe_mlp") == "tp" and tp.mesh_axis("experts") == "ep"
    assert tuple(tp.spec(("layers", "experts", "embed", "moe_mlp"))) == (None, "ep", None, "tp")
    ep = plan_for(_cfg(), _mesh(2, 3), expert_parallel=True)
    assert ep.spec(("experts", "moe_mlp", "embed"))[0] == ("ep", "tp")
    assert ep.mesh_axis("moe_mlp") is None
    with pytest.raises(ValueError, match="num_experts"):
        plan_for(_cfg(), _mesh(4), expert_parallel=True)     # 6 experts over 4 devices
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        plan_for(_cfg(moe_intermediate_size=20), _mesh(8))
    with pytest.raises(ValueError, match="num_experts"):
        plan_for(_cfg(), _mesh(1, 4))


def test_moe_config_fields_parse_per_family_and_refuse_bad_values():
    from jaxserve.config import ModelConfig, MoeConfig
    base = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}
    q = ModelConfig.from_hf(dict(base, architectures=["Qwen3MoeForCausalLM"], num_experts=8,
                                 num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32))
    assert q.qk_norm and q.head_dim == 32 and q.sliding_window is None
    assert q.moe == MoeConfig(8, 2, 32, norm_topk_prob=False)
    m = ModelConfig.from_hf(dict(base, architectures=["MixtralForCausalLM"], num_local_experts=4,
                                 num_experts_per_tok=2, sliding_window=64))
    assert m.moe == MoeConfig(4, 2, 96, norm_topk_prob=True) and not m.qk_norm
    assert m.sliding_window == 64
    assert ModelConfig.from_hf(dict(base, architectures=["Qwen3ForCausalLM"])).moe is None
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        ModelConfig.from_hf(dict(base, architectures=["Qwen3MoeForCausalLM"], num_experts=8,
                                 num_experts_per_tok=2))
    for bad, field in ((dict(num_experts_per_tok=9), "num_experts_per_tok"),
                       (dict(decoder_sparse_step=0), "decoder_sparse_step"),
                       (dict(mlp_only_layers=(-1,)), "mlp_only_layers"),
                       (dict(num_experts=0), "num_experts")):
        with pytest.raises(ValueError, match=field):
            MoeConfig(**dict(dict(num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=32), **bad))
    # which layers are sparse: transformers' rule, and the config.json fields that set it
    mixed = ModelConfig.from_hf(dict(base, architectures=["Qwen3MoeForCausalLM"], num_experts=8,
                                     num_experts_per_tok=2, moe_intermediate_size=32,
                                     num_hidden_layers=6, decoder_sparse_step=2,
                                     mlp_only_layers=[3, 5, 9]))
    assert mixed.moe.sparse_layers(mixed.num_layers) == (1,)
    assert MoeConfig(8, 2, 32, mlp_only_layers=(0,)).sparse_layers(4) == (1, 2, 3)
    assert MoeConfig(8, 2, 32, decoder_sparse_step=3).sparse_layers(6) == (2, 5)


_SHARD_CHILD = """
import jax, jax.numpy as jnp, numpy as np, types
from jaxserve.config import MoeConfig
from jaxserve.layers import moe
from jaxserve.layers.experts import ExpertWeight
from jaxserve.layers.fp8 import Fp8Weight
from jaxserve.layers.linear import DenseWeight
from jaxserve.pallas.fp8_matmul import quantize_weight
from jaxserve.sharding.mesh import make_mesh
from jaxserve.sharding.plan import plan_for, shard_experts
T, E, X, F, k = 16, 32, 8, 24, 3
ks = jax.random.split(jax.random.key(0), 5)
x = jax.random.normal(ks[0], (T, E))
wg, wu = (jax.random.normal(kk, (X, E, F)) / 6 for kk in ks[1:3])
wd = jax.random.normal(ks[3], (X, F, E)) / 5
weights, ids = moe.route(jax.random.normal(ks[4], (T, X)), k, True)
# the all-experts oracle: every expert on every token, weighted by the routing (zero elsewhere)
dense = jnp.einsum("tx,txe->te", jnp.zeros((T, X)).at[jnp.arange(T)[:, None], ids].set(weights),
                   jnp.einsum("txf,xfe->txe", jax.nn.silu(jnp.einsum("te,xef->txf", x, wg))
                              * jnp.einsum("te,xef->txf", x, wu), wd))
ew = lambda a: ExpertWeight(DenseWeight(a))
for layout in ("tiles", "ragged"):
    np.testing.assert_allclose(moe.expert_mlp(x, weights, ids, ew(wg), ew(wu), ew(wd), layout=layout), dense,
                               atol=1e-4)
cfg = types.SimpleNamespace(num_heads=8, num_kv_heads=8, intermediate_size=96, vocab_size=64,
                            num_layers=2, moe=MoeConfig(X, k, F))
for tp, ep, expert_parallel in ((2, 2, False), (2, 2, True), (4, 2, False), (2, 4, True)):
    plan = plan_for(cfg, make_mesh(tp, ep), expert_parallel)
    put = lambda a, axes: jax.device_put(a, plan.sharding(axes))
    args = (ew(put(wg, ("experts", "embed", "moe_mlp"))), ew(put(wu, ("experts", "embed", "moe_mlp"))),
            ew(put(wd, ("experts", "moe_mlp", "embed"))))
    for layout in ("tiles", "ragged"):
        fn = lambda *a, layout=layout: moe.expert_mlp(*a, layout=layout)
        out = jax.jit(lambda *a: shard_experts(plan, fn, x, weights, ids, *a))(*args)
        np.testing.assert_allclose(out, dense, atol=1e-4, err_msg=str((tp, ep, expert_parallel, layout)))
    assert args[0].w.w.addressable_shards[0].data.size * tp * ep == wg.size
    # FP8 experts (per expert and channel, or blocks): scales split with their matrices
    for granularity in ("channel", "block"):
        q = [quantize_weight(a, granularity) for a in (wg, wu, wd)]
        want = moe.expert_mlp(x, weights, ids, *(ExpertWeight(Fp8Weight(*qs, activations="none")) for qs in q))
        axes = (("experts", "embed", "moe_mlp"),) * 2 + (("experts", "moe_mlp", "embed"),)
        fp8 = [ExpertWeight(Fp8Weight(put(c, ax), s, activations="none")) for (c, s), ax in zip(q, axes)]
        out = jax.jit(lambda *a: shard_experts(plan, moe.expert_mlp, x, weights, ids, *a))(*fp8)
        np.testing.assert_allclose(out, want, atol=1e-4, err_msg=str((tp, ep, expert_parallel, granularity)))
print("OK")
"""


def test_shard_experts_over_ep_and_tp_mesh_axes_equals_all_experts_oracle():
    """expert_mlp (tiles of routed rows, and ragged_dot over tokens sorted by expert) equals
    computing every expert on every token and weighting by the routing; shard_experts on
    dp x ep x tp meshes with both axes > 1 (experts over ep and F over tp, or whole experts over
    ep x tp) gives the same result, for dense and FP8 (per-channel, block) experts."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _SHARD_CHILD], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-4000:]
