"""The oracle reflection source of Stage 1 (``ExplorerConfig.reflection_source = "oracle"``), an
ablation.

Instead of asking the policy, the explorer asks the environment's oracle (``leafe.envs.registry.
reflection_oracle``: Sokoban's solver, HumanEval's visible-test feedback) for tau and e on the
branch's path, and logs them as a ``Reflection`` with ``source = "oracle"``, ``raw_text`` = e and no
token ids, so reports can tell the ablation apart. The rest of the tree (rollback to tau, a branch
with e in context, counterfactual samples without e) is unchanged. An oracle that finds no mistake
returns an empty e (flag ``no_mistake``): no branch is opened, exactly as for a model reflection
without an experience.
"""

from __future__ import annotations

from leafe.actors.parsing import ParsedReflection
from leafe.envs.base import OracleReflection

__all__ = ["oracle_parsed"]


def oracle_parsed(
    verdict: OracleReflection, at_t: int, max_experience_chars: int
) -> ParsedReflection:
    """The oracle's verdict in the explorer's terms (tau clamped to ``0..at_t-1``, e cut to
    length)."""
    flags: list[str] = []
    tau = verdict.tau
    if not 0 <= tau < at_t:
        flags.append("tau_clamped")
        tau = min(max(tau, 0), at_t - 1)
    experience = " ".join(verdict.experience.split())
    if not experience:
        flags.append("no_mistake")
    elif len(experience) > max_experience_chars:
        flags.append("experience_truncated")
        experience = experience[: max_experience_chars - 3].rstrip() + "..."
    return ParsedReflection(tau=tau, experience=experience, parse_ok=True, flags=flags)
