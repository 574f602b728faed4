"""Pass@k: the unbiased estimator of Chen et al. (2021) over n samples per task, c of them correct.

pass@k = 1 - C(n-c, k) / C(n, k), averaged over tasks. Computed as a product so large n stays exact
enough in floating point. Used by ``leafe eval``, ``leafe run``'s report and ``bench/paper_table.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

__all__ = ["pass_at_k", "pass_at_k_table"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
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
    """Mean pass@k over tasks; ``results`` maps task id -> per-sample success. k larger than a task's n
    is skipped for the whole table (never extrapolated)."""
    ks = sorted(set(ks))
    if not results:
        raise ValueError("no task results to score")
    n_min = min(len(v) for v in results.values())
    table: dict[int, float] = {}
    for k in ks:
        if k > n_min:
            continue
        table[k] = sum(pass_at_k(len(v), sum(map(bool, v)), k) for v in results.values()) / len(results)
    return table
