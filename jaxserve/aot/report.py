"""The compile report: per step program its memory, host synchronisation points and modeled HBM traffic
against the minimum; per GPU kernel its registers, spills, shared memory and CTAs per SM.

Modeled traffic (`jaxserve.aot.hlo_analysis.modeled_bytes`): every fusion, custom call, copy and
collective of the optimized HLO reads its operands and writes its result once (loops times their
trip count; in-place updates count the update; slices of a stacked operand count the slice). An
attention kernel's custom call is counted as reading the KV its tokens attend to (below), not its
whole pool operand. The minimum of a step: the weights once (one device's share; of an untied
embedding table the rows looked up; of the experts those routed to) + the KV the step's tokens
attend to + the KV it writes. The scenario each program is modeled at: a bucket of T tokens <=
max_num_seqs is T decoding sequences at a context of `CONTEXT` tokens each; a larger bucket is one
prefill chunk of T tokens from position 0. Not counted: L2 reuse, re-reads inside a kernel (a kernel
that reads a tile twice is charged once), the sampler's logits as an HBM round trip where XLA keeps
them in a fusion.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax

from jaxserve.aot import hlo_analysis
from jaxserve.aot.targets import client_memory_fraction

CONTEXT = 2048          # the decode context of the modeled scenario (tokens per sequence)


def _scenario(runner, T: int) -> tuple[int, int]:
    """(sequences, KV tokens the step attends to) of a program of T tokens (module docstring)."""
    ctx = min(CONTEXT, runner.cfg.max_model_len)
    if T <= runner.max_seqs:
        return T, T * ctx
    return 1, T


def _kv_token_bytes(s) -> float:
    """Bytes of one token's K and V (and scales) over all layers, on one device."""
    return s.bytes_per_block / s.args.block_size


def _attention_overrides(module, s, runner, T: int) -> dict[str, int]:
    """custom-call name -> modeled bytes per launch, for the calls that read a layer of the pool
    (the paged attention kernels, not a GEMM whose weight is as large, nor the experts' grouped
    matmul): q and out of T tokens plus the KV the step attends to."""
    layer_pages = s.bytes_per_block * runner.num_blocks / s.cfg.num_layers / 2     # K (or V) of one layer
    _, attended = _scenario(runner, T)
    per_layer_kv = attended * _kv_token_bytes(s) / s.cfg.num_layers
    qo = 2 * T * s.cfg.num_heads * s.cfg.head_dim * jax.numpy.dtype(s.dtype).itemsize / max(1, s.plan.tp)
    out = {}
    for comp in module.computations.values():
        for inst in comp.instructions:
            gemm = (inst.meta("custom_call_target") or "").startswith("__cublas") \
                or "grouped_matmul" in (inst.meta("op_name") or "")
            if inst.opcode == "custom-call" and not gemm and any(
                    comp.operand_bytes(inst, k) >= 0.9 * layer_pages for k in range(len(inst.operands))):
                out[inst.name] = int(per_layer_kv + qo)
    return out


def _grouped_matmul_overrides(module, s, T: int) -> dict[str, int]:
    """custom-call name -> modeled bytes per launch of the experts' grouped matmul, which takes the
    layer's whole [L, X, in, out] stack and reads only its tiles' experts: at the scenario's T
    tokens with uniform routing, P = T k X_local / X assignments here, each of the min(P, X_local)
    experts touched read once per tile of its rows (ceil(P / touched / tile) tiles), plus its rows
    of x and of the result."""
    moe = getattr(s.cfg, "moe", None)
    if moe is None:
        return {}
    out = {}
    for comp in module.computations.values():
        for inst in comp.instructions:
            if inst.opcode != "custom-call" or "grouped_matmul" not in (inst.meta("op_name") or ""):
                continue
            shapes = [hlo_analysis.dims(comp.operand_shape(inst, k)) for k in range(len(inst.operands))]
            (tiles,), (rows, K), (_, X, _, F) = shapes[1], shapes[2], shapes[3]
            tile = rows // max(tiles, 1)
            itemsize = hlo_analysis.shape_bytes(inst.shape) / max(rows * F, 1)
            P = T * moe.num_experts_per_tok * X / moe.num_experts
            touched = min(P, X)
            per_expert = math.ceil(P / max(touched, 1) / tile) if touched else 0
            out[inst.name] = int(touched * per_expert * K * F * itemsize + P * (K + F) * itemsize)
    return out


def _shard_bytes(x) -> float:
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


def _unread_embedding_bytes(s, T: int) -> float:
    """Bytes of an untied embedding table that a step of T tokens does not read (it reads T rows;
    a tied table is the head too, read whole)."""
    table = getattr(s.weights, "embed", None)
    if getattr(s.weights, "lm_head", None) is None or not isinstance(table, jax.ShapeDtypeStruct):
        return 0.0
    full = _shard_bytes(table)
    return max(0.0, full - T * full / table.shape[0])


def _unread_expert_bytes(s, T: int) -> float:
    """Bytes of the experts a step of T tokens routes to none of: of X experts, top k a token, at
    most T k are touched (uniform routing reaches that bound while T k <= X)."""
    from jaxserve.layers.experts import ExpertWeight
    moe = getattr(s.cfg, "moe", None)
    if moe is None:
        return 0.0
    stacks = [w for w in jax.tree_util.tree_leaves(s.weights, is_leaf=lambda x: isinstance(x, ExpertWeight))
              if isinstance(w, ExpertWeight)]
    total = sum(_shard_bytes(a) for w in stacks for a in jax.tree_util.tree_leaves(w))
    return total * max(0.0, 1 - T * moe.num_experts_per_tok / moe.num_experts)


def min_bytes(s, runner, T: int) -> int:
    """The fewest HBM bytes a step of T tokens can move: every weight once (of the embedding table
    the T rows looked up, of the experts those routed to), the KV it attends to, and its own
    tokens' KV written."""
    _, attended = _scenario(runner, T)
    weights = s.weight_bytes - _unread_embedding_bytes(s, T) - _unread_expert_bytes(s, T)
    return int(weights + (attended + T) * _kv_token_bytes(s))


def min_collective_bytes(s, T: int) -> int | None:
    """The fewest bytes a step of T tokens all-reduces across the devices, in the activation dtype
    (None on one device): each layer's two row-parallel sums [T, hidden] (after the attention's
    output projection and after the MLP or the experts) and the vocabulary-parallel embedding's
    one. The logits' all-gather to the sampler is not in it (the report counts it against it)."""
    if s.mesh.size == 1:
        return None
    return int((2 * s.cfg.num_layers + 1) * T * s.cfg.hidden_size * jax.numpy.dtype(s.dtype).itemsize)


def program_row(name, key, exe, text: str, s, runner, seconds: float) -> dict:
    m = exe.memory_analysis()
    T = key[0]
    syncs = hlo_analysis.host_sync_points(text)
    for point in syncs:             # "jaxserve/sample/sampler.py:150", wherever the package lives
        src = point.get("source") or ""
        point["source"] = src[src.rfind("jaxserve/"):] if "jaxserve/" in src else src or None
    module = hlo_analysis.parse_hlo(text)
    model = hlo_analysis.modeled_bytes(text, {**_attention_overrides(module, s, runner, T),
                                              **_grouped_matmul_overrides(module, s, T)})
    floor = min_bytes(s, runner, T)
    return {
        "name": name, "tokens": T, "prompt_logprobs": key[1], "compiled": True, "error": None,
        "kv_width_tokens": (key[2] if len(key) > 2 else runner.kv_widths[-1]) * runner.block_size,
        "seconds": round(seconds, 1),
        "memory": {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
                   "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes},
        "host_syncs": len(syncs), "host_sync_points": syncs,
        "modeled_bytes": int(model["total"]), "min_bytes": floor,
        "bytes_ratio": round(model["total"] / floor, 3),
        "bytes_by_kind": {k: int(v) for k, v in model["by_kind"].items()},
        "collectives": model["collectives"], "top": model["top"][:8],
        **_collective_figures(model["collectives"], min_collective_bytes(s, T)),
    }


def _collective_figures(collectives: list[dict], floor: int | None) -> dict:
    if floor is None:
        return {"collective_bytes": None, "min_collective_bytes": None, "collective_ratio": None}
    total = sum(c["bytes"] for c in collectives)
    return {"collective_bytes": total, "min_collective_bytes": floor, "collective_ratio": round(total / floor, 3)}


def failed_program(name, key, error: str) -> dict:
    return {"name": name, "tokens": key[0], "prompt_logprobs": key[1], "compiled": False, "error": error,
            "memory": None, "host_syncs": None, "modeled_bytes": None, "min_bytes": None}


def memory_check(s, runner, rows: list[dict]) -> dict:
    """Does every program fit one device (jax's share of its memory, x gpu_memory_utilization, as
    the engine sizes there), with a KV pool of at least one max_model_len sequence? (GPU targets;
    the CPU has no fixed device memory.)"""
    if not s.target.is_gpu:
        return {"checked": False}
    limit = int(s.target.memory_bytes * client_memory_fraction() * s.args.gpu_memory_utilization)
    worst = max((r["memory"]["argument"] + r["memory"]["output"] - r["memory"]["alias"] + r["memory"]["temp"]
                 for r in rows if r["compiled"]), default=0)
    pool_tokens = runner.num_blocks * runner.block_size
    return {"checked": True, "limit_bytes": limit, "largest_program_bytes": worst,
            "pool_tokens": pool_tokens, "max_model_len": s.cfg.max_model_len,
            "fits": worst <= limit and pool_tokens >= s.cfg.max_model_len}


def build(s, runner, rows: list[dict], sizing: dict, seconds: float, kernels: list[dict] | None = None) -> dict:
    return {
        "target": s.target.description(),
        "model": s.cfg.architecture, "layers": s.cfg.num_layers, "hidden": s.cfg.hidden_size,
        "dtype": jax.numpy.dtype(s.dtype).name, "kv_cache_dtype": jax.numpy.dtype(s.kv_dtype).name,
        "tensor_parallel_size": s.args.tensor_parallel_size, "expert_parallel": s.args.enable_expert_parallel,
        "quantization": s.args.quantization, "attention_backend": s.backend,
        "num_blocks": runner.num_blocks, "block_size": runner.block_size, "weight_bytes": s.weight_bytes,
        "sizing": sizing, "token_buckets": list(runner.buckets), "context_modeled": CONTEXT,
        "seconds": round(seconds, 1),
        "programs": rows, "kernels": kernels or [], "memory_check": memory_check(s, runner, rows),
    }


def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def _collectives_cell(r: dict) -> str:
    if r.get("collective_ratio") is None:
        return "-"
    return f"{r['collective_bytes'] / 1e6:.1f} / {r['min_collective_bytes'] / 1e6:.1f} = {r['collective_ratio']}"


def markdown(report: dict) -> str:
    t = report["target"]
    lines = [f"# Compile report: {report['model']} on {t['device_kind']} x {t['devices']}",
             "", f"dtype {report['dtype']}, KV {report['kv_cache_dtype']}, attention {report['attention_backend']}, "
             f"TP {report['tensor_parallel_size']}, quantization {report['quantization']}, "
             f"{report['num_blocks']} KV blocks of {report['block_size']}; {report['seconds']} s", "",
             "| program | tokens | compiled | args GB | temp GB | host syncs | modeled GB | min GB | ratio | "
             "collective MB / min |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["programs"]:
        mem = r["memory"] or {}
        lines.append(f"| {r['name']} | {r['tokens']} | {'yes' if r['compiled'] else 'no: ' + r['error'][:80]} | "
                     f"{_gb(mem.get('argument'))} | {_gb(mem.get('temp'))} | {r['host_syncs']} | "
                     f"{_gb(r['modeled_bytes'])} | {_gb(r['min_bytes'])} | {r.get('bytes_ratio', '-')} | "
                     f"{_collectives_cell(r)} |")
    syncs = {}
    for r in report["programs"]:
        for point in r.get("host_sync_points") or ():
            syncs.setdefault((point["op"], point.get("source") or point.get("op_name")), []).append(r["name"])
    if syncs:
        lines += ["", "Host synchronisation points (XLA:GPU copies a predicate to the host and waits: each "
                  "`conditional`, each `while` without a known trip count, per iteration):", ""]
        lines += [f"- {op} at {where}: {', '.join(names)}" for (op, where), names in syncs.items()]
    if report["kernels"]:
        lines += ["", "| kernel | config | registers | spill bytes | smem bytes | CTAs/SM |",
                  "| --- | --- | ---: | ---: | ---: | ---: |"]
        for k in report["kernels"]:
            cfg = ", ".join(f"{a}={b}" for a, b in (k.get("config") or {}).items())
            lines.append(f"| {k['name']} | {cfg} | {k.get('registers')} | {k.get('spill_bytes')} | "
                         f"{k.get('smem_bytes')} | {k.get('ctas_per_sm')} |")
    mc = report["memory_check"]
    if mc.get("checked"):
        lines += ["", f"Memory: largest program {_gb(mc['largest_program_bytes'])} GB of {_gb(mc['limit_bytes'])} GB "
                  f"allowed; pool {mc['pool_tokens']} tokens for max_model_len {mc['max_model_len']}: "
                  f"{'fits' if mc['fits'] else 'DOES NOT FIT'}"]
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(markdown(report))
