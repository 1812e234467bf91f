"""Speculative decoding with a draft model (`speculative_config={"model": PATH}`): config
checks, the draft's vocabulary and tokenizer checks, and the engine on the default model with a
draft of its first two layers (exported as a checkpoint), with the target itself as draft (~100%
acceptance, also after a preemption and on prefix-cache hits: the draft's KV must be valid for
every cached block) and with a random draft: greedy and seeded outputs identical with and
without drafts, an abort beside a drafting request, and no compilation after the draft's
warm-up."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from jaxserve.config import EngineArgs, SpeculativeConfig
from jaxserve.sampling_params import SamplingParams

COPY = ["Repeat this list exactly, one per line: apple, banana, cherry, date, elderberry, fig, "
        "grape, honeydew.",
        "Rewrite this code with the variable x renamed to y:\n\ndef f(x):\n    x = x + 1\n"
        "    return x * 2\n"]
OPEN = ["Write a short poem about the sea."]
K = 3


def test_draft_model_config():
    spec = EngineArgs(speculative_config={"model": "/some/draft", "num_speculative_tokens": K})
    assert spec.spec_config() == SpeculativeConfig(method="draft_model", model="/some/draft",
                                                   num_speculative_tokens=K)
    sched = spec.scheduler_config(256)
    assert sched.num_speculative_tokens == sched.num_lookahead_tokens == K
    ngram = EngineArgs(speculative_config={"method": "ngram"}).scheduler_config(256)
    assert ngram.num_lookahead_tokens == 0
    for bad in ({"method": "draft_model"}, {"method": "ngram", "model": "/some/draft"}):
        with pytest.raises(ValueError, match="speculative_config.model"):
            EngineArgs(speculative_config=bad)


def test_draft_with_another_vocabulary_is_refused(tmp_path):
    """Checked from the draft's config before any draft weight is read."""
    from jaxserve.engine.llm_engine import LLMEngine
    target, draft = tmp_path / "target", tmp_path / "draft"
    base = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True)
    for d, vocab in ((target, 512), (draft, 1000)):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(dict(base, vocab_size=vocab)))
    args = EngineArgs(model=str(target), load_format="dummy", max_model_len=128,
                      num_gpu_blocks_override=16, speculative_config={"model": str(draft)})
    with pytest.raises(ValueError, match=r"speculative_config\.model.*vocabulary \(1000"):
        LLMEngine(args, warmup=False)
    args = dataclasses.replace(args, speculative_config={"model": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match=r"speculative_config\.model: model path .* does not exist"):
        LLMEngine(args, warmup=False)


# -- the engine on the default model --------------------------------------------------------


@pytest.fixture(scope="module")
def draft_llm(tmp_path_factory):
    """The default model with a draft of its first 2 layers (+ final norm and head), written
    with loader/export.py and loaded back by path."""
    from jaxserve import LLM
    from jaxserve.default_model import default_model_path
    from jaxserve.loader.export import export_model, truncate_layers
    from jaxserve.loader.gguf import read_gguf
    from jaxserve.loader.loader import load_model
    from jaxserve.tokenizer.tokenizer import Tokenizer
    path = default_model_path()
    reader = read_gguf(path)
    cfg, weights = load_model(path, jnp.float32, gguf_reader=reader)
    draft_dir = tmp_path_factory.mktemp("draft2")
    draft_cfg, draft_weights = truncate_layers(cfg, weights, 2)
    export_model(draft_dir, draft_cfg, Tokenizer.from_gguf(reader), draft_weights)
    del weights, draft_weights, reader
    llm = LLM(warmup=False, max_model_len=512, max_num_batched_tokens=128, max_num_seqs=16,
              num_gpu_blocks_override=256, seed=0,
              speculative_config={"model": str(draft_dir), "num_speculative_tokens": K})
    # Every step costs the same here, whatever its tokens: drafts run whenever the proposer
    # offers them. Whether they pay for a larger token bucket is decided from measured step
    # times (`Proposer.fit`, test_spec_proposer.py): on a loaded CI machine the measurements
    # said no, and these tests, which check what drafts do, saw none run.
    llm.llm_engine.runner.step_cost = lambda num_tokens: 1.0
    yield llm
    llm.shutdown()


def _run(llm, prompts, params, *, drafts: bool, **kw):
    """Chat completions (prompts as token id lists: plain completions) with the draft model
    proposing, or with speculation off; `kw` goes to the call (lora_request)."""
    engine = llm.llm_engine
    proposer = engine.proposer
    if not drafts:
        engine.proposer = None
    try:
        if prompts and isinstance(prompts[0], list):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, **kw)
        else:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False, **kw)
    finally:
        engine.proposer = proposer
    return [c for o in outs for c in o.outputs]


def _acceptance(engine, before) -> float:
    after = engine.stats()
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert drafted > 0
    return (after.spec_num_accepted_tokens - before.spec_num_accepted_tokens) / drafted


@contextlib.contextmanager
def other_draft(llm, cfg, weights):
    """Swap the engine's draft model (a fresh pool of the same blocks) for the block."""
    from jaxserve.worker.draft_runner import DraftRunner
    engine = llm.llm_engine
    runner = engine.runner
    old = runner.drafter
    runner.drafter = DraftRunner(cfg, weights, num_blocks=runner.num_blocks,
                                 block_size=runner.block_size, max_model_len=engine.max_model_len,
                                 max_num_seqs=engine.args.max_num_seqs, num_speculative_tokens=K,
                                 dtype=jnp.float32, backend=engine.attention_backend)
    try:
        yield
    finally:
        for x in jax.tree_util.tree_leaves(runner.drafter.cache):
            x.delete()
        runner.drafter = old


GREEDY = SamplingParams(temperature=0, max_tokens=24)


def test_greedy_identical_with_a_truncated_draft_alone_and_mixed(draft_llm):
    engine = draft_llm.llm_engine
    base = [o.token_ids for o in _run(draft_llm, COPY + OPEN, GREEDY, drafts=False)]
    before = engine.stats()
    mixed = _run(draft_llm, COPY + OPEN, GREEDY, drafts=True)
    alone = _run(draft_llm, COPY[:1], GREEDY, drafts=True)
    assert [o.token_ids for o in mixed] == base
    assert alone[0].token_ids == base[0]
    # drafts were verified; how many a 2-layer draft gets accepted is the proposer's business
    # (a request whose first drafts are rejected pauses them, and beyond the free room of the
    # step's token bucket a draft must pay for itself), so none may be: acceptance is the
    # self-draft test's
    assert engine.stats().spec_num_draft_tokens > before.spec_num_draft_tokens
    assert not engine.scheduler.kv_cache_manager.req_to_blocks


def test_self_draft_accepts_nearly_all_also_after_preemption_and_prefix_hits(draft_llm, variant):
    """The target as its own draft: greedy drafts are what the target says, so acceptance is
    ~100% unless the draft's KV is wrong somewhere: after a preemption (recomputed KV) and on
    prefix-cache hits (blocks whose draft KV was written by an earlier request)."""
    engine = draft_llm.llm_engine
    runner = engine.runner
    base = [o.token_ids for o in _run(draft_llm, COPY * 2, GREEDY, drafts=False)]
    with other_draft(draft_llm, runner.cfg, runner.weights):
        with variant(draft_llm, num_blocks=9) as sched:         # 144 slots: preempts
            before = engine.stats()
            tight = _run(draft_llm, COPY * 2, GREEDY, drafts=True)
            assert sched.num_preemptions_total > 0
            assert _acceptance(engine, before) > 0.9
        assert [o.token_ids for o in tight] == base
        with variant(draft_llm, enable_prefix_caching=True) as sched:
            _run(draft_llm, COPY, GREEDY, drafts=True)
            before = engine.stats()
            again = _run(draft_llm, COPY, GREEDY, drafts=True)           # prefix-cache hits
            assert sched.prefix_cache_stats.hits > 0
            assert _acceptance(engine, before) > 0.9
        assert [o.token_ids for o in again] == base[:2]


def test_random_draft_keeps_greedy_output(draft_llm):
    from jaxserve.loader.dummy import dummy_weights
    runner = draft_llm.llm_engine.runner
    cfg = dataclasses.replace(runner.cfg, num_layers=1)
    # Both runs after one that caches the prompts: a prompt computed whole (its rows in bf16
    # tiles under `--dtype auto`) and one hitting the prefix cache (a few rows: the fused kernel)
    # differ by ~1e-2 in a logprob, enough to flip a greedy near tie (seen on an AVX-512 EPYC).
    _run(draft_llm, COPY[:1] + OPEN, GREEDY, drafts=False)
    base = [o.token_ids for o in _run(draft_llm, COPY[:1] + OPEN, GREEDY, drafts=False)]
    with other_draft(draft_llm, cfg, dummy_weights(cfg, jnp.float32, None, 3)):
        spec = _run(draft_llm, COPY[:1] + OPEN, GREEDY, drafts=True)
    assert [o.token_ids for o in spec] == base


def test_seeded_sampling_identical_with_a_draft_model(draft_llm):
    """Exact verification keeps each position's noise, so a seeded request samples the same
    tokens with and without drafts: temperature 1 with top-p (n=2 children), min_p and
    logit_bias, and penalties (opted out of drafts)."""
    engine = draft_llm.llm_engine
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, n=2),
              SamplingParams(temperature=0.8, min_p=0.05, seed=8, max_tokens=24,
                             logit_bias={11: 2.0}, logprobs=2),
              SamplingParams(temperature=1.0, seed=9, max_tokens=24, repetition_penalty=1.3,
                             presence_penalty=0.5)]
    prompts = [COPY[0], COPY[1], COPY[0]]
    base = _run(draft_llm, prompts, params, drafts=False)
    before = engine.stats()
    spec = _run(draft_llm, prompts, params, drafts=True)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    assert engine.stats().spec_num_draft_tokens > before.spec_num_draft_tokens
    for a, b in zip(base[2].logprobs, spec[2].logprobs):
        assert a.keys() == b.keys()
        for tok in a:
            assert a[tok].logprob == pytest.approx(b[tok].logprob, abs=1e-4)


def warmup_then_no_compile(llm, expected_programs) -> None:
    """Run once (the target's programs for this batch), rebuild the drafter's programs by its
    warm-up, check them (`expected_programs(runner, drafter)`), then serving compiles nothing."""
    from test_no_compile_while_serving import count_compilations
    engine = llm.llm_engine
    runner, drafter = engine.runner, engine.runner.drafter
    params = [SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0.9, top_p=0.8, seed=1, max_tokens=12)]
    # The target's programs for this batch (no prefix hits, so both runs have the same steps).
    assert engine.scheduler.reset_prefix_cache()
    _run(llm, COPY, params, drafts=True)
    assert engine.scheduler.reset_prefix_cache()
    drafter._executables.clear()
    drafter.warmup(lambda T: runner._build([], T, False)[0], runner.buckets)
    assert drafter.compiled_programs == expected_programs(runner, drafter)
    with count_compilations() as seen:
        _run(llm, COPY, params, drafts=True)
    assert not seen


def test_warmup_compiles_every_draft_program(draft_llm):
    """The draft's warm-up compiles a catch-up per token bucket and a proposal loop per sequence
    bucket; with them (and the target's programs of a first identical run) serving compiles
    nothing."""
    warmup_then_no_compile(draft_llm, lambda runner, drafter: sorted(
        [("catch_up", T) for T in runner.buckets] + [("propose", S) for S in drafter.seq_buckets]))


def test_abort_beside_a_drafting_request(draft_llm):
    """The draft keeps no per-request state beyond its pool: aborting a drafting request mid-run
    leaves its neighbour's greedy output as without drafts."""
    engine = draft_llm.llm_engine

    def run(drafts: bool, abort_after: int | None):
        proposer = engine.proposer
        engine.proposer = proposer if drafts else None
        try:
            engine.add_request("keep", COPY[0], GREEDY)
            engine.add_request("gone", COPY[1], GREEDY)
            done, steps = {}, 0
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0].token_ids
                steps += 1
                if steps == abort_after:
                    engine.abort_request("gone")
            return done
        finally:
            engine.proposer = proposer

    base = run(False, None)
    before = engine.stats()
    spec = run(True, 4)
    assert spec["keep"] == base["keep"] and len(spec["gone"]) < len(base["gone"])
    assert engine.stats().spec_num_draft_tokens > before.spec_num_draft_tokens
    assert not engine.scheduler.kv_cache_manager.req_to_blocks


def test_draft_with_another_tokenizer_of_the_same_size_is_refused(draft_llm, tmp_path):
    from jaxserve.tokenizer.tokenizer import Tokenizer
    from jaxserve.worker.draft_runner import read_draft_config
    engine = draft_llm.llm_engine
    cfg = engine.model_config
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=64,
        intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True)))
    Tokenizer.synthetic(cfg.vocab_size).backend.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"speculative_config\.model.*tokenizer"):
        read_draft_config(tmp_path, cfg, engine.tokenizer)
    assert read_draft_config(tmp_path, cfg, None).vocab_size == cfg.vocab_size
