"""Structured output: engine step time of a 64-row decode batch with 0, 16 and 64 rows under a
JSON schema, side by side in one run, and grammar compile time p50/p99 for the schemas used.

    python benchmarks/bench_structured.py [--rows 64] [--steps 30] [--rounds 2]

Each configuration keeps `rows` requests decoding (seeded sampling at temperature 1, ignore_eos
for the unconstrained ones); a request that finishes (its grammar completed) is replaced by a
fresh one of the same kind. Only steps that are pure decode steps of exactly `rows` rows are
timed (a replacement's prefill changes the token bucket), so every figure is the same program
on the same shapes; the configurations alternate for `rounds` rounds so that drift on a shared
machine hits all of them alike. The step time is `LLMEngine.step()` wall time (schedule,
bitmask fill, the jitted step, update, detokenize); the bitmask fill is also timed on its own.
Prints a Markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

ITEM = {"type": "object", "additionalProperties": False, "required": ["name", "qty", "kind"],
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "qty": {"type": "integer", "minimum": 0, "maximum": 1000},
                       "kind": {"enum": ["tool", "food", "book"]}}}
# The decoding schema: an order with a long list of items (rows stay constrained for a while).
ORDER = {"type": "object", "additionalProperties": False, "required": ["id", "items"],
         "properties": {"id": {"type": "integer"},
                        "items": {"type": "array", "items": ITEM, "minItems": 1}}}
SCHEMAS = {
    "order (nested, array, enum, bounds)": ORDER,
    "item (flat, 3 fields)": ITEM,
    "person (nested object, pattern)": {
        "type": "object", "required": ["name", "age", "address"],
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                       "email": {"type": "string", "format": "email"},
                       "address": {"type": "object", "required": ["zip"],
                                   "properties": {"zip": {"type": "string",
                                                          "pattern": "^[0-9]{5}$"},
                                                  "city": {"type": "string"}}}}},
    "json_object": None,
}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def compile_times(manager, repeats: int):
    from jaxserve.sampling_params import StructuredOutputsParams
    from jaxserve.structured_output.grammar import compile_matcher
    out = {}
    tok = manager.ll_tokenizer
    for name, schema in SCHEMAS.items():
        spec = StructuredOutputsParams(json_object=True) if schema is None \
            else StructuredOutputsParams(json=schema)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            compile_matcher(spec, tok)          # no cache: a compile each time
            ts.append(time.perf_counter() - t0)
        out[name] = (pct(ts, 50) * 1e3, pct(ts, 99) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per config and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compile-repeats", type=int, default=50)
    a = ap.parse_args()

    from jaxserve import LLM, SamplingParams
    from jaxserve.sampling_params import StructuredOutputsParams

    R = a.rows
    llm = LLM(max_model_len=512, max_num_seqs=R, max_num_batched_tokens=max(128, 2 * R),
              num_gpu_blocks_override=2048, seed=0)
    engine = llm.llm_engine
    fill_times: list[float] = []
    grammar_bitmask = engine._grammar_bitmask

    def timed_fill(sched):
        t0 = time.perf_counter()
        out = grammar_bitmask(sched)
        if out is not None:
            fill_times.append(time.perf_counter() - t0)
        return out

    engine._grammar_bitmask = timed_fill
    constrained = StructuredOutputsParams(json=ORDER, disable_any_whitespace=True)
    counter = iter(range(10**9))

    def add(kind_constrained: bool):
        i = next(counter)
        sp = SamplingParams(temperature=1.0, seed=i, max_tokens=400, ignore_eos=True,
                            structured_outputs=constrained if kind_constrained else None)
        rid = f"{'c' if kind_constrained else 'u'}{i}"
        engine.add_request(rid, f"Order number {i} as JSON:", sp)
        return rid

    def run_config(k: int, steps: int) -> tuple[list[float], list[float]]:
        live = {add(j < k): j < k for j in range(R)}
        times, fills = [], []
        while len(times) < steps:
            fill_times.clear()
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            sched_rows = engine.runner.input_batch
            for o in outs:
                if o.finished and o.request_id in live:
                    was = live.pop(o.request_id)
                    live[add(was)] = was
            pure = (len(sched_rows) == R and engine.scheduler.num_waiting == 0
                    and last_tokens[0] == R)
            if pure:
                times.append(dt)
                fills.extend(fill_times)
        engine.abort_request(list(live))
        while engine.has_unfinished_requests():
            engine.step()
        return times, fills

    # The number of tokens each step scheduled, recorded from the runner's input.
    last_tokens = [0]
    execute = engine.runner.execute

    def counting_execute(sched):
        last_tokens[0] = sched.num_scheduled_tokens
        return execute(sched)

    engine.runner.execute = counting_execute

    configs = (0, R // 4, R)
    results = {k: ([], []) for k in configs}
    run_config(R, 5)                                      # warm: programs, caches
    for _ in range(a.rounds):
        for k in configs:
            t, f = run_config(k, a.steps)
            results[k][0].extend(t)
            results[k][1].extend(f)
    compiles = compile_times(engine.structured, a.compile_repeats)

    base = statistics.median(results[0][0])
    print(f"\n{platform.node()}  {platform.processor() or platform.machine()}  "
          f"rows={R} steps/config={a.steps * a.rounds}\n")
    print("| constrained rows | step p50 (ms) | step p90 (ms) | vs 0 | bitmask fill p50 (ms) |")
    print("| --- | --- | --- | --- | --- |")
    summary = {}
    for k in configs:
        t, f = results[k]
        p50, p90 = statistics.median(t) * 1e3, pct(t, 90) * 1e3
        fill = statistics.median(f) * 1e3 if f else 0.0
        summary[k] = {"p50_ms": p50, "p90_ms": p90, "ratio": p50 / (base * 1e3),
                      "fill_p50_ms": fill}
        print(f"| {k} / {R} | {p50:.1f} | {p90:.1f} | {p50 / (base * 1e3):.3f}x | {fill:.2f} |")
    print("\n| schema | compile p50 (ms) | compile p99 (ms) |\n| --- | --- | --- |")
    for name, (p50, p99) in compiles.items():
        print(f"| {name} | {p50:.2f} | {p99:.2f} |")
    print(json.dumps({"steps": summary, "compile_ms": compiles}))
    llm.shutdown()


if __name__ == "__main__":
    main()
