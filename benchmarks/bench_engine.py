"""Engine throughput on CPU: jaxserve `LLM.generate` vs transformers' continuous batching
(`model.generate_batch`) on the same weights (the default SmolLM2-135M GGUF, f32) and prompts.

    python benchmarks/bench_engine.py            # 64 prompts of 16-512 tokens x 128 new tokens
    python benchmarks/bench_engine.py --quick    # 8 prompts of 16-128 tokens x 16 new tokens

Reports, in one run:
- generated tokens/s of both engines (greedy, EOS ignored, every request gets exactly N tokens);
- engine efficiency: end-to-end tokens/s over the tokens/s of the bare jitted step, i.e. the same
  sequence of step inputs the engine ran, replayed through `runner.run_model` (the one jitted
  step: model and sampler) with nothing else (1.0 = the host adds no time). Each step is replayed right after the
  engine ran it (same arrays; it rewrites the same K/V), so load from other processes on a shared
  machine hits both sides alike; the replays are subtracted from the end-to-end time;
- KV slot utilisation: tokens stored / slots allocated, sampled after every step;
- compiled model programs, warm-up seconds, and where the engine's step time goes.
Prints a markdown table; `--append` adds it to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import os
import platform
import sys
import time

import jax
import numpy as np

_TEXT = """\
The history of the printing press begins in the fifteenth century, when Johannes Gutenberg
combined movable metal type, oil-based ink and a screw press adapted from wine making. Within
fifty years presses were running in more than two hundred cities across Europe, and the price of
books fell so far that ordinary merchants could own them. Scholars argue about how much the press
changed the pace of science, but few doubt that it made the Reformation spread faster than any
earlier religious movement. Newspapers, pamphlets and cheap almanacs followed, and with them a
reading public that expected news every week rather than every season.
A river begins as rain on high ground. Water that does not soak into the soil runs downhill in
rills, the rills join into streams, and the streams into a river that carves its valley deeper
each spring flood. Near the sea the river slows, drops the silt it carried, and builds a delta of
shifting channels, marshes and sandbanks where birds feed at low tide.
def merge_sort(items):
    if len(items) <= 1:
        return items
    middle = len(items) // 2
    left, right = merge_sort(items[:middle]), merge_sort(items[middle:])
    merged = []
    while left and right:
        merged.append(left.pop(0) if left[0] <= right[0] else right.pop(0))
    return merged + left + right
The committee met on Tuesday to review the budget. Several members asked why the maintenance line
had doubled; the treasurer explained that the roof of the east building had failed its inspection
and could not wait another winter. After a long discussion the committee approved the repair, cut
the travel allowance by a third and asked for quarterly reports on every contract above the
threshold set last year.
"""


def make_prompts(tokenizer, num: int, min_len: int, max_len: int) -> list[list[int]]:
    """`num` token-id prompts with lengths spread evenly over [min_len, max_len] (shuffled by a
    fixed permutation), each a window of the tokenized text starting at a different offset."""
    ids = tokenizer.encode(_TEXT, add_special_tokens=False)
    while len(ids) < 2 * max_len:
        ids = ids + ids
    lengths = np.linspace(min_len, max_len, num).round().astype(int)
    lengths = lengths[np.random.default_rng(0).permutation(num)]
    prompts = []
    for i, n in enumerate(lengths):
        start = (i * 37) % (len(ids) - max_len)
        prompts.append(ids[start:start + int(n)])
    return prompts


# -- jaxserve --------------------------------------------------------------------------------
class Recorder:
    """Wraps the engine's parts (instance attributes only) to record each step's inputs (one
    StepInputs pytree), KV utilisation and host/device time per phase."""

    def __init__(self, engine):
        self.engine = engine
        self.steps = []                     # StepInputs of each step
        self.kv_samples = []                # (tokens stored, slots allocated)
        self.phase = collections.defaultdict(float)
        self.shapes = collections.Counter()
        runner, sched = engine.runner, engine.scheduler
        self._orig = dict(run_model=runner.run_model,
                          schedule=sched.schedule, update=sched.update_from_output,
                          process=engine.processor.process, dispatch=runner.dispatch,
                          collect=runner.collect, prepare=runner.prepare, step=engine.step)
        # Each step is paired with a replay of its program (below), which must see the state the
        # step saw: synchronous steps (async scheduling's next step would already be in flight).
        sched.config = dataclasses.replace(sched.config, async_scheduling=False)
        self.step_s = 0.0                   # wall time inside engine.step()
        self.bare_s = 0.0                   # the same steps replayed: the jitted step only

        def run_model(inputs):
            self.shapes[(len(inputs.tokens), inputs.prompt_targets is not None)] += 1
            t0 = time.perf_counter()
            out = self._orig["run_model"](inputs)
            jax.block_until_ready(out)
            self.phase["model step (device)"] += time.perf_counter() - t0
            return out

        def timed(name, fn):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.phase[name] += time.perf_counter() - t0
            return wrapper

        def prepare(*a, **k):
            t0 = time.perf_counter()
            out = self._orig["prepare"](*a, **k)
            self.phase["prepare inputs (host)"] += time.perf_counter() - t0
            self.steps.append(out[0])
            return out

        def update(*a, **k):
            t0 = time.perf_counter()
            out = self._orig["update"](*a, **k)
            self.phase["scheduler update (host)"] += time.perf_counter() - t0
            self._sample_kv()
            return out

        def step():
            n = len(self.steps)
            t0 = time.perf_counter()
            out = self._orig["step"]()
            self.step_s += time.perf_counter() - t0
            if len(self.steps) > n:
                # Paired measurement, robust to load from other processes on a shared machine:
                # re-run this step's jitted step with the same inputs right away. It writes the
                # same K/V to the same slots, so the engine's KV state is unchanged (the sampled
                # tokens are counted twice in the penalty state, which greedy rows never read).
                self.bare_s += replay_bare_steps(self._orig["run_model"], self.steps[n:])
            return out

        engine.step = step
        runner.run_model = run_model
        runner.prepare = prepare
        runner.dispatch = timed("dispatch (total)", self._orig["dispatch"])
        runner.collect = timed("collect (total)", self._orig["collect"])
        sched.schedule = timed("schedule (host)", self._orig["schedule"])
        sched.update_from_output = update
        engine.processor.process = timed("detokenize + outputs (host)", self._orig["process"])

    def _sample_kv(self):
        sched = self.engine.scheduler
        mgr = sched.kv_cache_manager
        stored = sum(r.num_computed_tokens for r in sched.running)
        blocks = {b.block_id for r in sched.running for b in mgr.req_to_blocks.get(r.request_id, ())}
        if blocks:
            self.kv_samples.append((stored, len(blocks) * mgr.block_size))

    def restore(self):
        runner, sched = self.engine.runner, self.engine.scheduler
        for name in ("run_model", "dispatch", "collect", "prepare"):
            delattr(runner, name)
        for name in ("schedule", "update_from_output"):
            delattr(sched, name)
        del self.engine.processor.process
        del self.engine.step


def replay_bare_steps(run_model, steps) -> float:
    """Seconds to run the recorded steps through the jitted step (model and sampler) only."""
    t0 = time.perf_counter()
    for inputs in steps:
        jax.block_until_ready(run_model(inputs))
    return time.perf_counter() - t0


def run_jaxserve(prompts, max_new, args):
    from jaxserve import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.max_num_seqs, dtype="float32", enable_prefix_caching=True)
    engine = llm.llm_engine
    start_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    # One tiny request first so the sampler's programs and first-use paths are not timed.
    llm.generate({"prompt_token_ids": prompts[0][:8]}, SamplingParams(temperature=0, max_tokens=2),
                 use_tqdm=False)
    engine.scheduler.kv_cache_manager.reset_prefix_cache()
    rec = Recorder(engine)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    e2e = time.perf_counter() - t0 - rec.bare_s          # the interleaved replays excluded
    rec.restore()
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == len(prompts) * max_new, generated
    bare = rec.bare_s
    stored, slots = np.array(rec.kv_samples, dtype=np.float64).T
    result = dict(
        e2e_s=e2e, tok_s=generated / e2e, bare_s=bare, bare_tok_s=generated / bare,
        efficiency=bare / e2e, kv_util_mean=float(np.mean(stored / slots)),
        kv_util_min=float(np.min(stored / slots)), steps=len(rec.steps),
        programs=len(engine.runner.compiled_programs), buckets=list(engine.runner.buckets),
        warmup_s=engine.warmup_seconds, startup_s=start_s, shapes=dict(rec.shapes),
        phase={**rec.phase, "engine.step (total)": rec.step_s}, outputs=[o.outputs[0].token_ids for o in outs],
        num_preemptions=engine.scheduler.num_preemptions_total)
    llm.shutdown()
    return result


# -- transformers ----------------------------------------------------------------------------
def run_transformers(prompts, max_new, args):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    from jaxserve.default_model import default_model_path
    path = default_model_path()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    model.eval()
    cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    # The same budgets as jaxserve: a KV pool for every request at full length (its memory-based
    # default sizes from free RAM, which on a shared machine gets the process OOM-killed), the
    # same token budget per step and the same number of concurrent requests.
    page = 256
    cb = dict(page_size=page, max_batch_tokens=args.max_num_batched_tokens,
              max_requests_per_batch=args.max_num_seqs,
              num_blocks=len(prompts) * -(-args.max_model_len // page) + 1)
    # Warm-up on a tiny batch (first-use allocations, kernels), then the timed run.
    model.generate_batch(inputs=[prompts[0][:8]], generation_config=
                         GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1,
                                          pad_token_id=0),
                         continuous_batching_config=ContinuousBatchingConfig(**cb))
    t0 = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=cfg,
                                   continuous_batching_config=ContinuousBatchingConfig(**cb))
    elapsed = time.perf_counter() - t0
    by_prompt = {}
    for r in results.values():
        by_prompt[tuple(r.prompt_ids)] = list(r.generated_tokens)
    generated = sum(len(v) for v in by_prompt.values())
    return dict(s=elapsed, tok_s=generated / elapsed, generated=generated,
                outputs=[by_prompt.get(tuple(p)) for p in prompts],
                version=transformers.__version__, threads=torch.get_num_threads())


def _agreement(a, b) -> float:
    """Mean fraction of identical leading tokens (greedy on the same weights)."""
    fr = []
    for x, y in zip(a, b):
        if y is None:
            continue
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        fr.append(n / len(x))
    return float(np.mean(fr)) if fr else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8 prompts of 16-128 tokens x 16 tokens")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = p.parse_args()
    num = args.num_prompts or (8 if args.quick else 64)
    max_new = args.max_new_tokens or (16 if args.quick else 128)
    lo, hi = (16, 128) if args.quick else (16, 512)
    args.max_model_len = hi + max_new

    from jaxserve.default_model import default_model_path
    from jaxserve.tokenizer.tokenizer import Tokenizer
    tok = Tokenizer.from_model(str(default_model_path()))
    prompts = make_prompts(tok, num, lo, hi)
    print(f"{num} prompts, {sum(map(len, prompts))} prompt tokens ({lo}-{hi}), "
          f"{max_new} new tokens each", flush=True)

    js = run_jaxserve(prompts, max_new, args)
    print(f"jaxserve: {js['tok_s']:.1f} tok/s ({js['e2e_s']:.1f} s), bare step "
          f"{js['bare_tok_s']:.1f} tok/s, efficiency {js['efficiency']:.3f}", flush=True)
    hf = None
    if not args.skip_transformers:
        hf = run_transformers(prompts, max_new, args)
        print(f"transformers generate_batch: {hf['tok_s']:.1f} tok/s ({hf['s']:.1f} s)", flush=True)

    device = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores visible, " \
             f"jax {jax.__version__} ({jax.default_backend()})"
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    rows = [("jaxserve `LLM.generate` tokens/s", f"{js['tok_s']:.1f}"),
            ("transformers `generate_batch` tokens/s",
             f"{hf['tok_s']:.1f} (transformers {hf['version']}, {hf['threads']} torch threads)"
             if hf else "skipped"),
            ("speed-up (target >= 3x)", f"{js['tok_s'] / hf['tok_s']:.2f}x" if hf else "-"),
            ("greedy agreement with transformers (mean leading-token match)",
             f"{_agreement(js['outputs'], hf['outputs']):.3f}" if hf else "-"),
            ("bare jitted step tokens/s (same shapes and arrays, replayed)",
             f"{js['bare_tok_s']:.1f}"),
            ("engine efficiency = e2e / bare (target >= 0.9)", f"{js['efficiency']:.3f}"),
            ("KV slot utilisation, mean over steps (min) (target >= 0.95)",
             f"{js['kv_util_mean']:.3f} ({js['kv_util_min']:.3f})"),
            ("engine steps / preemptions", f"{js['steps']} / {js['num_preemptions']}"),
            ("compiled step programs (token buckets x prompt-logprobs variant)", f"{js['programs']} {js['buckets']}"),
            ("warm-up s (start-up s incl. load)", f"{js['warmup_s']:.1f} ({js['startup_s']:.1f})")]
    shapes = ", ".join(f"{t}{' +prompt logprobs' if p else ''}: {c}"
                       for (t, p), c in sorted(js["shapes"].items()))
    total = js["e2e_s"]
    phases = "; ".join(f"{k} {v:.2f} s ({100 * v / total:.0f}%)"
                       for k, v in sorted(js["phase"].items(), key=lambda kv: -kv[1]))
    table = ["| metric | value |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in rows]
    text = "\n".join(table) + f"\n\nStep shapes run (token bucket: count): {shapes}.\n" \
        f"Where the {total:.1f} s went: {phases}.\n"
    print()
    print(text)
    if args.append:
        header = (f"\n### {datetime.date.today().isoformat()} — {num} prompts x {max_new} tokens"
                  f"{' (quick)' if args.quick else ''}\n\nDevice: {device}. Default model "
                  f"(SmolLM2-135M-Instruct Q4_1 GGUF, dequantised to f32), greedy, EOS ignored, "
                  f"max_num_batched_tokens={args.max_num_batched_tokens}, "
                  f"max_num_seqs={args.max_num_seqs}.\nCommand: `{cmd}`\n\n")
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
        with open(path, "a") as f:
            section = "## Engine throughput (CPU)"
            existing = open(path).read() if os.path.exists(path) else ""
            if section not in existing:
                f.write(f"\n{section}\n")
            f.write(header + text)
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
