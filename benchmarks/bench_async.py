"""Exposed host time of an engine step, with async scheduling off and on (issue: async scheduling).

    python benchmarks/bench_async.py                      # 64 and 256 decoding sequences
    python benchmarks/bench_async.py --seqs 256 --rounds 3

The dummy tiny Llama (tests/data/tiny-llama, random weights: the device work is small, so the
host's share shows), with XLA:CPU held to one thread (`--xla_cpu_multi_thread_eigen=false`, set
here before jax is imported) so that the host and the "device" each have a core of the two.
For each batch size: every sequence is prefilled and decoding (ignore_eos, max_tokens far
away), then
- **engine step**: the wall time per `LLMEngine.step()` over `--steps` decode steps, synchronous
  (schedule, run, read the tokens, update, detokenise) and async (step N + 1 launched before
  step N is read), alternated A B A B in one sitting on one engine (the scheduler's mode is
  switched between rounds, with nothing in flight);
- **program alone**: the same decode step's compiled program run back to back on the inputs
  of a real step of that batch (launched `--steps` times, then waited for): what the device
  needs per step when the host adds nothing.
The ratio engine step / program alone is the exposed host time (1.00: none). Prints a markdown
table; `--append` adds it to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()

import jax  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "data", "tiny-llama")


def build(max_seqs: int):
    from jaxserve import LLM
    return LLM(model=TINY, load_format="dummy", max_model_len=1024, max_num_seqs=max_seqs,
               max_num_batched_tokens=2048, num_gpu_blocks_override=(max_seqs * 1024) // 16 + 64, seed=0,
               dtype="float32", program_cache_dir="")


def set_mode(engine, asynchronous: bool) -> None:
    import dataclasses
    assert engine._in_flight is None and not engine.has_unfinished_requests()
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, async_scheduling=asynchronous)


def decode_round(engine, num_seqs: int, prompt_len: int, steps: int, tag: str):
    """(seconds per engine step over `steps` decode steps, StepInputs of one decode step)."""
    from jaxserve import SamplingParams
    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True, temperature=0)
    for i in range(num_seqs):
        engine.add_request(f"{tag}-{i}", [3 + (i * 7 + j) % 1000 for j in range(prompt_len)], params)
    runner = engine.runner
    recorded = {}
    prepare = runner.prepare

    def recording(scheduled, with_prompt_logprobs):
        out = prepare(scheduled, with_prompt_logprobs)
        recorded["inputs"] = out[0]
        return out
    runner.prepare = recording
    try:
        while engine.scheduler.num_waiting or any(r.num_output_tokens < 2 for r in engine.scheduler.running):
            engine.step()               # prefill, first tokens: every sequence decoding after
        for _ in range(3):
            engine.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        elapsed = (time.perf_counter() - t0) / steps
    finally:
        del runner.prepare
    engine.abort_request([f"{tag}-{i}" for i in range(num_seqs)])
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed, recorded["inputs"]


def program_alone(runner, inputs, steps: int) -> float:
    """Seconds per step of the compiled decode program launched back to back on `inputs`."""
    jax.block_until_ready(runner.run_model(inputs))
    t0 = time.perf_counter()
    for _ in range(steps):
        out = runner.run_model(inputs)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()
    rows = []
    for n in args.seqs:
        llm = build(n)
        engine = llm.llm_engine
        times = {False: [], True: [], "alone": []}
        for r in range(args.rounds):
            for mode in (False, True):          # A B A B
                set_mode(engine, mode)
                t, inputs = decode_round(engine, n, args.prompt_len, args.steps, f"{n}-{r}-{mode}")
                times[mode].append(t)
                times["alone"].append(program_alone(engine.runner, inputs, args.steps))
        llm.shutdown()
        alone = min(times["alone"])
        sync, asyn = min(times[False]), min(times[True])
        rows.append((n, alone, sync, asyn))
        print(f"{n} seqs: program alone {alone * 1e3:.2f} ms; engine step sync {sync * 1e3:.2f} ms "
              f"({sync / alone:.3f}x), async {asyn * 1e3:.2f} ms ({asyn / alone:.3f}x)", flush=True)
    date = datetime.date.today().isoformat()
    lines = [f"### Exposed host time per engine step, async scheduling off / on ({date})", "",
             f"`python benchmarks/bench_async.py --seqs {' '.join(map(str, args.seqs))} --steps {args.steps} "
             f"--rounds {args.rounds}` on {platform.machine()} ({os.cpu_count()} cores), jax {jax.__version__}; "
             "dummy tiny Llama, XLA:CPU one thread; best of the rounds, A B A B.", "",
             "| decoding sequences | program alone | engine step, sync | engine step, async | sync / alone "
             "| async / alone |", "|---|---|---|---|---|---|"]
    for n, alone, sync, asyn in rows:
        lines.append(f"| {n} | {alone * 1e3:.2f} ms | {sync * 1e3:.2f} ms | {asyn * 1e3:.2f} ms | "
                     f"{sync / alone:.3f}x | {asyn / alone:.3f}x |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.append:
        with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "a") as f:
            f.write("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
