"""EAGLE-3 training step time: only the anchors around each answer (`answer_window`, what `train`
does) against every anchor, on the default model's data, in one sitting (A B A B).

    python benchmarks/bench_eagle3_step.py [--cache DIR] [--sequences 400] [--steps 40] [--rounds 2]

The data is `bench_eagle3_labels.py`'s cache (made there first: DIR/train.npz). Both forms run
the same optimizer as `train` (`make_optimizer`) from the same head on the same batches; each times
`--steps` steps after two warm-up steps (the second call compiles once more for the donated
layouts). Prints ms a step, XLA's FLOP count of each step and the losses (equal: the same sums).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", default="/tmp/jaxserve-eagle3-labels")
    ap.add_argument("--sequences", type=int, default=400)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    path = os.path.join(a.cache, "train.npz")
    if not os.path.exists(path):
        raise SystemExit(f"{path} is missing: run benchmarks/bench_eagle3_labels.py once to make it")
    import jax

    from jaxserve import LLM
    from jaxserve.models import eagle3, get_model
    from jaxserve.training import eagle3 as T
    z = np.load(path)
    n = a.sequences
    data = T.Eagle3Data(z["tokens"][:n], z["features"][:n], z["embeds"][:n], z["answer"][:n])
    llm = LLM(warmup=False, max_model_len=512, max_num_seqs=8)
    cfg, weights = llm.llm_engine.runner.cfg, llm.llm_engine.runner.weights
    ecfg = eagle3.config_for(cfg, draft_vocab_size=4096)      # train-eagle3's default
    ids = T.draft_vocabulary(data, ecfg.draft_vocab_size, cfg.vocab_size)
    optimizer = T.make_optimizer(1e-3, a.steps + 2)
    widths = {"answer window": T.answer_window(data.answer, 3), "every anchor": None}
    times: dict[str, list[float]] = {k: [] for k in widths}
    for _ in range(a.rounds):
        for name, width in widths.items():
            head = T.new_head(ecfg, weights, get_model(cfg.architecture), ids, jax.random.key(0))
            t2d = T.target_to_draft(head, cfg.vocab_size)
            params = dataclasses.replace(head, d2t=None)
            state = optimizer.init(params)
            step = T.make_train_step(ecfg, optimizer, 3, width)
            flops = step.lower(params, state, head.d2t, t2d, *data.rows(np.arange(4))).compile().cost_analysis()
            flops = (flops[0] if isinstance(flops, list) else flops).get("flops", 0.0)
            losses = []
            for i in range(a.steps + 2):
                if i == 2:
                    jax.block_until_ready(params)
                    t0 = time.perf_counter()
                sel = np.arange(4 * i, 4 * i + 4) % len(data)
                params, state, loss, _ = step(params, state, head.d2t, t2d, *data.rows(sel))
                losses.append(loss)
            jax.block_until_ready(params)
            times[name].append((time.perf_counter() - t0) / a.steps)
            print(f"{name} (width {width or data.tokens.shape[1]} of {data.tokens.shape[1]}): "
                  f"{times[name][-1] * 1e3:.0f} ms a step, {flops / 1e9:.1f} GFLOP, "
                  f"last loss {float(losses[-1]):.5f}", flush=True)
    best = {k: min(v) for k, v in times.items()}
    print(f"every anchor / answer window: {best['every anchor'] / best['answer window']:.2f}x "
          f"({best['every anchor'] * 1e3:.0f} vs {best['answer window'] * 1e3:.0f} ms a step, best of {a.rounds})")
    llm.shutdown()


if __name__ == "__main__":
    main()
