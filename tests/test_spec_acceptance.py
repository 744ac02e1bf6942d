"""Speculative decoding's acceptance model (sim/spec_acceptance.py): the drawn tokens per verify
step against the closed form, per-position rates, determinism and bad input."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvsched.errors import KvschedError
from kvsched.sim.spec_acceptance import Acceptance, geometric_tokens, parse_acceptance


@pytest.mark.parametrize("alpha", [0.6, 0.8])
@pytest.mark.parametrize("k", [2, 4])
def test_the_mean_tokens_per_step_matches_the_closed_form(alpha, k):
    """Issue "Speculative decoding", Done when: within 1% of (1 - alpha^(k+1)) / (1 - alpha) over
    100,000 steps (the standard error is about 0.3% of the mean here)."""
    acc = parse_acceptance(str(alpha), k)
    closed = geometric_tokens(alpha, k)
    assert acc.expected_tokens() == pytest.approx(closed, rel=1e-12)
    drawn = acc.draw(np.random.default_rng(7), 100_000)
    assert drawn.min() >= 1 and drawn.max() <= k + 1
    assert drawn.mean() == pytest.approx(closed, rel=0.01)


def test_per_position_rates():
    """a = (0.9, 0.5, 0): E = 1 + 0.9 + 0.45 + 0 = 2.35; a third token is never accepted."""
    acc = parse_acceptance("0.9, 0.5, 0", 3)
    assert acc.rates == (0.9, 0.5, 0.0) and acc.expected_tokens() == pytest.approx(2.35)
    drawn = acc.draw(np.random.default_rng(1), 200_000)
    assert drawn.max() == 3
    assert np.bincount(drawn, minlength=5)[1:4] / len(drawn) == pytest.approx([0.1, 0.45, 0.45], abs=0.005)


def test_the_edges_of_alpha():
    assert (parse_acceptance("1", 3).draw(np.random.default_rng(0), 10) == 4).all()
    assert (parse_acceptance("0", 3).draw(np.random.default_rng(0), 10) == 1).all()
    assert geometric_tokens(1.0, 3) == 4.0 and geometric_tokens(0.0, 3) == 1.0


def test_draws_are_deterministic_for_a_seed():
    acc = parse_acceptance("0.7", 4)
    a, b = acc.draw(np.random.default_rng(3), 1000), acc.draw(np.random.default_rng(3), 1000)
    assert a.tobytes() == b.tobytes()


@settings(max_examples=50, deadline=None)
@given(rates=st.lists(st.floats(0, 1), min_size=1, max_size=8))
def test_the_expected_tokens_lie_between_1_and_k_plus_1(rates):
    acc = Acceptance(tuple(rates))
    assert 1.0 <= acc.expected_tokens() <= len(rates) + 1 + 1e-9


@pytest.mark.parametrize("text, k, msg", [
    ("1.2", 3, r"each rate must be in \[0, 1\]"),
    ("-0.1", 3, r"each rate must be in \[0, 1\]"),
    ("nan", 3, r"each rate must be in \[0, 1\]"),
    ("x", 3, "is not a number"),
    ("0.5,0.5", 3, "give one rate or one per speculative token"),
    ("", 3, "must be ALPHA"),
    ("0.5", 0, "k must be a whole number"),
    ("0.5", True, "k must be a whole number"),
])
def test_bad_acceptance_is_a_one_line_error(text, k, msg):
    with pytest.raises(KvschedError, match=msg):
        parse_acceptance(text, k)
