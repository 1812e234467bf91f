"""The engine's reference attention (`jaxserve.attention.reference`) against the dense oracle of
test_paged_attention_kernel.py: the CPU form's row groups, row batches and KV chunks, and the GPU
form (`static=True`: one row group, the KV loop over the block tables' whole width, masked), with
sinks and latent pages; and that the GPU form traces no data-dependent loop."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from test_paged_attention_kernel import CASES, TOL, Case, make_batch, max_err

from jaxserve.pallas.paged_attention import ref_ragged_paged_attention


@pytest.mark.parametrize("name", list(CASES))
def test_engine_reference_path_matches_oracle(name):
    """The engine's CPU attention (jaxserve.attention, chunked online softmax, per-token or
    16-token rows) against the dense oracle on every kernel case."""
    from jaxserve.attention import ragged_paged_attention_ref
    case = CASES[name]
    q, k, v, meta, ks, vs = make_batch(case)
    args = dict(sm_scale=1.0 / np.sqrt(case.D), sliding_window=case.window,
                soft_cap=case.soft_cap, k_scale=ks, v_scale=vs)
    got = ragged_paged_attention_ref(q, k, v, meta, **args)
    want = ref_ragged_paged_attention(q, k, v, meta, **args)
    assert max_err(got, want) <= TOL[case.dtype]


# Small tuning constants so tiny shapes run several row batches, tiles and KV chunks per row.
SMALL_ROWS = dict(_SHORT=4, _TOKEN_ROWS=3, _TILE=8, _TILE_ROWS=2, _KV_CHUNK=16)
MANY_ROWS = {
    "decodes_over_batches": Case(q_lens=(1,) * 7 + (2, 3), ctx=(5, 90, 16, 60, 0, 33, 120, 7, 40),
                                 T=16, S=12, N=96),
    "tiles_over_batches": Case(q_lens=(4, 19, 1, 9, 30), ctx=(40, 0, 77, 13, 50), T=64, S=8,
                               N=96, M=12),
    "mixed_window_cap_int8": Case(q_lens=(1, 12, 1, 3, 17), ctx=(100, 20, 3, 60, 0), T=40, S=6,
                                  N=96, window=21, soft_cap=3.0, kv="int8"),
}


@pytest.mark.parametrize("name", list(MANY_ROWS))
def test_engine_reference_path_row_batches(name, monkeypatch):
    """The reference path's two row groups (single tokens sorted by context, tiles of a chunk),
    each looped over in batches of rows and chunks of KV, against the dense oracle."""
    from jaxserve.attention import reference as attention
    for key, value in SMALL_ROWS.items():
        monkeypatch.setattr(attention, key, value)
    case = MANY_ROWS[name]
    q, k, v, meta, ks, vs = make_batch(case)
    args = dict(sm_scale=1.0 / np.sqrt(case.D), sliding_window=case.window,
                soft_cap=case.soft_cap, k_scale=ks, v_scale=vs)
    got = attention.ragged_paged_attention_ref(q, k, v, meta, **args)
    want = ref_ragged_paged_attention(q, k, v, meta, **args)
    assert max_err(got, want) <= TOL[case.dtype]
    assert not np.asarray(got[int(meta.cu_q_lens[-1]):]).any()   # padding tokens stay zero


@pytest.mark.parametrize("gather_bytes", [1, 1 << 30])
@pytest.mark.parametrize("name", list(CASES) + list(MANY_ROWS))
def test_engine_reference_path_static_form_matches_oracle(name, gather_bytes, monkeypatch):
    """The reference path's GPU form (`static=True`: one group of rows, the KV loop over the block
    tables' whole width, masked) against the dense oracle: with the smallest KV chunk (one block,
    many loop steps) and the largest."""
    from jaxserve.attention import reference as attention
    monkeypatch.setattr(attention, "_STATIC_GATHER_BYTES", gather_bytes)
    case = CASES.get(name) or MANY_ROWS[name]
    q, k, v, meta, ks, vs = make_batch(case)
    args = dict(sm_scale=1.0 / np.sqrt(case.D), sliding_window=case.window,
                soft_cap=case.soft_cap, k_scale=ks, v_scale=vs)
    got = attention.ragged_paged_attention_ref(q, k, v, meta, **args, static=True)
    want = ref_ragged_paged_attention(q, k, v, meta, **args)
    assert max_err(got, want) <= TOL[case.dtype]
    assert not np.asarray(got[int(meta.cu_q_lens[-1]):]).any()   # padding tokens stay zero


def test_engine_reference_path_static_form_has_no_data_dependent_loop():
    """On a GPU target the reference path is traced without `while` loops of data-dependent trip
    count or `cond`s (XLA:GPU syncs with the host for each); the CPU form keeps its dynamic loops."""
    from jaxserve.attention import ragged_paged_attention_ref
    case = MANY_ROWS["mixed_window_cap_int8"]
    q, k, v, meta, ks, vs = make_batch(case)
    args = dict(sm_scale=0.125, sliding_window=case.window, soft_cap=case.soft_cap, k_scale=ks, v_scale=vs)

    def jaxpr(static):
        return str(jax.make_jaxpr(lambda q, k, v, meta: ragged_paged_attention_ref(
            q, k, v, meta, **args, static=static))(q, k, v, meta))
    assert " while[" in jaxpr(False)
    static = jaxpr(True)
    assert " while[" not in static and " cond[" not in static and " scan[" in static


def test_engine_reference_path_static_form_on_latent_pages_equals_the_loops():
    """A latent cache (no value pages: the key pages are the values, DeepSeek's MLA): the GPU
    form equals the CPU form's dynamic loops."""
    from jaxserve.attention import ragged_paged_attention_ref
    case = MANY_ROWS["tiles_over_batches"]
    q, k, _, meta, _, _ = make_batch(case)
    got, want = (ragged_paged_attention_ref(q, k, None, meta, sm_scale=0.125, static=s) for s in (True, False))
    assert max_err(got, want) <= 1e-5
