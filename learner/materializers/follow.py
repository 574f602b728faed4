"""Experience-following samples: the history at tau *with* the oracle's e -> the move e names.

SmolLM2-135M takes an experience in its context as a nudge, not an instruction
(``docs/experiments.md``): with the oracle's "... move X instead" in the prompt it picks X barely
more often than without. LEAFE's Stage 1 only yields corrections when the policy acts on e, so the
shared warm start teaches it to: one ``sft`` sample per oracle verdict that names an action
(``Reflection.oracle_action``), on train-split ``explore`` episodes:

- prompt: the action prompt a branch opened from that verdict gets at its first step: the episode's
  instructions and task, the reflected branch's first ``tau`` steps and o_tau, with the verdict's e
  in context (``render_messages``, the episode's ``history_window`` and response prefix, tokenized
  by the same chat tokenizer). Where an oracle reflection did open that branch, the branch's first
  step recorded the digest of exactly this prompt, and it is checked (``prompts_verified`` /
  ``prompt_mismatches``);
- completion: the named action written as the policy's answer
  (``leafe.protocol.answers.expert_answer``, ``answer_format``, ending in the first of
  ``action_stop``), so the target is the move e names whatever the policy did.

A verdict is the reflection itself (``source = "oracle"``) or a label beside a model reflection
(``oracle_labels``); both carry ``oracle_action``. Identical prompts (the same prefix and e, from
several reflections) give one sample. Samples are emitted when the episode finishes (every branch
opened from a verdict is in the log then, for the check); abandoned episodes give none. Counts:
``FoldStats.follow``.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import structlog

from leafe.learner.materializers.base import (
    CommonOptions,
    Materializer,
    fast_prompt_sha256,
    path_entries,
)
from leafe.learner.materializers.common import sample_id_for
from leafe.learner.materializers.tree import EpisodeTree
from leafe.protocol.answers import AnswerFormat, AnswerTokenError, end_of_turn_id, expert_answer
from leafe.protocol.events import Branch, EpisodeEvent, Reflection, Step
from leafe.protocol.prompt import ChatTokenizer
from leafe.protocol.samples import Sample

__all__ = ["FollowMaterializer", "FollowOptions", "FollowProbe", "follow_probes"]

log = structlog.get_logger("leafe.learner.materializers")


class FollowOptions(CommonOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the ``follow`` materializer: explore episodes of train tasks only."""

    answer_format: AnswerFormat = "tag"
    """How the named action is written as the answer (as the environment's demonstrations write
    it)."""
    action_stop: list[str] = msgspec.field(default_factory=lambda: ["</action>"])
    """The explorer's ``action_stop``: the answer's ids end with the first that matches."""
    weight: float = 1.0
    """Loss weight of every sample."""

    def __post_init__(self) -> None:
        if set(self.modes) - {"explore"}:
            raise ValueError(f"modes = {self.modes!r}: verdicts are read from mode 'explore' only")
        if "test" in self.splits:
            raise ValueError(
                f"splits = {self.splits!r}: the warm start never trains on the test split"
            )


class FollowMaterializer(Materializer):
    """Oracle verdicts that name an action, as ``sft`` samples (see the module docstring)."""

    name = "follow"
    version = 1
    Options = FollowOptions
    options: FollowOptions

    def __init__(self, tokenizer: ChatTokenizer, options: FollowOptions | None = None) -> None:
        super().__init__(tokenizer, options)
        self.tokenizer = tokenizer
        self.eot = end_of_turn_id(tokenizer)

    def _count(self, what: str, n: int = 1) -> None:
        self.stats.follow[what] = self.stats.follow.get(what, 0) + n

    def _on_finished(self, tree: EpisodeTree) -> list[Sample]:
        probes, skipped = follow_probes(tree)
        for what, n in skipped.items():
            self._count(what, n)
        out: list[Sample] = []
        for probe in probes:
            sample = self._sample(tree, probe)
            if sample is not None:
                out.append(sample)
        return out

    def _sample(self, tree: EpisodeTree, probe: FollowProbe) -> Sample | None:
        self._count("seen")
        messages = self.render(
            tree, path_entries(probe.prefix), probe.observation, probe.experience
        )
        s = tree.started
        prompt_ids = self.prompts.encode(messages, s.response_prefix)
        if (
            probe.opened is not None
            and probe.opened.experience_in_context
            and self.options.verify_prompts
        ):
            self._verify_opened(probe.opened, prompt_ids)
        try:
            answer = expert_answer(
                probe.action,
                answer_format=self.options.answer_format,
                response_prefix=s.response_prefix,
                stop=self.options.action_stop,
                tokenizer=self.tokenizer,
                messages=messages,
                eot=self.eot,
            )
        except (ValueError, AnswerTokenError) as err:
            self._count("unformattable")
            log.warning(
                "replay.follow.unformattable",
                event_id=probe.reflection.event_id,
                error=str(err)[:200],
            )
            return None
        sources = [s.event_id, *(x.event_id for x in probe.prefix), probe.reflection.event_id]
        self._count("samples")
        return self.finish_sample(
            tree,
            sample_id_for(self.tag, "sft", sources),
            kind="sft",
            messages=messages,
            answer=s.response_prefix + answer.text,
            prompt_ids=prompt_ids,
            completion_ids=answer.token_ids,
            policy_version=probe.reflection.policy_version,
            weight=self.options.weight,
            sources=sources,
        )

    def _verify_opened(self, step: Step, prompt_ids: list[int]) -> None:
        """The branch this verdict opened sent exactly this prompt at its first step."""
        if not step.prompt_sha256:
            self.stats.prompts_unverifiable += 1
        elif fast_prompt_sha256(prompt_ids) == step.prompt_sha256:
            self.stats.prompts_verified += 1
        else:
            self.stats.prompt_mismatches += 1
            log.warning(
                "replay.follow.prompt_mismatch", episode_id=step.episode_id, event_id=step.event_id
            )


@dataclass(frozen=True)
class FollowProbe:
    """One oracle verdict that names an action, with the state it speaks about: what a follow sample
    is built from, and what ``experiments/paper/follow_audit.py`` samples the policy at (with e,
    without, a placebo)."""

    reflection: Reflection
    """The reflection carrying the verdict (its own, or a label beside a model reflection)."""
    prefix: list[Step]
    """The reflected branch's first ``tau`` steps (the oracle's tau): the history at tau."""
    observation: str
    """o_tau, the observation the step at tau was taken from."""
    experience: str
    """The oracle's e (as the explorer puts it in context)."""
    action: str
    """The action e names as the fix."""
    blamed: str | None
    """The action the branch took at tau, the one e corrects (``None``: an unparseable answer)."""
    opened: Step | None
    """The first step of the branch this verdict opened, when it opened one (oracle reflections)."""
    own_prefix: list[Step] | None = None
    """For a model reflection: the history at the model's own tau (its e's state); else ``None``."""


def follow_probes(tree: EpisodeTree) -> tuple[list[FollowProbe], dict[str, int]]:
    """Every distinct verdict of a finished episode that names an action (in event order), and how
    many reflections were passed over and why (``no_named_action``, ``unrenderable``,
    ``duplicate_prompt``)."""
    events = sorted(tree.seen.values(), key=lambda e: e.seq)
    first_steps = _first_steps_of_branches(events)
    probes: list[FollowProbe] = []
    skipped: dict[str, int] = {}
    seen: set[tuple[str, ...]] = set()
    for event in (e for e in events if isinstance(e, Reflection)):
        tau = event.tau if event.source == "oracle" else event.oracle_tau
        e = event.experience if event.source == "oracle" else event.oracle_experience
        path = tree.path(event.branch_id)[: event.at_t]
        why = ""
        if tau is None or not e or not event.oracle_action:
            why = "no_named_action"
        elif len(path) != event.at_t or not 0 <= tau < len(path):
            why = "unrenderable"
        else:
            key = (tree.started.event_id, *(s.event_id for s in path[:tau]), e, event.oracle_action)
            why = "duplicate_prompt" if key in seen else ""
            seen.add(key)
        if why:
            skipped[why] = skipped.get(why, 0) + 1
            continue
        assert tau is not None
        own = path[: event.tau] if event.source == "model" and event.tau < len(path) else None
        probes.append(
            FollowProbe(
                reflection=event,
                prefix=path[:tau],
                observation=tree.observation(path, tau),
                experience=e,
                action=event.oracle_action,
                blamed=path[tau].action,
                opened=first_steps.get(event.event_id),
                own_prefix=own,
            )
        )
    return probes, skipped


def _first_steps_of_branches(events: list[EpisodeEvent]) -> dict[str, Step]:
    """Reflection event id -> the first step of the branch it opened (the step at the branch's
    tau)."""
    opened = {e.branch_id: e for e in events if isinstance(e, Branch)}
    out: dict[str, Step] = {}
    for e in events:
        if isinstance(e, Step) and e.branch_id in opened:
            branch = opened[e.branch_id]
            if e.t == branch.tau and branch.reflection_event_id not in out:
                out[branch.reflection_event_id] = e
    return out
