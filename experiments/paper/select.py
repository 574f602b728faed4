"""The choices of the paper table, made on validation results only (never on test).

- :func:`choose_sft`: room variant, demonstration count and epochs of Base + SFT. A candidate
  qualifies when its unparseable answers stay under ``max_parse_failure`` and its validation Pass@1
  lies in ``pass1_range`` (format fixed, room to improve); the qualifying one closest to
  ``pass1_target`` wins, ties go to the cheaper one (fewer demonstrations, then fewer epochs). When
  none qualifies the rule is reported as not met and the candidate with the fewest parse failures
  among those closest to the range is taken, so later phases can still run.
- :func:`choose_best`: GRPO's learning rate (round 1) and its round: highest validation Pass@1, ties
  to the earlier candidate; the GRPO row is never round 0 (it must have trained), and whether the
  best round beats the start (Base + SFT on the same slice and seeds) is recorded.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

__all__ = ["Candidate", "Choice", "choose_best", "choose_sft"]


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """One validation result of a candidate."""

    name: str
    """The validation phase."""
    pass1: float
    """Validation Pass@1 (fraction)."""
    parse_failure: float
    """Completions with no valid action / all (fraction)."""
    passk_max: float = 0.0
    """Validation Pass@k at the largest k evaluated (fraction)."""
    variant: str = ""
    """Room variant (SFT candidates)."""
    demos: int = 0
    """Demonstrations (SFT candidates)."""
    epochs: int = 0
    """Epochs (SFT candidates)."""
    lr: float = 0.0
    """Learning rate (GRPO candidates)."""
    round: int = 0
    """GRPO round (0 = the start)."""


class Choice(msgspec.Struct, frozen=True, kw_only=True):
    """The winner and why."""

    chosen: Candidate
    """The candidate taken."""
    rule_met: bool
    """Whether the chosen candidate meets the rule (SFT: format and range; GRPO: beats the
    start)."""
    why: str
    """One sentence for the report."""


def _distance(x: float, lo: float, hi: float) -> float:
    return max(lo - x, 0.0, x - hi)


def choose_sft(
    candidates: Sequence[Candidate],
    *,
    max_parse_failure: float,
    pass1_range: Sequence[float],
    pass1_target: float,
    max_passk: float = 1.0,
) -> Choice:
    """The Base + SFT candidate (see the module docstring); with ``max_passk`` < 1 a candidate must
    also leave room at large k (validation Pass@k at the largest k at most that)."""
    if not candidates:
        raise ValueError("no SFT candidate has a validation result")
    lo, hi = pass1_range
    ok = [
        c
        for c in candidates
        if c.parse_failure < max_parse_failure and lo <= c.pass1 <= hi and c.passk_max <= max_passk
    ]
    cap = f" and Pass@k at the largest k <= {100 * max_passk:.0f}%" if max_passk < 1 else ""
    if ok:
        best = min(ok, key=lambda c: (abs(c.pass1 - pass1_target), c.demos, c.epochs))
        why = (
            f"{len(ok)} of {len(candidates)} candidates have < {100 * max_parse_failure:.0f}% "
            "unparseable "
            f"answers and Pass@1 in [{100 * lo:.0f}, {100 * hi:.0f}]%{cap}; {best.name} is closest "
            "to "
            f"{100 * pass1_target:.0f}%"
        )
        return Choice(chosen=best, rule_met=True, why=why)
    best = min(
        candidates,
        key=lambda c: (round(_distance(c.pass1, lo, hi), 6), c.parse_failure, c.demos, c.epochs),
    )
    why = (
        f"no candidate has < {100 * max_parse_failure:.0f}% unparseable answers and Pass@1 in "
        f"[{100 * lo:.0f}, {100 * hi:.0f}]%{cap}: RULE NOT MET; took {best.name} (Pass@1 closest "
        "to the range, "
        "then fewest parse failures)"
    )
    return Choice(chosen=best, rule_met=False, why=why)


def choose_best(candidates: Sequence[Candidate], *, start: Candidate | None = None) -> Choice:
    """The candidate with the highest validation Pass@1 (ties: the earlier one); ``rule_met`` says
    whether it beats ``start`` (when given) by more than nothing."""
    if not candidates:
        raise ValueError("no candidate has a validation result")
    best = max(enumerate(candidates), key=lambda ic: (ic[1].pass1, -ic[0]))[1]
    if start is None:
        return Choice(
            chosen=best, rule_met=True, why=f"{best.name} has the highest validation Pass@1"
        )
    beats = best.pass1 > start.pass1
    verb = "beats" if beats else "does NOT beat"
    why = (
        f"{best.name} has the highest validation Pass@1 ({100 * best.pass1:.1f}%) and {verb} the "
        "start "
        f"({start.name}: {100 * start.pass1:.1f}%)"
    )
    return Choice(chosen=best, rule_met=beats, why=why)
