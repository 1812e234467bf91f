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
- **program alone**: the compiled programs of those decode steps run back to back on their
  recorded inputs (launched one after the other, then waited for): what the device needs per
  step when the host adds nothing.
XLA:CPU starts on one core (its thread pools get one thread: with one Eigen thread it still runs a
program's independent ops on a pool of all the cores), then the host thread is pinned to one core and
XLA's threads to the other (`pin_host_and_device`; `--no-pin`: neither). The ratio engine step /
program alone is the exposed host time (1.00: none). Beside it, the share of the async steps' wall
time that XLA's threads were busy (Linux, from /proc): 1.00 says the device never waited for the
host, so a ratio above 1 then comes from the programs running slower beside the host's work
(the two cores share the L3 cache and memory), not from host time in the step's path. Prints a
markdown table; `--append` adds it to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import threading
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
# One Eigen thread is not one XLA thread: XLA:CPU runs a program's independent ops on a pool as
# large as the cores it sees when it starts (1.7-1.9 cores busy while one step runs, measured).
# Started on one core, its pools get one thread; `pin_host_and_device` then spreads the threads.
_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
if "--no-pin" not in sys.argv and len(_CORES) >= 2:
    os.sched_setaffinity(0, {_CORES[0]})

import jax  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "data", "tiny-llama")


def build(max_seqs: int):
    from jaxserve import LLM
    return LLM(model=TINY, load_format="dummy", max_model_len=1024, max_num_seqs=max_seqs,
               max_num_batched_tokens=2048, num_gpu_blocks_override=(max_seqs * 1024) // 16 + 64, seed=0,
               dtype="float32", program_cache_dir="")


def pin_host_and_device() -> str:
    """The host on one core, XLA on the other (Linux): this thread (the engine's) gets the first
    core, every other thread of the process (XLA:CPU's, one-thread pools since it started on one
    core) the second, so the "device" never takes the host's core. Returns what was done."""
    if len(_CORES) < 2:
        return "not pinned"
    host, device = _CORES[:2]
    main = threading.get_native_id()
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {host} if int(tid) == main else {device})
        except OSError:
            pass
    return f"host thread on core {host}, XLA's threads on core {device}"


def xla_cpu_seconds() -> float | None:
    """CPU seconds used so far by every thread of this process but the engine's (XLA:CPU's:
    the "device"); None off Linux."""
    main, total = threading.get_native_id(), 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        if int(tid) == main:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue                     # a thread that ended
        total += int(fields[11]) + int(fields[12])     # utime + stime, in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def set_mode(engine, asynchronous: bool) -> None:
    import dataclasses
    assert engine._in_flight is None and not engine.has_unfinished_requests()
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, async_scheduling=asynchronous)


def decode_round(engine, num_seqs: int, prompt_len: int, steps: int, tag: str):
    """(seconds per engine step over `steps` decode steps, the StepInputs of those steps, the
    share of those steps' wall time that XLA's threads were busy: 1.0, the device never waited
    for the host)."""
    from jaxserve import SamplingParams
    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True, temperature=0)
    for i in range(num_seqs):
        engine.add_request(f"{tag}-{i}", [3 + (i * 7 + j) % 1000 for j in range(prompt_len)], params)
    runner = engine.runner
    recorded = []
    prepare = runner.prepare

    def recording(scheduled, with_prompt_logprobs):
        out = prepare(scheduled, with_prompt_logprobs)
        recorded.append(out[0])
        return out
    runner.prepare = recording
    try:
        while engine.scheduler.num_waiting or any(r.num_output_tokens < 2 for r in engine.scheduler.running):
            engine.step()               # prefill, first tokens: every sequence decoding after
        for _ in range(3):
            engine.step()
        recorded.clear()
        cpu0, t0 = xla_cpu_seconds(), time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall, cpu1 = time.perf_counter() - t0, xla_cpu_seconds()
        elapsed = wall / steps
    finally:
        del runner.prepare
    engine.abort_request([f"{tag}-{i}" for i in range(num_seqs)])
    while engine.has_unfinished_requests():
        engine.step()
    busy = None if cpu0 is None else (cpu1 - cpu0) / wall
    return elapsed, recorded[:steps], busy


def program_alone(runner, steps) -> float:
    """Seconds per step of the compiled decode programs launched back to back on the recorded
    inputs of the engine's steps (the same shapes and context lengths; each rewrites the K/V its
    step wrote, placeholders read the last sampled tokens: the same work)."""
    jax.block_until_ready(runner.run_model(steps[0]))
    t0 = time.perf_counter()
    for inputs in steps:
        out = runner.run_model(inputs)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / len(steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--append", action="store_true")
    ap.add_argument("--no-pin", action="store_true", help="leave threads where the OS puts them")
    args = ap.parse_args()
    rows = []
    for n in args.seqs:
        llm = build(n)
        engine = llm.llm_engine
        pinned = "not pinned" if args.no_pin else pin_host_and_device()
        times = {False: [], True: [], "alone": []}
        busy = []
        for r in range(args.rounds):
            for mode in (False, True):          # A B A B
                set_mode(engine, mode)
                t, steps, b = decode_round(engine, n, args.prompt_len, args.steps, f"{n}-{r}-{mode}")
                times[mode].append(t)
                if mode and b is not None:
                    busy.append(b)
                times["alone"].append(program_alone(engine.runner, steps))
        llm.shutdown()
        alone = min(times["alone"])
        sync, asyn = min(times[False]), min(times[True])
        dev = f"{min(busy):.2f}-{max(busy):.2f}" if busy else "n/a"
        rows.append((n, alone, sync, asyn, dev))
        print(f"{n} seqs: program alone {alone * 1e3:.2f} ms; engine step sync {sync * 1e3:.2f} ms "
              f"({sync / alone:.3f}x), async {asyn * 1e3:.2f} ms ({asyn / alone:.3f}x); XLA's threads busy "
              f"{dev} of the async steps' time", flush=True)
    date = datetime.date.today().isoformat()
    lines = [f"### Exposed host time per engine step, async scheduling off / on ({date})", "",
             f"`python benchmarks/bench_async.py --seqs {' '.join(map(str, args.seqs))} --steps {args.steps} "
             f"--rounds {args.rounds}` on {platform.machine()} ({os.cpu_count()} cores), jax {jax.__version__}; "
             f"dummy tiny Llama, XLA:CPU one thread, {pinned}; best of the rounds, A B A B.", "",
             "| decoding sequences | program alone | engine step, sync | engine step, async | sync / alone "
             "| async / alone | XLA busy, async (rounds) |", "|---|---|---|---|---|---|---|"]
    for n, alone, sync, asyn, dev in rows:
        lines.append(f"| {n} | {alone * 1e3:.2f} ms | {sync * 1e3:.2f} ms | {asyn * 1e3:.2f} ms | "
                     f"{sync / alone:.3f}x | {asyn / alone:.3f}x | {dev} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.append:
        with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "a") as f:
            f.write("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
