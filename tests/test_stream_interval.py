"""`stream_interval` (vLLM's --stream-interval): a streamed (DELTA) request's outputs come every N
tokens (its first token and its finish at once) and add up to exactly what every-token outputs
give; other output kinds are untouched; a bad value is refused naming the field."""

from __future__ import annotations

import pytest

from jaxserve.config import EngineArgs
from jaxserve.sampling_params import RequestOutputKind, SamplingParams


def _run(engine, interval: int, params: SamplingParams, prompts: list[list[int]]) -> dict:
    """Every output of each request -> {request id: [(child index, token ids, text, finish)]}."""
    engine.processor.stream_interval = interval
    try:
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{interval}-{i}", {"prompt_token_ids": ids}, params)
        got: dict = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got.setdefault(out.request_id.split("-")[1], []).extend(
                    (c.index, list(c.token_ids), c.text, c.finish_reason) for c in out.outputs)
        return got
    finally:
        engine.processor.stream_interval = 1


@pytest.mark.parametrize("n", [1, 2])
def test_outputs_every_n_tokens_add_up_to_the_same_stream(llm, n):
    engine = llm.llm_engine
    prompts = [engine.tokenizer.encode(p) for p in ("The capital of France is", "One, two, three,")]
    params = SamplingParams(n=n, temperature=0.8, seed=7, max_tokens=11, ignore_eos=True, stop=["zzz"],
                            output_kind=RequestOutputKind.DELTA)
    each, every4 = _run(engine, 1, params, prompts), _run(engine, 4, params, prompts)
    assert each.keys() == every4.keys() == {"0", "1"}
    for rid in each:
        for child in range(n):
            a = [o for o in each[rid] if o[0] == child]
            b = [o for o in every4[rid] if o[0] == child]
            # the same tokens, text and finish, in fewer pieces: 1, then 4s, then the rest at the finish
            assert [t for o in a for t in o[1]] == [t for o in b for t in o[1]]
            assert "".join(o[2] for o in a) == "".join(o[2] for o in b)
            assert a[-1][3] == b[-1][3] == "length"
            assert [len(o[1]) for o in a] == [1] * 11
            assert [len(o[1]) for o in b] == [1, 4, 4, 2], b


def test_other_output_kinds_and_bad_values(llm):
    engine = llm.llm_engine
    ids = engine.tokenizer.encode("Hello there")
    final = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    cumulative = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert _run(engine, 4, final, [ids]) == _run(engine, 1, final, [ids])
    assert [len(o[1]) for o in _run(engine, 4, cumulative, [ids])["0"]] == [1, 2, 3, 4, 5, 6]
    for bad in (0, -2, 1.5, "4"):
        with pytest.raises(ValueError, match="stream_interval must be an integer >= 1"):
            EngineArgs(stream_interval=bad)


def test_the_serve_flag_sets_it():
    from jaxserve.server.cli.flags import engine_args_from
    from jaxserve.server.cli.main import build_parser
    ns = build_parser().parse_args(["serve", "--stream-interval", "8"])
    assert engine_args_from(ns).stream_interval == 8
    assert engine_args_from(build_parser().parse_args(["serve"])).stream_interval == 1
