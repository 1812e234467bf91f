"""End-to-end engine figures on a GPU with seeded dummy weights of a real model's shapes
(default: Llama-3.1-8B, bf16) — no checkpoint has to travel to the GPU machine.

    python benchmarks/bench_gpu_e2e.py                                  # H100/H200
    python benchmarks/bench_gpu_e2e.py --config benchmarks/configs/qwen3-8b --batches 1,64
    python benchmarks/bench_gpu_e2e.py --allow-cpu --config tests/data/tiny-llama  # smoke test

Three measurements through `LLMEngine` (the real scheduler, runner, sampler):
- decode step time at batch B (B requests with `--context` cached tokens, all decoding), and the
  decode roofline: bytes a step must read (all weights + every request's K/V) over the step time,
  as a fraction of the HBM peak;
- prefill MFU: a step of `--max-num-batched-tokens` prompt tokens, model FLOPs (2 x params per
  token + attention) over the step time, as a fraction of the dense bf16 peak;
- offline throughput: `LLM.generate` on `--num-prompts` prompts of `--input-len` random tokens x
  `--output-len` new tokens (EOS ignored): output tokens/s.
Prints a markdown block for benchmarks/RESULTS.md.

With `--compiled-dir DIR` (a directory `benchmarks/gpu_prepare.py` wrote with `jaxserve compile`'s
`compile_engine`) the engine is built from DIR/engine.json (the exact engine arguments the programs
were compiled for: shapes, flags, seed) and loads its step programs instead of compiling them; the
block says how many were loaded and how many compiled (a key mismatch is logged naming the fields).

    python benchmarks/bench_gpu_e2e.py --compiled-dir .gpu/compiled/8b-bf16-auto-h100 --parts decode,prefill
    python benchmarks/bench_gpu_e2e.py --parity .gpu/parity_ref.json --compiled-dir DIR [DIR ...]

`--parity REF`: each directory's engine runs the fixed parity requests (greedy, prompt and sample
logprobs) and is compared with the CPU reference gpu_prepare.py computed (`parity_reference`);
exit 1 when a figure is out of tolerance.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.models import get_model  # noqa: E402
from jaxserve.models.params import num_parameters  # noqa: E402

PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12)}   # HBM B/s, dense bf16 FLOP/s


ENGINE_JSON = "engine.json"       # in a compiled directory: the engine arguments it was compiled for
PARITY_LENS = (5, 17, 40)         # prompt lengths of the parity requests
PARITY_NEW_TOKENS = 8
PARITY_TOPK = 5


def compiled_meta(compiled_dir: str) -> dict:
    """gpu_prepare.py's note in a compiled directory: {"config", "target", "parity", "engine": the
    engine arguments the programs were compiled for}."""
    with open(os.path.join(compiled_dir, ENGINE_JSON)) as f:
        return json.load(f)


def engine_kwargs(compiled_dir: str) -> dict:
    return dict(compiled_meta(compiled_dir)["engine"])


class _Notes(logging.Handler):
    """Keeps the engine's lines about compiled programs (loaded / refused / compiled)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        msg = record.getMessage()
        if any(k in msg for k in ("compiled directory", "warm-up:", "engine ready", "attention backend:")):
            self.lines.append(msg)


def start_llm(compiled_dir: str | None, cache_dir: str | None = None, **kwargs):
    """LLM from a compiled directory's engine.json (plus `kwargs`), or from `kwargs` alone;
    returns (llm, seconds, a line saying how the step programs were obtained)."""
    if compiled_dir:
        kwargs = {**engine_kwargs(compiled_dir), "compiled_dir": compiled_dir}
    if cache_dir:
        kwargs["compilation_cache_dir"] = cache_dir
    notes = _Notes()
    log = logging.getLogger("jaxserve")
    log.addHandler(notes)
    t0 = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    finally:
        log.removeHandler(notes)
    seconds = time.perf_counter() - t0
    runner = llm.llm_engine.runner
    how = runner.programs_obtained()
    if compiled_dir:
        refused = [m for m in notes.lines if "compiled for another engine" in m or "holds no manifest" in m]
        how += (f"; compiled dir {compiled_dir}: " + ("REFUSED: " + refused[0] if refused else "matched"))
    print(f"programs: {how}; engine start {seconds:.1f} s", flush=True)
    return llm, seconds, how


def parity_prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, min(vocab, 32000) - 1, n).tolist() for n in PARITY_LENS]


def parity_run(llm) -> list[dict]:
    """The parity requests: greedy tokens with their logprobs, and every prompt token's logprob
    under the prompt before it (teacher forced: no divergence), with the top-k ids."""
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = parity_prompts(vocab)
    sp = SamplingParams(temperature=0, max_tokens=PARITY_NEW_TOKENS, ignore_eos=True,
                        logprobs=PARITY_TOPK, prompt_logprobs=PARITY_TOPK)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    rows = []
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        rows.append({
            "prompt": p,
            "prompt_lp": [d[p[i]].logprob for i, d in enumerate(o.prompt_logprobs) if d is not None],
            "prompt_top1": [max(d, key=lambda t, d=d: d[t].logprob) for d in o.prompt_logprobs if d is not None],
            "tokens": list(c.token_ids),
            "gen_lp": [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)],
        })
    return rows


def parity_compare(ref: list[dict], got: list[dict]) -> dict:
    """Max |difference| of the teacher-forced prompt logprobs and of the generated tokens'
    logprobs up to the first differing token; top-1 agreement; greedy tokens equal."""
    d_prompt, d_gen, top1, n_top1, same_tokens, spread = 0.0, 0.0, 0, 0, 0, []
    for r, g in zip(ref, got):
        a, b = np.asarray(r["prompt_lp"]), np.asarray(g["prompt_lp"])
        d_prompt = max(d_prompt, float(np.max(np.abs(a - b))))
        spread.append(float(np.std(a)))
        top1 += sum(int(x == y) for x, y in zip(r["prompt_top1"], g["prompt_top1"]))
        n_top1 += len(r["prompt_top1"])
        n = 0
        while n < min(len(r["tokens"]), len(g["tokens"])) and r["tokens"][n] == g["tokens"][n]:
            n += 1
        same_tokens += int(r["tokens"] == g["tokens"])
        k = min(n + 1, len(r["gen_lp"]), len(g["gen_lp"]))    # the first differing one too
        if k:
            d_gen = max(d_gen, float(np.max(np.abs(np.asarray(r["gen_lp"][:k]) - np.asarray(g["gen_lp"][:k])))))
    return {"max_prompt_lp_diff": d_prompt, "max_gen_lp_diff": d_gen, "top1_agree": top1 / max(n_top1, 1),
            "same_greedy": f"{same_tokens}/{len(ref)}", "ref_lp_std": float(np.mean(spread))}


def parity_main(args) -> int:
    """--parity REF --compiled-dir DIR...: each directory's engine against the CPU reference."""
    with open(args.parity) as f:
        ref = json.load(f)
    kind = jax.devices()[0].device_kind
    print(f"### Parity on {kind}: GPU engine (programs from `jaxserve compile`) vs the CPU reference\n")
    print(f"Reference: {ref['about']}\n")
    print("| config | attention | programs | max Δ prompt logprob | max Δ generated logprob | tolerance | "
          "top-1 agree | greedy equal | ref logprob std | verdict |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    bad = 0
    for d in args.compiled_dir:
        try:
            meta = compiled_meta(d)
            name = meta["config"]
            entry = ref["configs"].get(meta["parity"])
            if entry is None:
                raise KeyError(f"no reference {meta['parity']!r} for {name} in {args.parity}")
            llm, _, how = start_llm(d, args.compilation_cache_dir)
            got = parity_run(llm)
            backend = llm.llm_engine.attention_backend
            llm.shutdown()
            m = parity_compare(entry["rows"], got)
            tol = entry["tolerance"]
            ok = m["max_prompt_lp_diff"] <= tol and m["max_gen_lp_diff"] <= tol
            bad += not ok
            short = how.split(";")[0]
            print(f"| {name} | {backend} | {short} | {m['max_prompt_lp_diff']:.4f} | {m['max_gen_lp_diff']:.4f} | "
                  f"{tol:.4f} | {100 * m['top1_agree']:.0f}% | {m['same_greedy']} | {m['ref_lp_std']:.3f} | "
                  f"{'ok' if ok else 'FAIL'} |", flush=True)
        except Exception as e:       # noqa: BLE001 - one config's failure is a row, the next runs
            bad += 1
            name = os.path.basename(os.path.normpath(d))
            print(f"| {name} | - | - | - | - | - | - | - | - | error: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:120] if str(e) else ''} |", flush=True)
    return 1 if bad else 0


def _peaks():
    kind = jax.devices()[0].device_kind
    for name, peak in PEAKS.items():
        if name in kind:
            return kind, peak
    return kind, (None, None)


def _random_prompts(rng, n, length, vocab):
    return [{"prompt_token_ids": rng.integers(100, vocab - 100, length).tolist()}
            for _ in range(n)]


def decode_step_time(llm, rng, batch, context, steps):
    """Seconds per engine step once `batch` requests with `context` tokens are all decoding."""
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i, p in enumerate(_random_prompts(rng, batch, context, vocab)):
        engine.add_request(f"d{batch}-{i}", p, sp)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()                          # prefill (chunked), until every request decodes
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = (time.perf_counter() - t0) / steps
    engine.abort_request(list(engine.scheduler.requests))
    while engine.has_unfinished_requests():
        engine.step()
    return dt


def prefill_step_time(llm, rng, tokens, repeats=3):
    """Seconds of one step that prefills `tokens` prompt tokens (one request)."""
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    times = []
    for k in range(repeats + 1):
        engine.add_request(f"p{k}", _random_prompts(rng, 1, tokens, vocab)[0],
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            engine.step()
    return min(times[1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "configs",
                                                     "llama-3.1-8b"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per decode request")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per batch")
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--quantization", default=None,
                    help="e.g. fp8: the dummy weights quantised on load (vLLM's flag)")
    ap.add_argument("--allow-cpu", action="store_true")
    ap.add_argument("--compiled-dir", nargs="+", default=None, metavar="DIR",
                    help="a directory of programs compiled ahead of time (gpu_prepare.py): the engine takes its "
                         "arguments from DIR/engine.json (--config, --dtype, --attention-backend, --quantization "
                         "and --max-num-batched-tokens are then ignored) and loads its programs; several with --parity")
    ap.add_argument("--compilation-cache-dir", default=None,
                    help="JAX's persistent compilation cache for what is still compiled (eager ops, the dummy "
                         "weights' initialisers): repeats across the suite's processes become loads")
    ap.add_argument("--parts", default="decode,prefill,offline",
                    help="comma list of decode, prefill, offline: the measurements to run")
    ap.add_argument("--parity", default=None, metavar="REF.json",
                    help="compare each --compiled-dir engine with this CPU reference instead of timing")
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.allow_cpu:
        print("bench_gpu_e2e: no GPU; pass --allow-cpu with a tiny --config to smoke-test it")
        return 0
    if args.parity:
        if not args.compiled_dir:
            ap.error("--parity needs --compiled-dir")
        return parity_main(args)
    parts = {p for p in args.parts.split(",") if p}
    batches = [int(b) for b in args.batches.split(",")] if "decode" in parts else []
    compiled_dir = args.compiled_dir[0] if args.compiled_dir else None
    if compiled_dir:
        kw = engine_kwargs(compiled_dir)
        args.config, args.dtype = kw["model"], kw.get("dtype", args.dtype)
        args.quantization = kw.get("quantization")
        args.attention_backend = kw.get("attention_backend", "auto")
        args.max_num_batched_tokens = kw["max_num_batched_tokens"]
        max_len, seqs = kw.get("max_model_len"), kw.get("max_num_seqs", 256)
        need = max(args.context + args.steps + 16 if batches else 0,
                   args.input_len + args.output_len if "offline" in parts else 0)
        if max_len is None or need > max_len or max(batches + [0]) > seqs:
            print(f"bench_gpu_e2e: {compiled_dir} was compiled for max_model_len {max_len}, max_num_seqs "
                  f"{seqs}: too small for these measurements (need {need} tokens, batch "
                  f"{max(batches + [0])})", file=sys.stderr)
            return 2
        llm, start_s, how = start_llm(compiled_dir, args.compilation_cache_dir)
    else:
        max_len = max(args.context + args.steps + 16, args.input_len + args.output_len,
                      args.max_num_batched_tokens + 8)
        llm, start_s, how = start_llm(
            None, args.compilation_cache_dir, model=args.config, load_format="dummy", dtype=args.dtype,
            seed=0, max_model_len=max_len, max_num_seqs=max(batches + [args.num_prompts]),
            max_num_batched_tokens=args.max_num_batched_tokens,
            attention_backend=args.attention_backend, quantization=args.quantization)
    engine = llm.llm_engine
    cfg = engine.model_config
    decl = get_model(cfg.architecture).declare(cfg)
    params = num_parameters(decl)
    itemsize = np.dtype(jax.numpy.dtype(args.dtype)).itemsize
    # fp8: linear weights at 1 byte (embeddings, norms stay at dtype: a lower bound of the bytes)
    weight_bytes = params * (1 if args.quantization == "fp8" else itemsize)
    kind, (hbm, flops_peak) = _peaks()
    rng = np.random.default_rng(0)

    # The block's head first, each figure as it is measured: a stage cut off by its time limit
    # still leaves what it measured.
    T = args.max_num_batched_tokens
    print(f"\n### End to end, {os.path.basename(os.path.normpath(args.config))} dummy weights "
          f"({params / 1e9:.2f} B params, {args.dtype}{', ' + args.quantization if args.quantization else ''}), "
          f"{kind}, jax {jax.__version__}, "
          f"{datetime.date.today()}\n")
    print(f"Command: `python benchmarks/bench_gpu_e2e.py {' '.join(argv or sys.argv[1:])}`; "
          f"attention backend {engine.attention_backend} (asked: {args.attention_backend}); "
          f"engine start {start_s:.0f} s (weights made on device; step programs: {how}); "
          f"max_num_batched_tokens {T}, max_num_seqs {engine.scheduler_config.max_num_seqs}, "
          f"{engine.cache_config.num_blocks} KV blocks.\n", flush=True)
    if batches:
        print("| decode batch | context | step ms | tok/s | bytes/step GB | GB/s | % of HBM roofline |")
        print("|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for b in batches:
        dt = decode_step_time(llm, rng, b, args.context, args.steps)
        ctx = args.context + args.steps // 2
        kv_bytes = b * ctx * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * itemsize
        need = weight_bytes + kv_bytes
        frac = f"{100 * need / dt / hbm:.0f}%" if hbm else "n/a"
        print(f"| {b} | {args.context} | {dt * 1e3:.2f} | {b / dt:.0f} | "
              f"{need / 1e9:.1f} | {need / dt / 1e9:.0f} | {frac} |", flush=True)

    if "prefill" in parts:
        pt = prefill_step_time(llm, rng, T)
        attn = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * T * T   # QK^T + PV, causal half
        flops = 2 * params * T + attn
        mfu = f"{100 * flops / pt / flops_peak:.0f}%" if flops_peak else "n/a"
        print(f"\nPrefill: one step of {T} prompt tokens in {pt * 1e3:.1f} ms = "
              f"{flops / pt / 1e12:.0f} TFLOP/s, MFU {mfu} (dense bf16 peak).", flush=True)

    if "offline" in parts:
        sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        prompts = _random_prompts(rng, args.num_prompts, args.input_len, cfg.vocab_size)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        in_tokens = args.num_prompts * args.input_len
        print(f"\nOffline: {args.num_prompts} prompts x {args.input_len} tokens -> {args.output_len} "
              f"new tokens each (EOS ignored): {out_tokens / wall:.0f} output tok/s, "
              f"{(out_tokens + in_tokens) / wall:.0f} total tok/s ({wall:.1f} s).", flush=True)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
