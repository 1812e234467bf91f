"""Prompt-logprob steps compute logits only for the tokens that want them (`score_rows`), with the
same results as scoring every token's logits."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.sample.sampler import score, score_rows


@pytest.mark.parametrize("T, scored, chunk", [(16, [3, 4, 5], 64), (200, list(range(20, 151)), 64),
                                              (32, [], 8), (24, list(range(24)), 16)])
def test_scored_rows_equal_scoring_every_token(T, scored, chunk):
    rng = np.random.default_rng(T)
    E, V, k = 32, 97, 3
    hidden = jnp.asarray(rng.standard_normal((T, E)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((E, V)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, T), jnp.int32)
    rows = np.full(T, T, np.int32)
    rows[:len(scored)] = scored
    calls = []

    def logits_fn(h):
        calls.append(h.shape[0])
        return jnp.einsum("re,ev->rv", h, head, precision="highest")

    got = jax.jit(lambda h, r, t: score_rows(logits_fn, h, r, t, k, chunk=chunk))(hidden, jnp.asarray(rows),
                                                                                   targets)
    want = score(jnp.einsum("re,ev->rv", hidden, head, precision="highest"), targets, k)
    assert max(calls) <= min(chunk, T)          # never the [T, V] logits at once
    mask = np.zeros(T, bool)
    mask[scored] = True
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        np.testing.assert_allclose(g[mask], w[mask], rtol=1e-5, atol=1e-5)
        assert not g[~mask].any()               # unscored tokens stay zero


def test_scoring_in_its_loop_keeps_xla_cpu_top_k_kernel():
    """Inside `score_rows`' loop XLA moved top-k's slices out of the body and sorted every
    [rows, V] row there (a 20-token scoring request: 265 ms where its logits take 9); the
    barrier (`_kept_top_k`) keeps the top-k kernel: no sort over the vocabulary is left."""
    import re
    T, E, V, k = 32, 16, 4096, 20
    head = jnp.ones((E, V), jnp.float32)
    fn = jax.jit(lambda h, r, t: score_rows(lambda x: x @ head, h, r, t, k))
    text = fn.lower(jnp.ones((T, E)), jnp.arange(T, dtype=jnp.int32), jnp.zeros(T, jnp.int32)).compile().as_text()
    assert not re.findall(rf"= \(f32\[\d+,{V}\][^)]*\) sort\(", text)
    got = fn(jnp.ones((T, E)), jnp.arange(T, dtype=jnp.int32), jnp.zeros(T, jnp.int32))
    assert got[2].shape == (T, k) and got[3].shape == (T, k)


def test_score_rows_gpu_form_runs_a_static_loop_and_scores_the_same(monkeypatch):
    """On a GPU `score_rows` loops over every chunk of the bucket (a trip count known at compile
    time, no host sync); the scores are those of the CPU's loop over the scored rows only."""
    from jaxserve.sample import sampler as sm
    rng = np.random.default_rng(0)
    T, E, V = 50, 8, 30
    hidden = jnp.asarray(rng.standard_normal((T, E)), jnp.float32)
    W = jnp.asarray(rng.standard_normal((E, V)), jnp.float32)
    scored = np.array([3, 7, 20, 21, 40], np.int32)
    rows = jnp.asarray(np.concatenate([scored, np.full(T - len(scored), T, np.int32)]))
    targets = jnp.asarray(rng.integers(0, V, T), jnp.int32)
    cpu = sm.score_rows(lambda h: h @ W, hidden, rows, targets, 2, chunk=16)
    monkeypatch.setattr(sm, "target_platform", lambda: "gpu")
    gpu = jax.jit(lambda h, r, t: sm.score_rows(lambda x: x @ W, h, r, t, 2, chunk=16))(hidden, rows, targets)
    for a, b in zip(cpu, gpu):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert np.asarray(gpu[0])[scored].any() and not np.asarray(gpu[0])[np.setdiff1d(np.arange(T), scored)].any()
