"""jaxserve.sample.sampler on synthetic logits: greedy, filters, the sampled distribution, per-row seeds,
penalties and logit_bias (vLLM's formulas), min_tokens masking, logprobs from the raw logits."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core.scheduler import NewRequestData
from jaxserve.sample import penalties
from jaxserve.sample.sampler import CANDIDATES, SamplingTensors, _apply_filters, argmax_last, score
from jaxserve.sample.sampler import sample as _sample
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.input_batch import InputBatch

V = 32
NO_PENALTIES = penalties.zeros(1, V)


def sample(logits, t, state=NO_PENALTIES, k=0):
    return _sample(logits, t, state, k=k)


def tensors(R, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, positions=None,
            logprobs=False):
    full = lambda v, dt: np.full(R, v, dt)   # noqa: E731
    return SamplingTensors(full(temperature, np.float32), full(top_k, np.int32),
                           full(top_p, np.float32), full(min_p, np.float32),
                           np.arange(R, dtype=np.uint32) if seeds is None
                           else np.asarray(seeds, np.uint32),
                           full(0, np.int32) if positions is None
                           else np.asarray(positions, np.int32),
                           slots=full(R, np.int32), penalised=full(False, bool),
                           min_tokens_active=full(False, bool), presence=full(0, np.float32),
                           frequency=full(0, np.float32), repetition=full(1, np.float32),
                           logprobs=full(logprobs, bool))


def random_logits(R, seed=0, scale=3.0):
    return np.random.default_rng(seed).normal(0, scale, (R, V)).astype(np.float32)


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def ids_of(out):
    return np.asarray(out.token_ids)


def test_greedy_is_argmax():
    logits = random_logits(16)
    out = sample(logits, tensors(16))
    np.testing.assert_array_equal(ids_of(out), logits.argmax(-1))


def test_argmax_last_matches_jnp_argmax_on_ties_infs_and_nans():
    """The sampler's two-reduction argmax picks what jnp.argmax picks: the first maximum on
    ties, the first NaN when a row holds one, under jit, for the batch shapes decode uses."""
    import jax
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 49152)).astype(np.float32)
    x[1, [7, 70, 700]] = 9.0                       # ties: the first
    x[2, :] = -np.inf                              # all -inf: index 0
    x[3, [5, 9]] = np.nan                          # a NaN: the first NaN
    x[4, [11]] = np.inf
    x[4, [3, 40]] = np.nan
    x[5, :] = 1.0
    got = np.asarray(jax.jit(argmax_last)(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert got[1] == 7 and got[2] == 0 and got[3] == 5 and got[4] == 3 and got[5] == 0
    np.testing.assert_array_equal(np.asarray(argmax_last(jnp.asarray(x[:2]))), got[:2])


def test_top_k_1_equals_greedy():
    logits = random_logits(64, seed=1)
    out = sample(logits, tensors(64, temperature=1.0, top_k=1))
    np.testing.assert_array_equal(ids_of(out), logits.argmax(-1))


def test_tiny_top_p_equals_greedy():
    logits = random_logits(64, seed=2)
    out = sample(logits, tensors(64, temperature=1.5, top_p=1e-6))
    np.testing.assert_array_equal(ids_of(out), logits.argmax(-1))


def test_min_p_keeps_only_tokens_above_threshold():
    R = 2000
    row = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05] + [0.0] * (V - 5)) + 1e-12)
    logits = np.tile(row.astype(np.float32), (R, 1))
    ids = ids_of(sample(logits, tensors(R, temperature=1.0, min_p=0.3)))
    # min_p = 0.3 of the top probability 0.4 -> keep p >= 0.12: tokens 0, 1, 2.
    assert set(np.unique(ids)) == {0, 1, 2}
    freq = np.bincount(ids, minlength=3)[:3] / R
    np.testing.assert_allclose(freq, np.array([0.4, 0.3, 0.15]) / 0.85, atol=0.04)


def test_top_k_keeps_the_k_most_likely():
    R = 1000
    logits = np.tile(random_logits(1, seed=3), (R, 1))
    ids = ids_of(sample(logits, tensors(R, temperature=2.0, top_k=3)))
    assert set(np.unique(ids)) <= set(np.argsort(-logits[0])[:3].tolist())


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    R = 2000
    probs = np.array([0.5, 0.25, 0.15, 0.1] + [0.0] * (V - 4))
    logits = np.tile(np.log(probs + 1e-12).astype(np.float32), (R, 1))
    ids = ids_of(sample(logits, tensors(R, temperature=1.0, top_p=0.7)))
    assert set(np.unique(ids)) == {0, 1}          # 0.5 < 0.7 <= 0.75
    assert np.mean(ids == 0) == pytest.approx(2 / 3, abs=0.04)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_matches_softmax(temperature):
    R = 20000
    row = np.random.default_rng(4).normal(0, 1.0, V).astype(np.float32)
    logits = np.tile(row, (R, 1))
    ids = ids_of(sample(logits, tensors(R, temperature=temperature)))
    expected = softmax(row.astype(np.float64) / temperature)
    freq = np.bincount(ids, minlength=V) / R
    sigma = np.sqrt(expected * (1 - expected) / R)
    assert np.all(np.abs(freq - expected) <= 5 * sigma + 1e-3)
    # And the total-variation distance is small.
    assert 0.5 * np.abs(freq - expected).sum() < 0.03


@pytest.mark.parametrize("temperature", [1e6, 1e29, 1e38, np.inf])
def test_a_huge_temperature_never_draws_a_token_the_grammar_forbids(temperature):
    """A request's temperature 2.6e266 is inf in f32; the grammar's forbidden logits (-1e30) and
    logit_bias' -inf must stay undrawable (found by the OpenAPI fuzz test: a 500 "sampled token
    is not allowed by its grammar"). The draw is uniform over the allowed tokens."""
    R = 4000
    logits = random_logits(R)
    logits[:, 5] = -np.inf                      # logit_bias -100 style
    allowed = [3, 5, 7, 11]
    words = np.zeros((R, -(-V // 32)), np.int64)
    for tok in allowed:
        words[:, tok // 32] |= 1 << (tok % 32)
    bitmask = words.astype(np.uint32).view(np.int32)
    ids = ids_of(_sample(logits, tensors(R, temperature=temperature), NO_PENALTIES, k=0,
                         bitmask=bitmask))
    assert set(np.unique(ids)) == {3, 7, 11}
    assert np.all(np.abs(np.bincount(ids, minlength=V)[[3, 7, 11]] / R - 1 / 3) < 0.05)


def test_same_seed_and_position_give_same_token_in_any_row():
    R = 8
    row = np.zeros(V, np.float32)                 # uniform: the noise alone decides
    logits = np.tile(row, (R, 1))
    seeds = np.array([11, 12, 13, 14, 15, 16, 17, 99], np.uint32)
    a = ids_of(sample(logits, tensors(R, 1.0, seeds=seeds, positions=np.arange(R))))
    # Seed 99 at position 7 moved to row 0 of another batch with different neighbours.
    seeds2 = np.array([99, 1, 2, 3], np.uint32)
    b = ids_of(sample(logits[:4], tensors(4, 1.0, seeds=seeds2, positions=[7, 0, 0, 0]),
                      ))
    assert b[0] == a[7]
    # Deterministic, and the position matters.
    c = ids_of(sample(logits, tensors(R, 1.0, seeds=seeds, positions=np.arange(R))))
    np.testing.assert_array_equal(a, c)
    many = ids_of(sample(np.zeros((64, V), np.float32),
                         tensors(64, 1.0, seeds=[99] * 64, positions=np.arange(64))))
    assert len(set(many.tolist())) > 10


def test_greedy_rows_ignore_seed_and_neighbours():
    logits = random_logits(4, seed=5)
    t = tensors(4, temperature=0.0)
    t = dataclasses.replace(t, temperature=np.array([0.0, 1.0, 0.0, 1.0], np.float32))
    out = ids_of(sample(logits, t))
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


# -- penalties, logit_bias, min_tokens ---------------------------------------------------------
def vllm_penalties(logits, prompt_ids, output_ids, presence, frequency, repetition):
    """vLLM v1's apply_penalties for one row (repetition over prompt + output tokens, frequency
    and presence over output tokens only)."""
    logits = logits.astype(np.float64).copy()
    counts = np.bincount(np.asarray(output_ids, np.int64), minlength=V).astype(np.float64)
    seen = counts > 0
    seen[np.asarray(prompt_ids, np.int64)] = True
    logits = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency * counts - presence * (counts > 0)


def make_request(prompt, output, **params):
    sp = SamplingParams(**params)
    sp.update_from_tokenizer({V - 1})             # EOS = last id
    return NewRequestData(list(prompt), list(output), sp, 0)


def penalty_inputs(reqs):
    """Sampling tensors (row i = reqs[i]) and the device penalty state, through the worker's
    input batch as the runner builds them."""
    R = len(reqs)
    batch = InputBatch(R, V)
    for i, req in enumerate(reqs):
        batch.add(str(i), req)
    state = penalties.zeros(R, V)
    for slot, rows in batch.take_penalty_writes():
        state = penalties.write_row(state, np.asarray(slot, np.int32), *rows)
    t = SamplingTensors(**batch.sampling_arrays([batch.slot_of(str(i)) for i in range(R)], R))
    return t, state


@pytest.mark.parametrize("params", [
    dict(presence_penalty=1.2), dict(frequency_penalty=0.7), dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6), dict(presence_penalty=-0.5, frequency_penalty=0.3,
                                       repetition_penalty=1.3)])
def test_penalties_match_vllm_formulas(params):
    rng = np.random.default_rng(6)
    reqs, expected = [], []
    R = 16
    logits = random_logits(R, seed=7, scale=2.0)
    for r in range(R):
        prompt = rng.integers(0, V, rng.integers(1, 6)).tolist()
        output = rng.integers(0, V, rng.integers(0, 10)).tolist()
        reqs.append(make_request(prompt, output, temperature=0.0, logprobs=0, **params))
        expected.append(vllm_penalties(logits[r], prompt, output,
                                       params.get("presence_penalty", 0.0),
                                       params.get("frequency_penalty", 0.0),
                                       params.get("repetition_penalty", 1.0)))
    t, state = penalty_inputs(reqs)
    out = sample(logits, t, state)
    np.testing.assert_array_equal(ids_of(out), np.argmax(np.stack(expected), -1))
    # Logprobs stay those of the raw logits (vLLM's default logprobs mode).
    np.testing.assert_allclose(np.asarray(out.logprob),
                               log_softmax(logits)[np.arange(R), ids_of(out)], atol=1e-5)


def test_penalties_exact_values_through_private_stage():
    logits = random_logits(3, seed=8)
    reqs = [make_request([1, 2, 3], [3, 3, 4], presence_penalty=0.5, frequency_penalty=0.25,
                         repetition_penalty=1.5),
            make_request([5], [], repetition_penalty=2.0),
            make_request([0], [7, 7, 7, 7], frequency_penalty=-1.0)]
    t, state = penalty_inputs(reqs)
    got = np.asarray(penalties.apply_penalties(jnp.asarray(logits), t.slots, t.penalised,
                                               t.min_tokens_active, t.presence, t.frequency,
                                               t.repetition, state))
    exp = [vllm_penalties(logits[0], [1, 2, 3], [3, 3, 4], 0.5, 0.25, 1.5),
           vllm_penalties(logits[1], [5], [], 0.0, 0.0, 2.0),
           vllm_penalties(logits[2], [0], [7, 7, 7, 7], 0.0, -1.0, 1.0)]
    np.testing.assert_allclose(got, np.stack(exp), rtol=1e-5, atol=1e-5)


def test_logit_bias_adds_to_logits_and_can_force_a_token():
    logits = random_logits(2, seed=9)
    weakest = int(np.argmin(logits[0]))
    reqs = [make_request([1], [], temperature=0.0, logit_bias={weakest: 100}),
            make_request([1], [], temperature=0.0, logit_bias={int(np.argmax(logits[1])): -100})]
    t, state = penalty_inputs(reqs)
    ids = ids_of(sample(logits, t, state))
    assert ids[0] == weakest
    assert ids[1] == int(np.argsort(-logits[1])[1])


def test_min_tokens_masks_stop_and_eos_ids_until_reached():
    logits = np.zeros((3, V), np.float32)
    logits[:, 5] = 10.0          # the stop token is by far the most likely
    logits[:, V - 1] = 9.0       # then EOS
    logits[:, 8] = 1.0
    params = dict(temperature=0.0, min_tokens=3, stop_token_ids=[5])
    reqs = [make_request([1], [], **params), make_request([1], [8, 8], **params),
            make_request([1], [8, 8, 8], **params)]            # reached: no mask
    t, state = penalty_inputs(reqs)
    ids = ids_of(sample(logits, t, state))
    assert ids[0] == 8 and ids[1] == 8 and ids[2] == 5
    # ignore_eos: only the explicit stop ids are masked.
    req = make_request([1], [], ignore_eos=True, **params)
    t, state = penalty_inputs([req])
    assert ids_of(sample(logits[:1], t, state))[0] == V - 1


# -- logprobs ----------------------------------------------------------------------------------
def test_logprobs_rank_and_top_k_come_from_raw_logits():
    R, k = 8, 4
    logits = random_logits(R, seed=10)
    t = tensors(R, temperature=0.7, logprobs=True)
    out = sample(logits, t, k=k)
    ref = log_softmax(logits)
    ids = ids_of(out)
    np.testing.assert_allclose(np.asarray(out.logprob), ref[np.arange(R), ids], atol=1e-5)
    ranks = 1 + (ref > ref[np.arange(R), ids][:, None]).sum(-1)
    np.testing.assert_array_equal(np.asarray(out.rank), ranks)
    np.testing.assert_array_equal(np.asarray(out.top_ids), np.argsort(-ref, -1)[:, :k])
    np.testing.assert_allclose(np.asarray(out.top_logprobs), -np.sort(-ref, -1)[:, :k], atol=1e-5)


def test_score_gives_target_logprob_rank_and_top():
    R, k = 5, 3
    logits = random_logits(R, seed=11)
    targets = np.array([0, 3, 7, 1, 2], np.int32)
    chosen, rank, top_ids, top_vals = score(logits, targets, k)
    ref = log_softmax(logits)
    np.testing.assert_allclose(np.asarray(chosen), ref[np.arange(R), targets], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(rank),
                                  1 + (ref > ref[np.arange(R), targets][:, None]).sum(-1))
    np.testing.assert_array_equal(np.asarray(top_ids), np.argsort(-ref, -1)[:, :k])
    assert np.asarray(score(logits, targets, 0)[2]).shape == (R, 0)


def test_rows_without_penalties_ignore_whatever_their_state_row_holds():
    logits = random_logits(2, seed=12)
    strong = [int(np.argmax(logits[0])), int(np.argmax(logits[1]))]
    # Row 0 penalised (its favourite token is biased away); row 1 not, though slot 1's state row
    # holds a stale bias against its favourite token from an earlier occupant.
    t, state = penalty_inputs([make_request([1], [], temperature=0.0,
                                            logit_bias={strong[0]: -100}),
                               make_request([1], [], temperature=0.0,
                                            logit_bias={strong[1]: -100})])
    t = dataclasses.replace(t, penalised=np.array([True, False]))
    ids = ids_of(sample(logits, t, state))
    assert ids[0] != strong[0] and ids[1] == strong[1]


def test_top_logprobs_are_always_k_wide_and_zero_when_no_row_asks():
    logits = random_logits(4, seed=13)
    asked = sample(logits, tensors(4, logprobs=True), k=5)
    not_asked = sample(logits, tensors(4, logprobs=False), k=5)
    assert np.asarray(asked.top_ids).shape == np.asarray(not_asked.top_ids).shape == (4, 5)
    assert not np.asarray(not_asked.top_logprobs).any()
    np.testing.assert_array_equal(ids_of(asked), ids_of(not_asked))


# -- filters without sorting the vocabulary ----------------------------------------------------
NEG = -1e30


def ref_apply_filters(logits, t: SamplingTensors):
    """The sampler's filters before they stopped sorting: min_p, then top_k, then top_p, on the
    sorted vocabulary (the reference the candidate / search form must keep the same set as). One
    change: top_p >= 1 keeps every token. The sorting filters dropped the tail of such a row
    whenever the f32 cumsum of its sorted probabilities reached 1.0 before the end (at 4096
    tokens, ~50 of them), rows without any filter too when another row of the batch had one."""
    probs = jax.nn.softmax(logits, axis=-1)
    max_p = probs.max(-1, keepdims=True)
    logits = jnp.where(probs < t.min_p[:, None] * max_p, NEG, logits)
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]           # descending
    V = logits.shape[-1]
    k = jnp.where(t.top_k > 0, jnp.minimum(t.top_k, V), V)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    logits = jnp.where(logits < kth, NEG, logits)
    sorted_logits = jnp.where(sorted_logits < kth, NEG, sorted_logits)
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep = (mass_before < t.top_p[:, None]) | (t.top_p[:, None] >= 1.0)
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < cutoff, NEG, logits)


def filter_cases(R, V, seed):
    """Logits [R, V] of every kind the filters meet (peaked, flat enough that top_p 0.9 needs
    thousands of tokens, exact ties, grammar-masked -1e30 entries, a single allowed token) and
    per-row top_k / top_p / min_p drawn from the values requests use."""
    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, 6, R)
    logits = rng.normal(0, 3, (R, V)).astype(np.float32)
    flat = kinds == 1
    logits[flat] = rng.normal(0, 0.05, (int(flat.sum()), V))
    ties = kinds == 2
    logits[ties] = np.round(logits[ties])                              # few distinct values
    masked = (kinds == 3) | (kinds == 4)
    logits[masked] = np.where(rng.random((int(masked.sum()), V)) < 0.7, NEG, logits[masked])
    logits[kinds == 4, :] = np.where(np.arange(V) == 7, 1.0, NEG)[None]  # one token allowed
    logits[kinds == 5] = np.round(rng.normal(0, 0.05, (int((kinds == 5).sum()), V)), 1)  # flat ties
    top_k = rng.choice([0, 1, 5, 50, V], R).astype(np.int32)
    top_k[rng.random(R) < 0.1] = 3 * CANDIDATES                       # past the candidates
    top_p = rng.choice([1.0, 0.9, 0.5, 1e-6], R).astype(np.float32)
    min_p = rng.choice([0.0, 0.05, 0.5], R).astype(np.float32)
    t = dataclasses.replace(tensors(R), top_k=top_k, top_p=top_p, min_p=min_p)
    return logits, t


def kept(filtered):
    return np.asarray(filtered) != NEG


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_filters_keep_exactly_the_set_the_sorted_reference_keeps(platform):
    """Candidates (CPU) and the exact search (CPU fallback; every row on GPU) against the sorted
    reference, row by row: the same tokens kept, ties at a cutoff included, values untouched."""
    R, V = 192, 4096
    ref = jax.jit(ref_apply_filters)
    new = jax.jit(partial(_apply_filters, platform=platform))
    for seed in range(3):
        logits, t = filter_cases(R, V, seed)
        want, got = np.asarray(ref(logits, t)), np.asarray(new(logits, t))
        bad = np.flatnonzero((kept(want) != kept(got)).any(-1))
        assert not bad.size, (seed, bad[:5], t.top_k[bad[:5]], t.top_p[bad[:5]], t.min_p[bad[:5]],
                              kept(want)[bad[:5]].sum(-1), kept(got)[bad[:5]].sum(-1))
        np.testing.assert_array_equal(got, want)
        # The flat rows with top_p 0.9 (and no smaller top_k) needed more than the candidates.
        assert (kept(got).sum(-1) > CANDIDATES).any()


def test_filters_leave_rows_without_filters_unchanged():
    logits, t = filter_cases(64, 1024, 7)
    t = dataclasses.replace(t, top_k=np.where(np.arange(64) % 2, t.top_k, 0).astype(np.int32),
                            top_p=np.where(np.arange(64) % 2, t.top_p, 1.0).astype(np.float32),
                            min_p=np.where(np.arange(64) % 2, t.min_p, 0.0).astype(np.float32))
    got = np.asarray(jax.jit(_apply_filters)(logits, t))
    np.testing.assert_array_equal(got[::2], logits[::2])


@pytest.mark.parametrize("vocab,top_k,top_p,min_p", [(32, 5, 0.9, 0.05), (512, 0, 0.95, 0.0),
                                                    (512, 300, 1.0, 0.0)])
def test_sampling_from_the_filters_matches_the_references_renormalized_kept_set(vocab, top_k, top_p, min_p):
    """Chi-square of 20,000 draws against the reference's kept set renormalized: a small vocab
    with all three filters; a flat 512-token row whose top_p 0.95 mass spans past the candidates;
    a top_k past the candidates."""
    R = 20000
    rng = np.random.default_rng(vocab + top_k)
    row = rng.normal(0, 1.0 if vocab == 32 else 0.3, vocab).astype(np.float32)
    logits = np.tile(row, (R, 1))
    t = dataclasses.replace(tensors(R, temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p),
                            seeds=np.arange(R, dtype=np.uint32))
    ids = ids_of(_sample(logits, t, penalties.zeros(1, vocab)))
    ref_row = np.asarray(ref_apply_filters(row[None], dataclasses.replace(
        tensors(1, temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p))))[0]
    keep = ref_row != NEG
    assert CANDIDATES < keep.sum() < vocab or vocab == 32
    expected = np.where(keep, softmax(row.astype(np.float64)), 0)
    expected /= expected.sum()
    counts = np.bincount(ids, minlength=vocab)
    assert not counts[~keep].any()
    e = R * expected[keep]
    chi2 = float(((counts[keep] - e) ** 2 / e).sum())
    df = int(keep.sum()) - 1
    assert chi2 < df + 6 * np.sqrt(2 * df), (chi2, df)


def test_seeded_samples_are_those_of_the_sorted_reference():
    """Same kept set and the same per-row Gumbel noise: every row samples the token the sorting
    sampler sampled, so seeded requests keep their outputs across this change."""
    from jaxserve.sample.sampler import _gumbel
    R, V = 128, 4096
    logits, t = filter_cases(R, V, 11)
    t = dataclasses.replace(t, temperature=np.full(R, 0.8, np.float32),
                            seeds=np.random.default_rng(1).integers(0, 2**32, R, dtype=np.uint32),
                            positions=np.arange(R, dtype=np.int32))
    scaled = logits / np.float32(0.8)
    noise = jax.vmap(_gumbel, in_axes=(0, 0, None))(t.seeds, t.positions, V)
    want = np.asarray(argmax_last(ref_apply_filters(scaled, t) + noise))
    np.testing.assert_array_equal(ids_of(_sample(logits, t, penalties.zeros(1, V))), want)


def test_h100_step_sampler_has_no_host_sync_points():
    """The sampler compiled for an H100 (from this host, jaxserve.aot) holds no conditional and
    no while without a trip count: XLA:GPU runs those by copying a predicate to the host."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxserve.aot.hlo_analysis import host_sync_points
    from jaxserve.aot.targets import get_target
    try:
        target = get_target("h100")
    except ValueError as e:
        pytest.skip(f"needs jax 0.11.2 with the CUDA plugin wheels for a compile-only H100: {e}")
    mesh = Mesh(np.array(target.devices), ("tp",))
    rep = NamedSharding(mesh, P())
    R, V = 256, 128256
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)   # noqa: E731
    t = tensors(R)
    t = jax.tree.map(lambda a: spec(a.shape, a.dtype), t)
    state = jax.tree.map(lambda a: spec((R, V), a.dtype), penalties.zeros(1, 1))
    args = (spec((R, V), jnp.float32), t, state, spec((R, -(-V // 32)), jnp.int32))
    with target.context(mesh):
        text = jax.jit(lambda x, t, s, b: _sample(x, t, s, k=20, bitmask=b)).lower(*args).compile(
            {"xla_gpu_enable_cub_radix_sort": False}).as_text()
    assert not host_sync_points(text)
    assert " sort(" not in text             # neither the filters nor top logprobs sort the vocabulary

