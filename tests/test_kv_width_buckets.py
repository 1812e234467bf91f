"""KV width buckets: where the reference attention takes its static form (on a GPU: loops of static
trip count over the block tables' whole width), a step runs at the narrowest block-table width
that holds its sequences, from programs compiled per width. Here on CPU, the static form forced:
the engine's greedy tokens equal the dynamic form's while its steps move between widths."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxserve.worker import buckets

TINY = str(Path(__file__).resolve().parent / "data" / "tiny-llama")
FLAGS = dict(load_format="dummy", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32,
             num_gpu_blocks_override=64, attention_backend="reference", program_cache_dir="")
PROMPTS = ["t5 t6 t7 t8", "t1 t2 " * 20, "t9 t9 t9"]


def test_widths_are_quarters_down_to_the_smallest_allowed():
    assert [w * 16 for w in buckets.kv_widths(512, 16)] == [512, 2048, 8192]
    assert [w * 16 for w in buckets.kv_widths(8192, 16)] == [2048, 8192, 32768, 131072]
    assert buckets.kv_widths(16, 16) == (16,)           # max_model_len 256: one width
    assert buckets.kv_widths(7, 16) == (7,)


def _generate(monkeypatch, static: bool):
    from jaxserve import LLM, SamplingParams
    from jaxserve.attention import reference
    if static:
        monkeypatch.setattr(reference, "static_form", lambda platform=None: True)
        monkeypatch.setattr(buckets, "KV_WIDTH_MIN_TOKENS", 32)     # 16 blocks -> widths 4, 16
    llm = LLM(TINY, **FLAGS)
    runner = llm.llm_engine.runner
    seen = []
    build = runner._build

    def spy(scheduled, *args, **kwargs):
        x, layout = build(scheduled, *args, **kwargs)
        if scheduled:
            seen.append((x.meta.block_tables.shape[1], max(len(s.block_ids) for s in scheduled)))
        return x, layout
    monkeypatch.setattr(runner, "_build", spy)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=0), use_tqdm=False)
    monkeypatch.undo()
    return [o.outputs[0].token_ids for o in outs], runner, seen


@pytest.mark.slow
def test_static_form_with_width_buckets_gives_the_dynamic_forms_tokens(monkeypatch):
    want, plain, plain_seen = _generate(monkeypatch, static=False)
    got, runner, seen = _generate(monkeypatch, static=True)
    assert got == want
    assert plain.kv_widths == (16,) and {w for w, _ in plain_seen} == {16}
    assert runner.kv_widths == (4, 16)
    # each step at the narrowest width that holds its sequences' blocks: 4 until the long prompt's
    # sequence (~40 tokens + 48) passes 4 blocks of 16
    assert all(need <= w and (w == 4 or need > 4) for w, need in seen), seen
    assert {w for w, _ in seen} == {4, 16}, seen
    keys = runner.compiled_programs
    assert (16, False, 4) in keys and (16, False) in keys and not any(k[1] and len(k) > 2 for k in keys)
    assert runner.program_name((16, False, 4)) == "step_16_kv4blocks"
