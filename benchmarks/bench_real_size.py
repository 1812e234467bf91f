"""Real-size GGUF files on the CPU, jaxserve beside llama.cpp: decode tok/s at batch 1/16/64, one
long prompt's tok/s, load time and peak RSS, on the same file, alternating the two engines.

    python benchmarks/bench_real_size.py --peer /tmp/peer/venv/bin/python                # 1.7B, Q4_K_M and Q4_0
    python benchmarks/bench_real_size.py --peer PY --shape 8b --types Q4_K_M --batches 1
    python benchmarks/bench_real_size.py --peer PY --engines jaxserve                    # jaxserve alone

Files: a Llama-shaped F16 GGUF of the named shape with random weights (N(0, 0.02)) and the
default model's tokenizer, written one tensor at a time (an 8B F16 file never sits in memory
whole), then quantized by llama.cpp's own quantizer (`llama_model_quantize`, run with the peer
venv's Python, `--peer`: llama-cpp-python 0.3.36, ../shared/peers/README.md). Cached in `--cache`
(default ~/.cache/jaxserve/real_size); the quantizer is a benchmark tool, never a dependency.
Speed does not depend on the weights' values.

Each (engine, file) runs in a fresh process: it loads the file (load time: to ready, compile
included for jaxserve, whose programs are compiled on first use with warm-up off), prefills one
`--prompt-tokens`-token prompt (prompt tok/s, after one untimed run), then for each batch B
generates `--tokens` greedy tokens (EOS ignored) for the peer harness's B prompts once untimed and
once timed: output tok/s = B x tokens / time, prefill included, as ../shared/peers/batched.py
counts it. Peak RSS is the process's (ru_maxrss). llama.cpp runs with 2 threads and one KV pool
of `kv_tokens` = max(prompt + tokens + 16, 128 x the largest batch) tokens shared by all
sequences (f16, its default); jaxserve with default flags but the same context and pool:
`LLM(model=FILE, max_num_seqs=largest batch, max_model_len=prompt + tokens + 16,
num_gpu_blocks_override=kv_tokens / 16)` (whatever its KV dtype: bf16 pages by default for these
1B+ GGUF models, as llama.cpp's f16). Rounds alternate A B A B; the best of
the rounds is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# hidden, layers, heads, kv heads, ffn (the vocabulary is the default model's, 49152)
SHAPES = {"1.7b": (2048, 24, 32, 32, 8192), "8b": (4096, 32, 32, 8, 14336), "tiny": (256, 2, 4, 4, 512)}


def prompts(b: int) -> list[str]:
    return [f"Once upon a time, in a kingdom by the sea number {i}, there lived" for i in range(b)]


def write_f16(path: Path, shape: tuple[int, ...]) -> None:
    """A llama-shaped F16 GGUF with the default model's tokenizer metadata, written a tensor at a time."""
    import gguf
    import numpy as np

    from jaxserve.default_model import default_model_path
    E, L, H, KV, F = shape
    D, V = E // H, 49152
    src = gguf.GGUFReader(str(default_model_path()))
    w = gguf.GGUFWriter(str(path), arch="llama")
    over = {"llama.block_count": L, "llama.embedding_length": E, "llama.feed_forward_length": F,
            "llama.attention.head_count": H, "llama.attention.head_count_kv": KV, "llama.rope.dimension_count": D,
            "general.file_type": 1, "general.name": f"random-{E}x{L}"}
    for f in src.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue
        vt = f.types[0]
        w.add_key_value(f.name, over.get(f.name, f.contents()), vt,
                        sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    tensors = [("token_embd.weight", (V, E)), ("output_norm.weight", (E,))]
    for i in range(L):
        tensors += [(f"blk.{i}.attn_norm.weight", (E,)), (f"blk.{i}.ffn_norm.weight", (E,)),
                    (f"blk.{i}.attn_q.weight", (H * D, E)), (f"blk.{i}.attn_k.weight", (KV * D, E)),
                    (f"blk.{i}.attn_v.weight", (KV * D, E)), (f"blk.{i}.attn_output.weight", (E, H * D)),
                    (f"blk.{i}.ffn_gate.weight", (F, E)), (f"blk.{i}.ffn_up.weight", (F, E)),
                    (f"blk.{i}.ffn_down.weight", (E, F))]
    for name, s in tensors:
        dt = np.float32 if len(s) == 1 else np.float16
        w.add_tensor_info(name, s, np.dtype(dt), int(np.prod(s)) * np.dtype(dt).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for _, s in tensors:
        if len(s) == 1:
            w.write_tensor_data(np.ones(s, np.float32))
        else:
            w.write_tensor_data((rng.standard_normal(s, dtype=np.float32) * 0.02).astype(np.float16))
    w.close()


_QUANTIZE = r"""
import sys, llama_cpp as L
src, dst, name = sys.argv[1:4]
p = L.llama_model_quantize_default_params(); p.ftype = getattr(L, "LLAMA_FTYPE_MOSTLY_" + name); p.nthread = 2
sys.exit(L.llama_model_quantize(src.encode(), dst.encode(), p))
"""


def model_file(cache: Path, shape: str, kind: str, peer: str | None) -> Path:
    out = cache / f"random-{shape}-{kind}.gguf"
    if out.exists():
        return out
    if peer is None:
        raise SystemExit(f"{out} is not cached: --peer PYTHON (the peer venv's, with llama-cpp-python) quantizes it")
    cache.mkdir(parents=True, exist_ok=True)
    f16 = cache / f"random-{shape}-F16.gguf"
    if not f16.exists():
        print(f"writing {f16}", flush=True)
        write_f16(f16.with_suffix(".tmp"), SHAPES[shape])
        f16.with_suffix(".tmp").rename(f16)
    print(f"quantizing {out.name} with llama.cpp's quantizer", flush=True)
    done = subprocess.run([peer, "-c", _QUANTIZE, str(f16), str(out.with_suffix(".tmp")), kind],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"llama.cpp's quantizer failed on {kind}:\n{(done.stderr or done.stdout)[-2000:]}")
    out.with_suffix(".tmp").rename(out)
    return out


# One engine on one file: load, one long prompt, then each batch; prints a JSON line.
_JAXSERVE = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from jaxserve import LLM, SamplingParams
cfg = json.loads(sys.argv[1])
args = dict(max_model_len=cfg["max_model_len"], num_gpu_blocks_override=cfg["kv_blocks"], **cfg["engine_args"])
llm = LLM(model=cfg["path"], max_num_seqs=max(cfg["batches"]), warmup=False, **args)
res = {"load_s": time.perf_counter() - t0}
long = {"prompt_token_ids": [100 + (i * 7919) % 40000 for i in range(cfg["prompt_tokens"])]}
one = SamplingParams(temperature=0, max_tokens=1)
t1 = time.perf_counter()
llm.generate([long], one, use_tqdm=False)
res["first_token_s"] = time.perf_counter() - t0
res["first_prompt_s"] = time.perf_counter() - t1
other = {"prompt_token_ids": [t + 1 for t in long["prompt_token_ids"]]}    # no prefix-cache hit
t = time.perf_counter(); llm.generate([other], one, use_tqdm=False); dt = time.perf_counter() - t
res["prompt_tok_s"] = cfg["prompt_tokens"] / dt
sp = SamplingParams(temperature=0, max_tokens=cfg["tokens"], ignore_eos=True)
for b in cfg["batches"]:
    ps = cfg["prompts"][:b]
    llm.generate(ps, sp, use_tqdm=False)
    t = time.perf_counter(); outs = llm.generate(ps, sp, use_tqdm=False); dt = time.perf_counter() - t
    res[f"b{b}"] = sum(len(o.outputs[0].token_ids) for o in outs) / dt
res["rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print("RESULT" + json.dumps(res), flush=True)
"""

_LLAMA_CPP = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import numpy as np, llama_cpp as L
cfg = json.loads(sys.argv[1])
L.llama_backend_init()
model = L.llama_model_load_from_file(cfg["path"].encode(), L.llama_model_default_params())
vocab = L.llama_model_get_vocab(model); nv = L.llama_vocab_n_tokens(vocab)
B = max(cfg["batches"])
cp = L.llama_context_default_params()
cp.n_ctx = cfg["kv_tokens"]; cp.n_batch = 2048; cp.n_ubatch = 512; cp.n_seq_max = B
cp.n_threads = 2; cp.n_threads_batch = 2; cp.kv_unified = True
ctx = L.llama_init_from_model(model, cp)
mem = L.llama_get_memory(ctx)
batch = L.llama_batch_init(max(2048, cfg["prompt_tokens"]), 0, 1)
def step(entries):
    for i, (t, p, s, lg) in enumerate(entries):
        batch.token[i] = t; batch.pos[i] = p; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = s; batch.logits[i] = lg
    batch.n_tokens = len(entries)
    assert L.llama_decode(ctx, batch) == 0
    n = sum(1 for e in entries if e[3])
    return np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n, nv)).argmax(axis=1)
def prefill(seqs):   # [(seq, tokens)] in chunks of n_batch
    ent = [(t, j, s, j == len(ts) - 1) for s, ts in seqs for j, t in enumerate(ts)]
    out = []
    for i in range(0, len(ent), 2048):
        out.extend(step(ent[i:i + 2048]))
    return out
res = {"load_s": time.perf_counter() - t0}
long = [100 + (i * 7919) % 40000 for i in range(cfg["prompt_tokens"])]
t1 = time.perf_counter(); prefill([(0, long)]); L.llama_memory_clear(mem, True)
res["first_token_s"] = time.perf_counter() - t0
res["first_prompt_s"] = time.perf_counter() - t1
t = time.perf_counter(); prefill([(0, long)]); dt = time.perf_counter() - t; L.llama_memory_clear(mem, True)
res["prompt_tok_s"] = cfg["prompt_tokens"] / dt
def tok(s):
    bs = s.encode(); buf = (L.llama_token * 512)()
    n = L.llama_tokenize(vocab, bs, len(bs), buf, 512, True, False); return list(buf[:n])
for b in cfg["batches"]:
    toks = [tok(p) for p in cfg["prompts"][:b]]
    for timed in (False, True):
        t = time.perf_counter()
        nxt = prefill(list(enumerate(toks)))
        last = [int(x) for x in nxt]; pos = [len(ts) for ts in toks]
        for k in range(cfg["tokens"] - 1):
            last = [int(x) for x in step([(last[s], pos[s] + k, s, True) for s in range(b)])]
        dt = time.perf_counter() - t
        L.llama_memory_clear(mem, True)
    res[f"b{b}"] = b * cfg["tokens"] / dt
res["rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print("RESULT" + json.dumps(res), flush=True)
"""


# bytes per KV element by --kv-cache-dtype (int8: codes plus a f32 scale per token and head, ~1)


def run(engine: str, path: Path, args) -> dict:
    """Both engines hold the same number of KV tokens: `kv_tokens` (llama.cpp's n_ctx, one pool
    all sequences share; jaxserve's pool of as many 16-token blocks, `num_gpu_blocks_override`)."""
    extra = json.loads(args.engine_args)
    max_model_len = args.prompt_tokens + args.tokens + 16
    kv_tokens = max(max_model_len, max(args.batches) * 128)
    cfg = {"path": str(path), "batches": args.batches, "tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
           "prompts": prompts(max(args.batches)), "engine_args": extra, "max_model_len": max_model_len,
           "kv_tokens": kv_tokens, "kv_blocks": -(-kv_tokens // 16)}
    python, script = (sys.executable, _JAXSERVE) if engine == "jaxserve" else (args.peer, _LLAMA_CPP)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([python, "-c", script, json.dumps(cfg)], capture_output=True, text=True, env=env,
                          timeout=args.timeout)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    if proc.returncode or not line:
        return {"error": (proc.stderr or proc.stdout)[-1500:]}
    return json.loads(line[-1][len("RESULT"):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1.7b", choices=sorted(SHAPES))
    ap.add_argument("--types", nargs="+", default=["Q4_K_M", "Q4_0"], help="llama.cpp preset names")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engines", nargs="+", default=["jaxserve", "llama.cpp"], choices=["jaxserve", "llama.cpp"])
    ap.add_argument("--peer", help="the peer venv's python (llama-cpp-python): quantizes, runs llama.cpp")
    ap.add_argument("--engine-args", default="{}", help="JSON of extra LLM() arguments for jaxserve")
    ap.add_argument("--cache", type=Path, default=Path("~/.cache/jaxserve/real_size").expanduser())
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--json", type=Path, help="also write every round's figures here")
    args = ap.parse_args()
    if "llama.cpp" in args.engines and args.peer is None:
        ap.error("--peer PYTHON is needed to run llama.cpp")
    keys = ["load_s", "first_token_s", "prompt_tok_s", *(f"b{b}" for b in args.batches), "rss_gb"]
    better = {k: (min if k in ("load_s", "first_token_s", "rss_gb") else max) for k in keys}
    rows, log = [], []
    for kind in args.types:
        path = model_file(args.cache, args.shape, kind, args.peer)
        got = {e: [] for e in args.engines}
        for r in range(args.rounds):
            for e in args.engines:               # A B A B
                t = time.perf_counter()
                res = run(e, path, args)
                print(f"{kind} round {r} {e}: {json.dumps(res)} ({time.perf_counter() - t:.0f} s)", flush=True)
                log.append({"type": kind, "round": r, "engine": e, **res})
                if "error" not in res:
                    got[e].append(res)
        best = {e: {k: better[k](x[k] for x in xs) for k in keys} for e, xs in got.items() if xs}
        rows.append((kind, path.stat().st_size / 2**30, best))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"\n{args.shape} random-weight GGUFs, {cpu}, {os.cpu_count()} cores, best of {args.rounds} rounds")
    print("| file | GiB | what | jaxserve | llama.cpp | ratio |\n|---|---|---|---|---|---|")
    for kind, gib, best in rows:
        for k in keys:
            a, b = (best.get(e, {}).get(k) for e in ("jaxserve", "llama.cpp"))
            ratio = f"{a / b:.2f}x" if a and b else ""
            digits = 2 if k.endswith(("_s", "gb")) else 1
            a_s, b_s = ("" if v is None else f"{v:.{digits}f}" for v in (a, b))
            print(f"| {kind} | {gib:.2f} | {k.replace('b', 'batch ', 1) if k[1:].isdigit() else k} | "
                  f"{a_s} | {b_s} | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps(log, indent=1))


if __name__ == "__main__":
    main()
