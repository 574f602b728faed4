"""The unbiased Pass@k estimator (``actors/passk.py``) against brute-force enumeration, and its
edges."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leafe.actors.passk import pass_at_k, pass_at_k_table


def _brute_force(outcomes: list[bool], k: int) -> Fraction:
    """Fraction of the k-subsets of the n samples that contain at least one success (exact)."""
    subsets = list(itertools.combinations(range(len(outcomes)), k))
    hits = sum(any(outcomes[i] for i in subset) for subset in subsets)
    return Fraction(hits, len(subsets))


@st.composite
def _samples_and_k(draw: st.DrawFn) -> tuple[list[bool], int]:
    outcomes = draw(st.lists(st.booleans(), min_size=1, max_size=10))
    return outcomes, draw(st.integers(1, len(outcomes)))


@settings(max_examples=50, deadline=None)
@given(_samples_and_k())
def test_estimator_equals_enumeration_over_all_k_subsets(case: tuple[list[bool], int]) -> None:
    """For n <= 10, pass_at_k(n, c, k) is the share of k-subsets holding a success (the definition
    the estimator is unbiased for), whatever the order of the outcomes."""
    outcomes, k = case
    exact = _brute_force(outcomes, k)
    assert pass_at_k(len(outcomes), sum(outcomes), k) == pytest.approx(float(exact), abs=1e-12)


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 200).flatmap(
        lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))
    )
)
def test_estimator_equals_the_binomial_formula_and_is_monotone(case: tuple[int, int, int]) -> None:
    """1 - C(n-c, k)/C(n, k) exactly (big integers) for n up to 200; non-decreasing in k and in
    c."""
    n, c, k = case
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    value = pass_at_k(n, c, k)
    assert value == pytest.approx(float(exact), abs=1e-9) and 0.0 <= value <= 1.0
    if k < n:
        assert pass_at_k(n, c, k + 1) >= value - 1e-12
    if c < n:
        assert pass_at_k(n, c + 1, k) >= value - 1e-12


def test_edge_cases() -> None:
    """c = 0 gives 0, c = n gives 1, k = 1 is c/n, k = n is 1 iff any success, n - c < k forces
    1."""
    assert pass_at_k(16, 0, 1) == 0.0 and pass_at_k(16, 0, 16) == 0.0
    assert pass_at_k(16, 16, 1) == 1.0
    assert pass_at_k(16, 5, 1) == pytest.approx(5 / 16)
    assert pass_at_k(16, 1, 16) == 1.0
    assert pass_at_k(10, 8, 3) == 1.0  # only 2 failures: any 3 samples include a success
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0
    assert 0.0 < pass_at_k(1000, 1, 1) < pass_at_k(1000, 1, 500) < 1.0


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_impossible_arguments_are_rejected_with_values(n: int, c: int, k: int) -> None:
    """c outside [0, n] or k outside [1, n] raise ValueError naming n, c and k."""
    with pytest.raises(ValueError, match=f"n={n}"):
        pass_at_k(n, c, k)


def test_table_averages_tasks_and_skips_k_above_the_smallest_n() -> None:
    """The table is the mean over tasks per k; k beyond the smallest task's n is left out; no tasks
    is an error."""
    table = pass_at_k_table(
        {"a": [True, False, False, False], "b": [False] * 4, "c": [True] * 3}, [4, 1, 2]
    )
    assert list(table) == [1, 2]
    assert table[1] == pytest.approx((0.25 + 0 + 1) / 3)
    assert table[2] == pytest.approx((0.5 + 0 + 1) / 3)
    with pytest.raises(ValueError, match="no task results"):
        pass_at_k_table({}, [1])


def test_paired_difference_separates_a_real_gap_from_noise() -> None:
    """Same results: difference 0, inside its interval ("within noise"). A gap on every task: the
    whole interval lies above 0. Deterministic for a seed; a k above n is refused."""
    from leafe.actors.passk import paired_difference

    weak = {f"t{i}": [False] * 7 + [True] for i in range(24)}
    strong = {f"t{i}": [True] * 6 + [False] * 2 for i in range(24)}
    same = paired_difference(weak, weak, 1, draws=500)
    assert same.diff == 0.0 and same.within_noise
    gap = paired_difference(strong, weak, 1, draws=500)
    assert gap.diff == pytest.approx(0.75 - 0.125) and gap.lo > 0 and not gap.within_noise
    assert gap == paired_difference(strong, weak, 1, draws=500)
    with pytest.raises(ValueError, match="k = 9"):
        paired_difference(strong, weak, 9)
