"""The model layer's contracts: weight types dispatch `linear`, each model's one weight
declaration drives loading, dummy weights and sharding, and the 8B shapes check abstractly."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.layers.linear import DenseWeight, linear, register_linear
from jaxserve.loader.loader import load_hf_config
from jaxserve.models import SUPPORTED_ARCHITECTURES, get_model
from jaxserve.models.params import abstract_weights, num_parameters
from jaxserve.sharding.rules import LOGICAL_AXES, partition_spec

CONFIGS = Path(__file__).resolve().parent.parent / "benchmarks" / "configs"
TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "eos_token_id": 2, "tie_word_embeddings": False}


def test_linear_dispatches_on_the_weight_type():
    x = jax.random.normal(jax.random.key(0), (3, 8))
    w = jax.random.normal(jax.random.key(1), (8, 5))
    np.testing.assert_allclose(linear(x, DenseWeight(w)), x @ w, rtol=1e-5, atol=1e-5)

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class ScaledWeight:        # what an fp8 type does: codes plus a scale, its own kernel
        codes: jax.Array
        scale: jax.Array

    @register_linear(ScaledWeight)
    def _scaled(x, weight):
        return (x @ weight.codes) * weight.scale

    got = jax.jit(linear)(x, ScaledWeight(w, jnp.float32(0.5)), jnp.ones(5))
    np.testing.assert_allclose(got, 0.5 * (x @ w) + 1, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="no linear kernel registered for weight type ndarray"):
        linear(x, np.asarray(w))


@pytest.mark.parametrize("extra", [{}, {"architectures": ["Qwen2ForCausalLM"]},
                                   {"architectures": ["Qwen3ForCausalLM"], "head_dim": 32},
                                   {"tie_word_embeddings": True},
                                   {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
                                    "num_experts_per_tok": 2, "moe_intermediate_size": 32},
                                   {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
                                    "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                    "mlp_only_layers": [1]},
                                   {"architectures": ["MixtralForCausalLM"],
                                    "num_local_experts": 4, "num_experts_per_tok": 2}])
def test_declaration_covers_the_pytree_and_every_axis_has_a_rule(extra):
    cfg = ModelConfig.from_hf({**TINY, **extra})
    model = get_model(cfg.architecture)
    params = model.declare(cfg)
    assert len({p.path for p in params}) == len(params)
    for p in params:
        assert set(p.axes) <= set(LOGICAL_AXES), p
        partition_spec(p.axes)
    arrays = {p.path: jnp.zeros(p.shape) for p in params}
    weights = model.build(cfg, arrays)
    leaves = jax.tree_util.tree_leaves(weights)
    assert len(leaves) == len(params)          # nothing undeclared, nothing dropped
    assert sum(x.size for x in leaves) == num_parameters(params)
    assert (weights.lm_head is None) == cfg.tie_word_embeddings
    assert isinstance(weights.layers.wq, DenseWeight)


@pytest.mark.parametrize("name, params", [("llama-3.1-8b", 8_030_261_248),
                                          ("qwen3-8b", 8_190_735_360)])
def test_8b_configs_check_abstractly_without_allocating(name, params):
    from jaxserve.loader.dummy import dummy_weights
    cfg = load_hf_config(CONFIGS / name)
    decl = get_model(cfg.architecture).declare(cfg)
    assert num_parameters(decl) == params
    shapes = jax.eval_shape(lambda: dummy_weights(cfg, jnp.bfloat16))
    leaves = jax.tree_util.tree_leaves(shapes)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(x.size for x in leaves) == params
    assert sum(x.size * x.dtype.itemsize for x in leaves) == 2 * params      # bf16 bytes
    assert abstract_weights(decl, jnp.bfloat16)["layers.wq"].shape == (cfg.num_layers,
                                                                       cfg.hidden_size, 4096)


def test_qwen3_30b_a3b_checks_abstractly_with_its_published_parameter_count():
    """128 experts of 768 stacked [L, X, ...]: 30,532,122,624 parameters, as published."""
    from jaxserve.loader.dummy import dummy_weights
    cfg = load_hf_config(CONFIGS / "qwen3-30b-a3b")
    assert cfg.moe.num_experts == 128 and cfg.moe.num_experts_per_tok == 8 and cfg.qk_norm
    decl = get_model(cfg.architecture).declare(cfg)
    assert num_parameters(decl) == 30_532_122_624
    shapes = jax.eval_shape(lambda: dummy_weights(cfg, jnp.bfloat16))
    assert shapes.layers.we_down.shape == (48, 128, 768, 2048)
    assert shapes.layers.w_gate is None and shapes.layers.router.shape == (48, 2048, 128)
    assert "Qwen3MoeForCausalLM" in SUPPORTED_ARCHITECTURES


@pytest.fixture(scope="module")
def dummy_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-dummy")
    (d / "config.json").write_text(json.dumps(TINY))
    return d


def test_dummy_model_generates_from_config_json_alone(dummy_dir):
    from jaxserve import LLM, SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 300, 42]}, "t7 t8 t9 t10"]
    with LLM(model=str(dummy_dir), load_format="dummy", seed=1, max_model_len=64,
             kv_cache_memory_bytes=8 << 20, warmup=False) as llm:
        outs = llm.generate(prompts, sp, use_tqdm=False)
        again = llm.generate(prompts, sp, use_tqdm=False)
    assert outs[1].prompt_token_ids == [7, 8, 9, 10]            # the synthetic tokenizer
    for out, rep in zip(outs, again):
        ids = out.outputs[0].token_ids
        assert len(ids) == 12 and len(set(ids)) > 1 and all(0 <= t < 512 for t in ids)
        assert ids == rep.outputs[0].token_ids
        assert out.outputs[0].text.split() == [f"t{t}" for t in ids]
    with LLM(model=str(dummy_dir), load_format="dummy", seed=2, max_model_len=64,
             kv_cache_memory_bytes=8 << 20, warmup=False) as other:
        assert other.generate(prompts[:1], sp, use_tqdm=False)[0].outputs[0].token_ids != \
            outs[0].outputs[0].token_ids


def test_load_format_is_validated():
    from jaxserve.config import EngineArgs
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy, got 'pt'"):
        EngineArgs(load_format="pt")


def test_mesh_and_rules_place_weights_on_eight_devices(dummy_dir):
    """In a fresh process with 8 host devices: a tp=4 mesh, dummy weights placed by the rules
    (heads, MLP and vocab split over tp; norms replicated), the same values as on one device."""
    code = textwrap.dedent(f"""
        import jax, jax.numpy as jnp, numpy as np
        from jaxserve.loader.dummy import dummy_weights
        from jaxserve.loader.loader import load_hf_config
        from jaxserve.sharding.mesh import make_mesh
        assert len(jax.devices()) == 8
        from pathlib import Path
        cfg = load_hf_config(Path({str(dummy_dir)!r}))
        mesh = make_mesh(tensor_parallel_size=4, data_parallel_size=2)
        assert dict(mesh.shape) == {{"dp": 2, "ep": 1, "tp": 4}}
        w = dummy_weights(cfg, jnp.float32, make_mesh(tensor_parallel_size=4), seed=3)
        assert w.layers.wq.w.sharding.spec == jax.sharding.PartitionSpec(None, None, "tp")
        assert len(w.layers.wq.w.addressable_shards) == 4
        assert w.layers.wq.w.addressable_shards[0].data.shape == (2, 64, 16)
        assert w.embed.sharding.spec == jax.sharding.PartitionSpec("tp", None)
        assert w.final_norm.sharding.is_fully_replicated
        one = dummy_weights(cfg, jnp.float32, make_mesh(devices=jax.devices()[:1]), seed=3)
        np.testing.assert_array_equal(np.asarray(w.layers.w_down.w),
                                      np.asarray(one.layers.w_down.w))
        try:
            make_mesh(tensor_parallel_size=16)
        except ValueError as e:
            assert "16 devices, but only 8" in str(e)
        else:
            raise AssertionError("no error")
        print("OK")
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_carried_cpu_tokens_of_the_dummy_tiny_llama_are_current():
    """The GPU suite compares against tests/data/tiny-llama/cpu_greedy.json: it must be what
    the CPU computes today (regenerate with `python benchmarks/make_cpu_tokens.py`)."""
    sys.path.insert(0, str(CONFIGS.parent))
    import make_cpu_tokens as m

    from jaxserve import LLM
    want = json.loads((Path(m.TINY) / "cpu_greedy.json").read_text())
    assert want["prompts"] == m.prompts()
    with LLM(model=m.TINY, attention_backend="reference", **want["settings"]) as llm:
        assert m.greedy(llm) == want["tokens"]
