"""Speculative decoding's host side: `speculative_config` validation, the n-gram and suffix
proposers, the per-request adaptive opt-out and the draft budget weighed against measured step
times (`Proposer.fit`). No model runs here; the engine-level tests are in test_spec_decode.py."""

from __future__ import annotations

import pytest

from jaxserve.config import EngineArgs, SpeculativeConfig
from jaxserve.spec_decode import SuffixProposer, propose_ngram


@pytest.mark.parametrize("bad,field", [
    ({"method": "eagle"}, "method"),
    ({"num_speculative_tokens": 3}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "suffix", "bogus": 1}, "bogus"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "model"),
])
def test_bad_speculative_config_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(speculative_config=bad)


def test_speculative_config_sets_the_scheduler_budget():
    args = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_max": 5})
    assert args.spec_config() == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=5)
    assert args.scheduler_config(256).num_speculative_tokens == 3
    assert EngineArgs().scheduler_config(256).num_speculative_tokens == 0


# -- proposers ------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_recent_match():
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3, 4]
    # suffix [2, 3, 4] last occurred at 6..8, followed by 6, 7
    assert propose_ngram(tokens, 2, 1, 3) == [6, 7]
    assert propose_ngram(tokens, 5, 1, 3) == [6, 7, 2, 3, 4]
    assert propose_ngram([1, 2, 3], 3, 1, 3) == []                 # nothing repeats
    assert propose_ngram([5, 1, 5], 2, 2, 3) == []                 # only a 1-gram matches
    assert propose_ngram([5, 1, 5], 2, 1, 3) == [1, 5]


def test_suffix_proposer_follows_the_most_frequent_continuation():
    p = SuffixProposer(k=3, max_depth=4)
    # after "1 2" came 3 twice and 8 once; after "2 3" came 4 twice
    tokens = [1, 2, 3, 4, 0, 1, 2, 8, 0, 1, 2, 3, 4, 0, 9, 1, 2]
    assert p.propose("a", tokens) == [3, 4, 0]
    # incremental: the trie keeps its counts; the longest match wins ("4 0 1 2" was followed by 8)
    assert p.propose("a", tokens + [3, 4, 0, 1, 2]) == [8, 0, 1]
    assert p.propose("b", [5, 6, 7]) == []
    p.finish("a")
    assert "a" not in p.tries


def test_suffix_proposer_learns_from_earlier_outputs():
    p = SuffixProposer(k=4, max_depth=8, max_cached_requests=2)
    p.propose("a", [1, 2, 3])
    p.finish("a", [10, 11, 12, 13, 14])
    assert p.propose("b", [7, 10, 11]) == [12, 13, 14]


# -- verification ---------------------------------------------------------------------------


def test_proposer_pauses_a_request_whose_drafts_keep_failing():
    from jaxserve.spec_decode import Proposer
    p = Proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    assert p.propose("a", tokens) == [3, 1]      # a new request starts with short drafts
    calls_with_drafts = 0
    junk = 100
    for _ in range(40):                 # every draft is rejected: the target says something new
        tokens = tokens + [junk]
        junk += 1
        tokens_for_ngram = tokens + [1, 2]
        tokens = tokens_for_ngram
        calls_with_drafts += bool(p.propose("a", tokens))
    assert calls_with_drafts <= 10      # pauses of 4, 8, 16, ... calls between retries
    # a copying request keeps full-length drafts
    q = Proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    seq = [5, 6, 7, 8, 9] * 12
    n, lengths = 12, []
    while n < 50:
        drafts = q.propose("b", seq[:n])
        assert drafts == seq[n:n + len(drafts)]
        lengths.append(len(drafts))
        n += len(drafts) + 1            # all accepted, plus the bonus token
    assert lengths[0] == 2 and set(lengths[1:]) == {4}    # cautious, earns full drafts


def test_a_request_verifying_one_draft_a_step_earns_longer_drafts():
    """At batch 1 the free room is one draft: a request whose single drafts are always accepted
    must show a per-draft rate near 1 (not "1 accepted per verification"), so `fit` lets its
    drafts grow into the next bucket when the measured step time pays for it."""
    from jaxserve.spec_decode import Proposer
    p = Proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    seq = [5, 6, 7, 8, 9] * 20
    n = 12
    cost = {2: 1.0, 4: 1.7, 8: 3.1}                       # an AVX2 CPU's steps (RESULTS.md)
    kept = []
    for _ in range(8):
        drafts = p.fit({"r": p.propose("r", seq[:n])}, free=1,
                       cost=lambda extra: cost[2 if extra <= 1 else 4 if extra <= 3 else 8])["r"]
        kept.append(len(drafts))
        n += len(drafts) + 1                              # all accepted
    assert kept[0] == 1 and kept[-1] >= 3 and p.rate("r") > 0.9


def test_fit_gives_free_room_to_the_likeliest_and_growth_only_when_measured_cost_pays():
    from jaxserve.spec_decode import Proposer
    p = Proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    p.propose("good", [1, 2, 1, 2])
    p.propose("poor", [3, 4, 3, 4])
    p._tracks["good"].accepted = p._tracks["good"].judged = 4.0     # rate 1
    p._tracks["poor"].accepted, p._tracks["poor"].judged = 1.0, 3.0
    props = {"good": [1, 2, 1, 2], "poor": [3, 4, 3, 4]}
    # no step times measured: only the free room, to the likeliest drafts
    assert p.fit(props, free=2) == {"good": [1, 2], "poor": []}
    assert p.fit(props, free=7) == {"good": [1, 2, 1, 2], "poor": [3, 4, 3]}
    # a step of 16 tokens (free room 0); a larger bucket costs twice as much
    twice = lambda n: 1.0 if n == 0 else 2.0          # noqa: E731
    assert p.fit(props, free=0, cost=twice, tokens=16) == {"good": [], "poor": []}
    # the next bucket at 1.1x the time: 16 + 4 expected tokens pay, and once there the poor
    # request's drafts ride along (worth a little, no further cost)
    cheap = lambda n: 1.0 if n == 0 else 1.1          # noqa: E731
    assert p.fit(props, free=0, cost=cheap, tokens=16) == props
    # ... but not into a third bucket at twice the time
    steps = lambda n: 1.0 if n == 0 else 1.1 if n <= 4 else 2.0      # noqa: E731
    assert p.fit(props, free=0, cost=steps, tokens=16) == {"good": [1, 2, 1, 2], "poor": []}
    # at batch 1 growth is cheap: a lone good copier keeps its drafts
    assert p.fit({"good": [1, 2, 1, 2]}, free=0, cost=cheap, tokens=1) == {"good": [1, 2, 1, 2]}
    # unknown cost beyond the free room: nothing beyond it
    assert p.fit(props, free=1, cost=lambda n: None if n > 1 else 1.0, tokens=16) == \
        {"good": [1], "poor": []}
