"""Decode speed of the KV cache dtypes on CPU: f32 pages against `--kv-cache-dtype int8`, both read
by the CPU attention kernel (and int8 on the reference path, as before the kernel took it).

    python benchmarks/bench_kv_speed.py [--seqs 64] [--prompt-len 512] [--max-tokens 64] [--rounds 2]

The default model (`--dtype auto`), `--seqs` prompts of `--prompt-len` tokens cut from one text at
different offsets (prefix caching off), greedy, EOS ignored. Decode tok/s = seqs x (max_tokens - 1)
over the time a run takes beyond a 1-token run of the same prompts (best of 2 pairs a process). A
fresh process per configuration, alternating (A B C A B C). Prints a Markdown row per configuration
and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_RUN = r"""
import json, sys, time
from jaxserve import LLM, SamplingParams
kv, backend, seqs, plen, n = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a screw press adapted from wine making. ") * (plen // 20 + seqs)
llm = LLM(max_num_seqs=seqs, max_model_len=plen + n + 64, kv_cache_dtype=kv, enable_prefix_caching=False,
          attention_backend=backend)
ids = llm.get_tokenizer().encode(text)
prompts = [{"prompt_token_ids": ids[i:i + plen]} for i in range(seqs)]
full, one = (SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (n, 1))
llm.generate(prompts, full, use_tqdm=False)
llm.generate(prompts, one, use_tqdm=False)
best = 0.0
for _ in range(2):
    t = time.perf_counter(); llm.generate(prompts, one, use_tqdm=False); t1 = time.perf_counter() - t
    t = time.perf_counter(); llm.generate(prompts, full, use_tqdm=False); tn = time.perf_counter() - t
    best = max(best, seqs * (n - 1) / (tn - t1))
print(json.dumps({"tok_s": best, "backend": llm.llm_engine.runner.backend}))
"""

CONFIGS = [("auto", "auto"), ("int8", "auto"), ("int8", "reference")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    runs: dict = {c: [] for c in CONFIGS}
    for _ in range(a.rounds):
        for kv, backend in CONFIGS:
            out = subprocess.run([sys.executable, "-c", _RUN, kv, backend, str(a.seqs), str(a.prompt_len),
                                  str(a.max_tokens)], check=True, capture_output=True, text=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            runs[(kv, backend)].append(res)
            print(f"kv {kv}, attention {res['backend']}: {res['tok_s']:.1f} decode tok/s", flush=True)
    base = max(r["tok_s"] for r in runs[("auto", "auto")])
    for (kv, _), rs in runs.items():
        best = max(r["tok_s"] for r in rs)
        figures = ", ".join(format(r["tok_s"], ".1f") for r in rs)
        print(f"| {a.seqs} x {a.prompt_len}-token prompts, kv {kv}, attention {rs[0]['backend']} | "
              f"{figures} | {best / base:.2f}x f32 pages |")
    print(json.dumps({f"{kv}/{rs[0]['backend']}": [r["tok_s"] for r in rs] for (kv, _), rs in runs.items()}))


if __name__ == "__main__":
    main()
