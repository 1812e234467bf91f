"""The host KV tier (`--kv-offloading-size`) on a multi-turn workload whose histories outgrow the
device pool: the default model on CPU, with and without the tier, rounds alternating (A B A B).

Each of `--conversations` conversations has a `--history`-token history (random token ids); the
device pool holds `--pool-for` of them. A round builds a fresh engine, sends every history once
(the prefix cache fills; the pool keeps only the last few), then:
- TTFT: each conversation's next turn (history + `--turn` new tokens, one token generated), one
  request at a time in the first round's order, so without the tier every history has left the
  pool by the time it comes back (recomputed) and with it every history is in host memory;
- throughput: the next turn again for all of them at once, `--new` tokens each (a burst).

    python benchmarks/bench_kv_offload.py                       # 32 x 1024 tokens, pool for 8
    python benchmarks/bench_kv_offload.py --conversations 64 --history 2048 --pool-for 16
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from jaxserve import LLM, SamplingParams


def one_round(args, offload: bool) -> dict:
    rng = random.Random(args.seed)
    histories = [[rng.randrange(100, 40000) for _ in range(args.history)]
                 for _ in range(args.conversations)]
    blocks_per_conv = -(-(args.history + args.turn + args.new) // 16)
    host_gib = args.conversations * blocks_per_conv * 16 * args.kv_bytes_per_token / 2**30 * 1.25
    llm = LLM(max_model_len=args.history + args.turn + args.new + 16, dtype=args.dtype,
              num_gpu_blocks_override=args.pool_for * blocks_per_conv, max_num_seqs=args.pool_for,
              max_num_batched_tokens=args.chunk, kv_offloading_size=host_gib if offload else None)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": h} for h in histories], one, use_tqdm=False)
    # the same next turn for everyone (a fixed suffix): prompts differ only by their history
    turn = [rng.randrange(100, 40000) for _ in range(args.turn)]
    ttft, firsts = [], []
    for h in histories:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": h + turn}], one, use_tqdm=False)[0]
        ttft.append(time.perf_counter() - t0)
        firsts.append(out.outputs[0].token_ids[0])
    burst = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": h + turn} for h in histories], burst, use_tqdm=False)
    wall = time.perf_counter() - t0
    s = llm.llm_engine.stats()
    llm.shutdown()
    del llm
    gc.collect()
    return dict(ttft=statistics.median(ttft), req_s=len(outs) / wall,
                tok_s=sum(len(o.outputs[0].token_ids) for o in outs) / wall,
                host_hits=s.external_prefix_cache_hits, device_hits=s.prefix_cache_hits,
                moved_gib=(s.kv_offload_bytes_to_host + s.kv_offload_bytes_to_device) / 2**30,
                firsts=firsts, tokens=[o.outputs[0].token_ids for o in outs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--history", type=int, default=1024)
    ap.add_argument("--pool-for", type=int, default=8, help="conversations the device pool holds")
    ap.add_argument("--turn", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    # the default model: 30 layers x 3 KV heads x 64 x (K, V) x 4 bytes (f32)
    ap.add_argument("--kv-bytes-per-token", type=int, default=30 * 3 * 64 * 2 * 4)
    args = ap.parse_args()
    runs = {True: [], False: []}
    for r in range(args.rounds):
        for offload in (True, False):
            res = one_round(args, offload)
            runs[offload].append(res)
            print(f"round {r} {'tier   ' if offload else 'no tier'}: TTFT median {res['ttft'] * 1e3:.0f} ms, "
                  f"burst {res['req_s']:.2f} req/s ({res['tok_s']:.1f} tok/s), host hits "
                  f"{res['host_hits']} tok, device hits {res['device_hits']} tok, moved "
                  f"{res['moved_gib']:.2f} GiB", flush=True)
    same = all(a["firsts"] == b["firsts"] and a["tokens"] == b["tokens"]
               for a, b in zip(runs[True], runs[False]))
    for r, (a, b) in enumerate(zip(runs[True], runs[False])):
        print(f"round {r}: TTFT tier / no tier {a['ttft'] / b['ttft']:.3f}x (target <= 0.3), "
              f"throughput {a['req_s'] / b['req_s']:.2f}x (target >= 1.5)")
    print(f"greedy tokens equal with and without the tier: {same}")


if __name__ == "__main__":
    main()
