"""Pass@k: the unbiased estimator of Chen et al. (2021) over n samples per task, c of them correct,
and the interval of a paired difference between two evaluations of the same tasks.

pass@k = 1 - C(n-c, k) / C(n, k), averaged over tasks. Computed as a product so large n stays exact
enough in floating point. Used by ``leafe eval``, ``leafe run``'s report and
``experiments/paper_table.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import msgspec
import numpy as np

__all__ = ["PassKDiff", "paired_difference", "pass_at_k", "pass_at_k_table"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is
    correct."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n} c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k} n={n}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def pass_at_k_table(results: Mapping[str, Sequence[bool]], ks: Iterable[int]) -> dict[int, float]:
    """Mean pass@k over tasks; ``results`` maps task id -> per-sample success. k larger than a
    task's n is skipped for the whole table (never extrapolated)."""
    ks = sorted(set(ks))
    if not results:
        raise ValueError("no task results to score")
    n_min = min(len(v) for v in results.values())
    table: dict[int, float] = {}
    for k in ks:
        if k > n_min:
            continue
        table[k] = sum(pass_at_k(len(v), sum(map(bool, v)), k) for v in results.values()) / len(
            results
        )
    return table


class PassKDiff(msgspec.Struct, frozen=True, kw_only=True):
    """Pass@k(a) - Pass@k(b) on the same tasks, with a 95% bootstrap interval (fractions, not
    points)."""

    k: int
    """The k compared."""
    diff: float
    """Point estimate of the difference."""
    lo: float
    """2.5th percentile of the bootstrap differences."""
    hi: float
    """97.5th percentile."""
    tasks: int
    """Tasks both evaluations share."""

    @property
    def within_noise(self) -> bool:
        """The interval contains 0: the data cannot tell the two apart."""
        return self.lo <= 0.0 <= self.hi


def paired_difference(
    a: Mapping[str, Sequence[bool]],
    b: Mapping[str, Sequence[bool]],
    k: int,
    *,
    draws: int = 4000,
    seed: int = 0,
) -> PassKDiff:
    """Pass@k(a) - Pass@k(b) over the tasks both evaluated, with a 95% two-level bootstrap interval:
    resample the tasks, then each evaluation's samples within a task (so a task solved once in n
    counts as shaky as it is). Deterministic for a given ``seed``."""
    tasks = sorted(set(a) & set(b))
    if not tasks:
        raise ValueError("the two evaluations share no task")
    sa = [np.asarray(a[t], dtype=bool) for t in tasks]
    sb = [np.asarray(b[t], dtype=bool) for t in tasks]
    if k > min(len(x) for x in [*sa, *sb]):
        raise ValueError(f"k = {k} exceeds the samples per task of one evaluation")
    rng = np.random.default_rng(seed)

    def score(xs: list[np.ndarray], idx: Sequence[int] | np.ndarray) -> float:
        return float(np.mean([pass_at_k(len(xs[i]), int(xs[i].sum()), k) for i in idx]))

    point = score(sa, range(len(tasks))) - score(sb, range(len(tasks)))
    diffs = []
    for _ in range(draws):
        idx = rng.integers(0, len(tasks), len(tasks))
        ra = [x[rng.integers(0, len(x), len(x))] for x in sa]
        rb = [x[rng.integers(0, len(x), len(x))] for x in sb]
        diffs.append(score(ra, idx) - score(rb, idx))
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    return PassKDiff(k=k, diff=point, lo=float(lo), hi=float(hi), tasks=len(tasks))
