"""Multi-LoRA under tensor parallelism (simulated CPU devices, in a child process so XLA_FLAGS
is set before jax loads): TP 2 gives TP 1's greedy tokens for a batch mixing two adapters and
the base model, and the slot tables are split like their base matrix (A on its input dim, B on
its output dim)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("peft")

_CHILD = textwrap.dedent("""
    import json, sys
    import jax
    from jaxserve import LLM, LoRARequest, SamplingParams
    base, adapters = sys.argv[1], json.loads(sys.argv[2])
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)]
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17], [3, 4])]
    result = {}
    for tp in (1, 2):
        with LLM(model=base, tensor_parallel_size=tp, dtype="float32", enable_lora=True, max_loras=2,
                 max_lora_rank=8, max_model_len=64, max_num_seqs=4, num_gpu_blocks_override=32,
                 warmup=False, compilation_cache_dir="") as llm:
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                use_tqdm=False, lora_request=[loras[0], None, loras[1]])
            layers = llm.llm_engine.runner.weights.layers
            specs = {n: [str(getattr(layers, n).a.sharding.spec), str(getattr(layers, n).b.sharding.spec)]
                     for n in ("wq", "wo", "w_up", "w_down")}
            result[tp] = dict(tokens=[o.outputs[0].token_ids for o in outs], specs=specs)
    print("RESULT" + json.dumps(result))
""")


def test_tp2_tokens_equal_tp1_with_mixed_adapters(tmp_path):
    from lora_helpers import ALL_TARGETS, hf_model, write_adapter, write_tiny
    base = write_tiny(tmp_path / "base")
    model = hf_model(base)
    adapters = [str(write_adapter(model, tmp_path / "a0", r=8, targets=ALL_TARGETS, seed=1)),
                str(write_adapter(model, tmp_path / "a1", r=4, targets=("q_proj", "down_proj"), seed=2))]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(base), json.dumps(adapters)],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    res = json.loads(lines[0][len("RESULT"):])
    assert res["2"]["tokens"] == res["1"]["tokens"]
    specs = res["2"]["specs"]
    # column-parallel (wq, w_up): A whole, B split on out; row-parallel (wo, w_down): A split on in
    assert specs["wq"] == ["P(None, None, None, None)", "P(None, None, None, 'tp')"], specs
    assert specs["w_down"] == ["P(None, None, 'tp', None)", "P(None, None, None, None)"], specs
