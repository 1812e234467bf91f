"""Tensor parallelism on 8 simulated CPU devices: greedy tokens equal to one device's, the
collectives of the compiled step, per-device bytes, and the errors for sizes that do not divide.

Each model runs in its own process (XLA_FLAGS must be set before jax is imported), all its TP
sizes in that one process to pay the start-up once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

TINY = Path(__file__).parent / "data" / "tiny-llama"

# Runs in the child: greedy tokens, the step's collectives and per-device bytes for each TP size.
_CHILD = textwrap.dedent("""
    import json, re, sys
    import jax
    from jaxserve import LLM, SamplingParams
    runs = json.loads(sys.argv[1])
    assert len(jax.devices()) == 8
    PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    result = []
    for run in runs:
        model, tp, kwargs = run.pop("model"), run.pop("tp"), run
        try:
            llm = LLM(model=model or None, tensor_parallel_size=tp, max_model_len=128,
                      max_num_batched_tokens=16, max_num_seqs=8, num_gpu_blocks_override=32,
                      warmup=False, compilation_cache_dir="", program_cache_dir="", **kwargs)
        except ValueError as e:       # a refused configuration: the message is the result
            result.append(dict(error=str(e)))
            continue
        with llm:
            pages = llm.llm_engine.runner.cache.k
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                use_tqdm=False)
            runner = llm.llm_engine.runner
            assert pages.is_deleted(), "the KV pool was copied, not donated"
            hlo = runner._executable(16, False).as_text()
            ops = {op: [m.group(1) for m in re.finditer(r"= (\\S+) " + op + r"(?:-start)?\\(", hlo)]
                   for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")}
            dev0 = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
            result.append(dict(tokens=[o.outputs[0].token_ids for o in outs], ops=ops,
                              weight_bytes=dev0(runner.weights), kv_bytes=dev0(runner.cache),
                               weight_shapes=[list(x.shape) for x in jax.tree.leaves(runner.weights)],
                               leaf_bytes=[dev0(x) for x in jax.tree.leaves(runner.weights)],
                               leaf_total=[x.nbytes for x in jax.tree.leaves(runner.weights)],
                               leaf_dtypes=[x.dtype.name for x in jax.tree.leaves(runner.weights)],
                               accepted=llm.llm_engine.stats().spec_num_accepted_tokens))
    print("RESULT" + json.dumps(result))
""")


def _run(runs: list[dict]) -> list[dict]:
    """Each run: {"model": path or "" (the default model), "tp": size, **LLM kwargs}."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(runs)],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return json.loads(lines[0][len("RESULT"):])


def _shape(hlo_type: str) -> list[int]:
    """'f32[16,256]{1,0}' -> [16, 256]."""
    return [int(d) for d in hlo_type.split("[")[1].split("]")[0].split(",") if d]


def _check_collectives(r: dict, all_reduces: int, hidden: int, vocab: int):
    """All-reduces only of [T, E] activations (embedding lookup, then the row-parallel matmuls
    of one layer body), the one all-gather is of logit rows, never of a weight."""
    ops = r["ops"]
    assert len(ops["all-reduce"]) == all_reduces, ops
    assert all(_shape(t) == [16, hidden] for t in ops["all-reduce"]), ops
    gathered = [_shape(t) for t in ops["all-gather"]]
    assert all(s[-1] == vocab and s[0] <= 16 for s in gathered), ops
    assert not any(s in r["weight_shapes"] or s[::-1] in r["weight_shapes"] for s in gathered)
    assert not ops["reduce-scatter"] and not ops["all-to-all"], ops


def test_tensor_parallel_tiny_llama_and_qwen3_match_one_device(tmp_path):
    """8 heads, 4 KV heads: TP 2 and 4 split the KV heads, TP 8 repeats each in the cache (two
    devices per KV head). Same greedy tokens as one device; wo and w_down all-reduce; bytes
    fall with TP. Also: the Pallas kernel (interpret mode) inside the shard_map at TP 8,
    and a Qwen3 (q/k norms) with an int8 KV cache (per-head scales split with the pages) at TP 4,
    and a draft model at TP 2 (the model as its own draft, its KV pool split like the target's)."""
    cfg = json.loads((TINY / "config.json").read_text())
    cfg.update(num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    llama, qwen3 = tmp_path / "llama", tmp_path / "qwen3"
    for d, arch in ((llama, "LlamaForCausalLM"), (qwen3, "Qwen3ForCausalLM")):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(dict(cfg, architectures=[arch])))
    dummy = dict(load_format="dummy", seed=0, dtype="float32")
    res = _run([dict(model=str(llama), tp=tp, **dummy) for tp in (1, 2, 4, 8)]
               + [dict(model=str(llama), tp=8, attention_backend="pallas", **dummy)]
               + [dict(model=str(qwen3), tp=tp, kv_cache_dtype="int8", **dummy) for tp in (1, 4)]
               + [dict(model=str(llama), tp=2, **dummy,
                       speculative_config={"model": str(llama), "num_speculative_tokens": 3})])
    one = res[0]
    assert not any(one["ops"].values())
    for tp, r in zip((2, 4, 8), res[1:4]):
        assert r["tokens"] == one["tokens"], tp
        _check_collectives(r, 3, cfg["hidden_size"], cfg["vocab_size"])
        # whole on every device: the norms, and at TP 8 the K/V projections (their heads repeat)
        kv_proj = 2 * cfg["num_hidden_layers"] * cfg["hidden_size"] * 4 * 64 * 4 if tp == 8 else 0
        assert r["weight_bytes"] < (one["weight_bytes"] / tp + kv_proj) * 1.05, (tp, r["weight_bytes"])
        assert r["kv_bytes"] * min(tp, 4) == one["kv_bytes"], (tp, r["kv_bytes"])
    assert res[4]["tokens"] == one["tokens"]     # Pallas per device
    assert res[6]["tokens"] == res[5]["tokens"]
    _check_collectives(res[6], 3, cfg["hidden_size"], cfg["vocab_size"])
    assert res[6]["kv_bytes"] * 4 == res[5]["kv_bytes"]     # int8 pages and their scales split
    assert res[7]["tokens"] == one["tokens"] and res[7]["accepted"] > 0     # draft model at TP 2


def test_tensor_parallel_default_model_matches_one_device():
    """SmolLM2-135M: 9 heads and 3 KV heads split over none of 2, 4, 8, so attention is
    replicated (and its KV pool whole on each device); the MLP and vocabulary still split.
    TP 8 only: 2 and 4 take the same path (the plan test) and each size costs ~20 s here.
    Also `--quantization fp8` (per-channel, W8A16 on CPU) at TP 4: real weights, the same greedy
    tokens as its TP 1, the MLP's e4m3 codes split."""
    one, r, fp8_one, fp8_tp4 = _run([dict(model="", tp=1), dict(model="", tp=8),
                                     dict(model="", tp=1, quantization="fp8"),
                                     dict(model="", tp=4, quantization="fp8")])
    for tp in (8,):
        assert r["tokens"] == one["tokens"], tp
        _check_collectives(r, 2, 576, 49152)
        assert r["weight_bytes"] < one["weight_bytes"] * 0.8, (tp, r["weight_bytes"])
        assert r["kv_bytes"] == one["kv_bytes"]
    assert fp8_tp4["tokens"] == fp8_one["tokens"]
    _check_collectives(fp8_tp4, 2, 576, 49152)
    assert fp8_tp4["weight_bytes"] < fp8_one["weight_bytes"] * 0.4, fp8_tp4["weight_bytes"]


def test_fp8_checkpoints_and_quantization_fp8_match_one_device(tmp_path):
    """FP8 weights split like the dense ones: an HF block-scaled checkpoint (W8A8 per 1 x 128
    group), a compressed-tensors per-channel one (W8A8 per token) and `--quantization fp8`
    give TP 1's greedy tokens at TP 4 (the checkpoints) and 2 (`--quantization fp8`); each
    device holds 1 / tp of the e4m3 codes and of their scales; no weight is gathered. At TP 8
    the MLP's 512 features split 64 per device, half a 128-wide scale block: refused, naming
    the sizes."""
    from test_fp8 import _write_checkpoint

    from jaxserve.tokenizer.tokenizer import Tokenizer
    shape = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=128)   # every split 128-aligned
    block, channel = tmp_path / "block", tmp_path / "channel"
    for d, fmt in ((block, "hf-fp8-block"), (channel, "ct-channel-w8a8")):
        _write_checkpoint(d, fmt, **shape)
        Tokenizer.synthetic(1024).backend.save(str(d / "tokenizer.json"))     # prompts are token ids
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps(json.loads((TINY / "config.json").read_text()) | shape))
    f32 = dict(dtype="float32")
    quant = dict(load_format="dummy", seed=0, quantization="fp8", **f32)
    runs = ([dict(model=str(block), tp=tp, **f32) for tp in (1, 4, 8)]
            + [dict(model=str(channel), tp=tp, **f32) for tp in (1, 4)]
            + [dict(model=str(dense), tp=tp, **quant) for tp in (1, 2)])
    res = _run(runs)
    groups = [(res[0], {4: res[1]}), (res[3], {4: res[4]}), (res[5], {2: res[6]})]
    for one, by_tp in groups:
        for tp, r in by_tp.items():
            assert r["tokens"] == one["tokens"], tp
            # the row-parallel matmuls' partial sums, and with per-token W8A8 their inputs'
            # per-token amax [16] (the same scale as on one device); no weight is gathered
            reduced = [_shape(t) for t in r["ops"]["all-reduce"]]
            assert reduced.count([16, 256]) == 3 and all(t in ([16, 256], [16]) for t in reduced), reduced
            _check_collectives(dict(r, ops=dict(r["ops"], **{"all-reduce": []})), 0, 256, 1024)
            fp8 = [i for i, d in enumerate(r["leaf_dtypes"]) if d == "float8_e4m3fn"]
            assert len(fp8) == 7, r["leaf_dtypes"]
            assert all(r["leaf_bytes"][i] * tp == r["leaf_total"][i] for i in fp8), tp
            # the scales: the leaf after each codes leaf, split as the codes are (per-channel
            # scales of wo / w_down are whole: their output, the embedding, is not split)
            split_scales = [i + 1 for i in fp8 if r["leaf_bytes"][i + 1] * tp == r["leaf_total"][i + 1]]
            assert len(split_scales) >= 5, (tp, [r["leaf_bytes"][i + 1] for i in fp8])
    assert "error" in res[2] and "64 of the weight's 512" in res[2]["error"], res[2]


def _cfg(**kw):
    return types.SimpleNamespace(**dict(num_heads=8, num_kv_heads=4, intermediate_size=512,
                                        vocab_size=1024) | kw)


def _mesh(tp):
    return types.SimpleNamespace(shape={"dp": 1, "ep": 1, "tp": tp})


def test_sharding_plan_splits_repeats_or_replicates_heads():
    from jaxserve.sharding.plan import plan_for
    split = plan_for(_cfg(), _mesh(4))
    assert split.kv_repeat == 1 and split.mesh_axis("kv_heads") == "tp"
    assert split.kv_heads_per_device(4) == 1
    repeat = plan_for(_cfg(), _mesh(8))
    assert repeat.kv_repeat == 2 and repeat.mesh_axis("kv_heads") is None
    assert repeat.mesh_axis("kv_cache_heads") == "tp" and repeat.kv_heads_per_device(4) == 1
    whole = plan_for(_cfg(num_heads=9, num_kv_heads=3), _mesh(2))
    assert whole.mesh_axis("q_heads") is None and whole.kv_heads_per_device(3) == 3
    assert whole.mesh_axis("mlp") == "tp"


def test_sizes_that_do_not_divide_or_exceed_the_devices_are_refused():
    from jaxserve.config import ParallelConfig
    from jaxserve.sharding.mesh import make_mesh
    from jaxserve.sharding.plan import plan_for
    with pytest.raises(ValueError, match="intermediate_size"):
        plan_for(_cfg(intermediate_size=510), _mesh(4))
    with pytest.raises(ValueError, match="devices, but only"):
        make_mesh(tensor_parallel_size=64)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0)
