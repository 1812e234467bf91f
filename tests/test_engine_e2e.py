"""End-to-end engine behaviour on the default model (SmolLM2-135M, f32, CPU).

Greedy outputs must not depend on how requests are batched, chunked, cached or preempted; seeded
sampling must not depend on the batch; every SamplingParams feature is checked on real outputs,
and logprobs against a direct forward pass of the same weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import engine_variant

from jaxserve import SamplingParams
from jaxserve.attention import AttentionMetadata
from jaxserve.attention import kv_cache as kvc

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

_TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
         "Gutenberg combined movable metal type, oil-based ink and a screw press adapted from "
         "wine making. Within fifty years presses were running in more than two hundred cities "
         "across Europe, and the price of books fell so far that ordinary merchants could own "
         "them. Scholars argue about how much the press changed the pace of science, but few "
         "doubt that it made the Reformation spread faster than any earlier religious movement. "
         "Newspapers, pamphlets and cheap almanacs followed, and with them a reading public that "
         "expected news every week rather than every season. By the nineteenth century steam "
         "driven rotary presses printed thousands of sheets an hour, and literacy rose in step. ")

PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colours: red,",
    "1, 2, 3, 4, 5,",
    "Question: What is the boiling point of water at sea level?\nAnswer:",
    "import numpy as np\n\ndef softmax(x):\n    ",
    _TEXT[:300],
    "The quick brown fox",
    _TEXT * 2,                                  # longer than max_num_batched_tokens (128)
    "Translate to French: Good morning, how are you today?",
]


def _texts_and_ids(outs):
    return [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outs]


@pytest.fixture(scope="module")
def alone(llm):
    """Greedy reference: each prompt run by itself."""
    tok = llm.get_tokenizer()
    assert len(tok.encode(PROMPTS[10])) > llm.llm_engine.scheduler_config.max_num_batched_tokens
    return [_texts_and_ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS]


def _check_matches_alone(outs, alone, prompts=PROMPTS):
    got = _texts_and_ids(outs)
    assert len(got) == len(prompts)
    for i, (g, p) in enumerate(zip(got, prompts)):
        ref = alone[PROMPTS.index(p)]
        assert g[1] == ref[1], f"prompt {i} ({p[:30]!r}) differs: {g[0]!r} vs {ref[0]!r}"
        assert g[0] == ref[0]
        assert len(g[1]) == MAX_TOKENS


# -- greedy invariance ------------------------------------------------------------------------
def test_greedy_batch_matches_alone(llm, alone):
    _check_matches_alone(llm.generate(PROMPTS, GREEDY, use_tqdm=False), alone)


def test_greedy_64_at_a_time_matches_alone(llm, alone):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)   # later copies hit the prefix cache
    assert llm.llm_engine.scheduler.num_preemptions_total == 0
    _check_matches_alone(outs, alone, prompts)


def test_greedy_without_prefix_caching_matches_alone(llm, alone):
    with engine_variant(llm, enable_prefix_caching=False) as sched:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert sched.prefix_cache_stats.hits == 0
    _check_matches_alone(outs, alone)
    assert all(o.num_cached_tokens == 0 for o in outs)


def test_greedy_under_preemption_matches_alone(llm, alone):
    # 40 blocks of 16 tokens hold the longest request (~230 tokens) but not all 12 at once.
    with engine_variant(llm, num_blocks=40) as sched:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert sched.num_preemptions_total > 0
        assert sched.kv_cache_usage == 0.0
    _check_matches_alone(outs, alone)


def test_greedy_with_small_token_budget_chunks_and_matches_alone(llm, alone):
    with engine_variant(llm, max_num_batched_tokens=32, enable_prefix_caching=False) as sched:
        steps = []
        original = sched.schedule

        def schedule(*args, **kwargs):
            out = original(*args, **kwargs)
            steps.append(out.num_scheduled_tokens)
            return out
        sched.schedule = schedule
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert max(steps) == 32                       # prompts were split into 32-token chunks
    _check_matches_alone(outs, alone)


# -- prefix caching ---------------------------------------------------------------------------
def test_prefix_cache_second_identical_request_hits_and_matches(llm):
    prompt = "A prefix-cache test prompt. " + _TEXT[:200]
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    second = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens > 0
    assert second.num_cached_tokens % 16 == 0
    assert second.num_cached_tokens < len(second.prompt_token_ids)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.outputs[0].text == first.outputs[0].text


# -- seeded sampling --------------------------------------------------------------------------
def test_seeded_sampling_reproducible_and_batch_independent(llm, alone):
    sp = SamplingParams(temperature=0.8, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = PROMPTS[3]
    a = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
    assert a != alone[3][1][:12]                  # really sampled, not greedy
    others = [SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=4321, max_tokens=12, ignore_eos=True), GREEDY]
    mixed = llm.generate([PROMPTS[1], PROMPTS[5], prompt, prompt, PROMPTS[8]],
                         [others[0], others[1], sp, others[2], others[3]], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == a     # same seeded request among others
    assert mixed[3].outputs[0].token_ids != a     # another seed differs


def test_n_gives_n_distinct_samples(llm):
    out = llm.generate(PROMPTS[3], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8,
                                                  ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.finished


# -- stopping ---------------------------------------------------------------------------------
def test_stop_string_cut_and_included(llm, alone):
    text = alone[3][0]
    stop = text[10:14]
    assert stop.strip() and text.find(stop) == 10
    out = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                  stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:10]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=stop,
                                                  include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:14]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_token_ids_stop_reason_is_the_token(llm, alone):
    ids = alone[2][1]
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                  stop_token_ids=[ids[k]]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[:k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == ids[k]


def test_ignore_eos_gives_exactly_max_tokens(llm):
    prompt = {"prompt_token_ids": llm.get_tokenizer().encode(PROMPTS[0])}
    eos = llm.get_tokenizer().eos_token_id
    # logit_bias on EOS makes the model want to stop at once; ignore_eos keeps it going.
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True,
                                              logit_bias={eos: 100}), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.token_ids == [eos] * 7
    assert c.finish_reason == "length" and c.stop_reason is None
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=7,
                                              logit_bias={eos: 100}), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [eos]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None


def test_min_tokens_masks_stop_tokens(llm, alone):
    ids = alone[5][1]
    stop = ids[0]
    out = llm.generate(PROMPTS[5], SamplingParams(temperature=0, max_tokens=12, min_tokens=4,
                                                  stop_token_ids=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 4
    assert stop not in out.token_ids[:4]
    assert out.token_ids[0] != ids[0]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == stop and stop not in out.token_ids[:-1]
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 12


# -- logprobs ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def direct_logits(llm):
    """token ids -> [n, V] f32 logits from one forward pass of the model over a private cache."""
    runner = llm.llm_engine.runner
    cfg, model = runner.cfg, runner._model
    B = 16

    @jax.jit
    def forward(weights, cache, tokens, meta):
        hidden, _ = model.forward(weights, cache, tokens, jnp.arange(tokens.shape[0]), meta,
                                  cfg=cfg, backend="reference")
        return model.compute_logits(weights, hidden)

    def run(token_ids):
        n = len(token_ids)
        nb = -(-n // B)
        cache = kvc.allocate(cfg.num_layers, nb, B, cfg.num_kv_heads, cfg.head_dim,
                             runner.cache.k.dtype)
        meta = AttentionMetadata(np.arange(n, dtype=np.int32),
                                 np.arange(nb, dtype=np.int32)[None], np.array([n], np.int32),
                                 np.array([0, n], np.int32), np.array([1], np.int32))
        return np.asarray(forward(runner.weights, cache, np.asarray(token_ids, np.int32), meta))
    return run


def _log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_logprobs_layout_and_values(llm, direct_logits):
    k = 3
    out = llm.generate(PROMPTS[6], SamplingParams(temperature=0.8, seed=3, max_tokens=6,
                                                  ignore_eos=True, logprobs=k),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 6
    ref = _log_softmax(direct_logits(out.prompt_token_ids + c.token_ids[:-1]))
    P = len(out.prompt_token_ids)
    tok = llm.get_tokenizer()
    total = 0.0
    for i, (t, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        assert isinstance(entry, dict) and t in entry
        assert k <= len(entry) <= k + 1
        row = ref[P - 1 + i]
        top = np.argsort(-row)[:k]
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(row[tid], abs=2e-3)
            assert lp.rank == 1 + int(np.sum(row > row[tid] + 1e-4)) or \
                abs(row[tid] - np.sort(row)[::-1][lp.rank - 1]) < 1e-3
            assert lp.decoded_token == tok.decode_token(tid)
        assert set(top.tolist()) <= set(entry)
        total += entry[t].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_logprobs_zero_gives_only_sampled_token(llm):
    c = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, logprobs=0),
                     use_tqdm=False)[0].outputs[0]
    assert [list(e) for e in c.logprobs] == [[t] for t in c.token_ids]
    assert all(e[t].rank == 1 for e, t in zip(c.logprobs, c.token_ids))   # greedy = top 1


def test_prompt_logprobs_layout_and_values(llm, direct_logits):
    k = 2
    prompt = PROMPTS[10]        # longer than the token budget: scored over several chunks
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k),
                       use_tqdm=False)[0]
    ids = out.prompt_token_ids
    pl = out.prompt_logprobs
    assert len(pl) == len(ids) and pl[0] is None
    ref = _log_softmax(direct_logits(ids))
    for j in range(1, len(ids)):
        entry = pl[j]
        assert ids[j] in entry and len(entry) <= k + 1
        assert entry[ids[j]].logprob == pytest.approx(ref[j - 1, ids[j]], abs=2e-3)
        best = int(np.argmax(ref[j - 1]))
        assert best in entry and entry[best].rank == 1


# -- logits processors ------------------------------------------------------------------------
def test_logit_bias_forces_a_token(llm):
    tok = llm.get_tokenizer()
    forced = tok.encode(" banana", add_special_tokens=False)[-1]
    c = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                logit_bias={forced: 100.0}),
                     use_tqdm=False)[0].outputs[0]
    assert c.token_ids == [forced] * 5


def _penalized(logits, prompt, output, presence, frequency, repetition):
    """vLLM's apply_penalties on one row."""
    logits = logits.astype(np.float64).copy()
    counts = np.bincount(np.asarray(output, np.int64), minlength=len(logits)) if output else \
        np.zeros(len(logits))
    seen = counts > 0
    seen[np.asarray(prompt)] = True
    logits = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency * counts - presence * (counts > 0)


@pytest.mark.parametrize("penalty", [dict(presence_penalty=1.5), dict(frequency_penalty=1.0),
                                     dict(repetition_penalty=1.6)])
def test_penalties_follow_vllm_formulas(llm, direct_logits, penalty):
    prompt = "one two three one two three one two three one two three one two"
    n = 8
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                        use_tqdm=False)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                              **penalty), use_tqdm=False)[0]
    got = out.outputs[0].token_ids
    assert got != base.outputs[0].token_ids
    P = out.prompt_token_ids
    logits = direct_logits(P + got[:-1])
    args = dict(presence=penalty.get("presence_penalty", 0.0),
                frequency=penalty.get("frequency_penalty", 0.0),
                repetition=penalty.get("repetition_penalty", 1.0))
    for i in range(n):
        row = _penalized(logits[len(P) - 1 + i], P, got[:i], **args)
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] > 1e-3:             # skip near ties
            assert got[i] == int(np.argmax(row)), f"token {i}"
    # Penalised outputs repeat themselves less than the greedy pattern-follower.
    if "repetition_penalty" in penalty:
        assert sum(t in P for t in got) < sum(t in P for t in base.outputs[0].token_ids)
    else:
        assert len(set(got)) > len(set(base.outputs[0].token_ids))


# -- abort ------------------------------------------------------------------------------------
def test_abort_running_request_frees_its_blocks(llm):
    engine = llm.llm_engine
    assert engine.scheduler.kv_cache_usage == 0.0
    engine.add_request("abort-me", PROMPTS[8], SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("keep-me", PROMPTS[1], SamplingParams(temperature=0, max_tokens=3))
    outs = []
    for _ in range(3):
        outs += engine.step()
    assert engine.scheduler.kv_cache_usage > 0.0
    engine.abort_request("abort-me")
    while engine.has_unfinished_requests():
        outs += engine.step()
    by_id = {o.request_id: o for o in outs if o.finished}
    assert by_id["abort-me"].outputs[0].finish_reason == "abort"
    assert by_id["keep-me"].outputs[0].finish_reason == "length"
    assert engine.scheduler.kv_cache_usage == 0.0
    assert not engine.processor.has("abort-me")
