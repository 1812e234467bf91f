"""Weights in host memory (`--cpu-offload-gb`, `layers/host_weights.py`): the largest stacked layer
weights up to N GiB per device live in `pinned_host` memory and the layer scan copies each layer's
slice to the device inside the step. Greedy tokens are identical to weights kept on the device."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from jaxserve.sampling_params import SamplingParams

TINY = str(Path(__file__).resolve().parent / "data" / "tiny-llama")
MIB = 2**20 / 2**30


def _llm(**kw):
    from jaxserve import LLM
    return LLM(model=TINY, load_format="dummy", max_model_len=128, dtype="float32", num_gpu_blocks_override=64,
               max_num_batched_tokens=64, warmup=False, compilation_cache_dir="", program_cache_dir="", **kw)


def _kinds(llm) -> dict[str, str]:
    layers = llm.llm_engine.runner.weights.layers
    return {k: getattr(layers, k).w.sharding.memory_kind for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}


def test_half_the_layer_weights_in_host_memory_give_identical_greedy_tokens():
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, {"prompt_token_ids": list(range(20, 60))}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = {}
    # the tiny model's layer matrices: w_gate, w_up, w_down 1 MiB each, wq, wo 0.5 MiB, wk, wv 0.25 MiB
    for gib in (0, 2.5 * MIB):
        with _llm(cpu_offload_gb=gib) as llm:
            kinds = _kinds(llm)
            out[gib] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            hlo = llm.llm_engine.runner._executable(64, False).as_text()
        if gib:
            # largest first, then what still fits: two 1 MiB MLP stacks and a 0.5 MiB one
            assert sorted(k for k, v in kinds.items() if v == "pinned_host") == ["w_gate", "w_up", "wq"]
            assert "S(5)" in hlo.split("entry_computation_layout", 1)[1].split("\n", 1)[0]
        else:
            assert set(kinds.values()) == {"device"} and "S(5)" not in hlo
    assert out[0] == out[2.5 * MIB]


def test_offload_takes_the_largest_stacks_that_fit():
    import dataclasses

    import jax.numpy as jnp

    from jaxserve.layers.host_weights import offload_layer_weights
    from jaxserve.layers.linear import DenseWeight
    from jaxserve.models.llama import LayerWeights

    def mk(*shape):
        return DenseWeight(jax.device_put(jnp.zeros(shape, jnp.float32), jax.devices()[0]))

    W = dataclasses.make_dataclass("W", [("layers", LayerWeights)])
    w = W(LayerWeights(attn_norm=jnp.zeros((2, 8)), wq=mk(2, 64, 64), wk=mk(2, 64, 16), wv=mk(2, 64, 16),
                       wo=mk(2, 64, 64), mlp_norm=jnp.zeros((2, 8)), w_gate=mk(2, 64, 256),
                       w_up=mk(2, 64, 256), w_down=mk(2, 256, 64)))
    # 128 KiB MLP stacks, 32 KiB wq / wo, 8 KiB wk / wv; room for two MLP stacks and 40 KiB
    moved, n = offload_layer_weights(w, (2 * 131072 + 40960) / 2**30)
    on = [f for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
          if getattr(moved.layers, f).w.sharding.memory_kind == "pinned_host"]
    assert on == ["wq", "wk", "w_gate", "w_up"] and n == 2 * 131072 + 32768 + 8192
    assert offload_layer_weights(w, 0)[1] == 0


def test_cpu_offload_gb_must_not_be_negative():
    from jaxserve.config import EngineArgs
    with pytest.raises(ValueError, match="cpu_offload_gb must be >= 0"):
        EngineArgs(cpu_offload_gb=-1)


def test_a_program_for_host_weights_is_another_program_in_the_caches():
    """The offline LLM's program cache and compiled directories key programs by their weights'
    signature: one compiled for resident weights must not be loaded for offloaded ones."""
    from jaxserve.aot.store import _spec_signature
    from jaxserve.layers.host_weights import to_host
    dev = jax.ShapeDtypeStruct((2, 8, 8), jax.numpy.float32,
                               sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    assert _spec_signature([dev]) != _spec_signature([to_host(dev)])
    assert _spec_signature([dev]) == _spec_signature([jax.ShapeDtypeStruct((2, 8, 8), jax.numpy.float32)])
