"""The fair rows' sample builders (issue #61): DAgger with the oracle, rehearsal of the policy's own
steps, and the self-taught reflector's targets. Pure folds over explore logs, so ``leafe replay``
rebuilds each row's data from the shipped log.

- ``dagger`` (kind ``cf``): one round of DAgger on the policy's own rollouts, no tree. For each
  explore episode, the oracle verdicts on its root branch (the policy's free rollout: no e in any
  prompt) that name a move (an oracle-source Reflection, or the label beside a model one,
  ``oracle_labels``); with ``per_rollout = "first"`` the one at the smallest tau (the earliest state
  the oracle faults on that rollout, its first mistake as far as the verdicts on its prefixes
  show), with ``"all"`` every distinct one. Sample: the history at that tau, without e, -> the move
  the solver names there, written as the policy's answer. Kind ``cf`` so it trains through the very
  loss term of LEAFE's corrections: the rows differ only in where the corrected states and moves
  come from. The same state reached in two episodes of one task (identical action history) gives
  one sample; ``max_samples`` caps the samples in log order (to match another row's count of
  labelled states).
- ``reh-own`` (kind ``reh``): LEAFE's rehearsal set of the same trees (the ``leafe`` options:
  ``rehearsal_fraction``, ``rehearsal_unit``, ``rehearsal_seed``), less every step that had e in its
  prompt (an oracle- or reflection-guided step: with ``experience_scope = "first_step"`` the first
  step of each branch, which is also its cf target) and less any sample whose prompt and completion
  ids equal a cf sample of the same tree. Emitted when the episode closes (the cf samples of later
  branches are known then).
- ``self-taught`` (kind ``sft``): the model's own reflections that worked, as reflection targets
  (rejection sampling, STaR). A model reflection that parsed, names an e and opened a branch gets
  the reward ``success(branch) - success(baseline)``; the baseline is the no-e continuation from
  the same state: the parent's own path from tau (the policy's step at tau taken without e) when
  ``baseline = "parent"``, the root rollout's outcome with ``"root"``. A reward above 0 (above or at
  0 with ``keep_ties``, a success either way) keeps the reflection: prompt = the reflection prompt
  the explorer sent (checked against its digest), completion = the model's own answer ids. No
  oracle field is read. Where the parent's step at tau itself had e in its prompt (a branch of a
  branch at the same tau) the parent is no no-e baseline and the reflection is counted
  ``no_baseline``.

Counts: ``FoldStats.builders`` (``<builder>.<what>``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec

from leafe.learner.materializers.base import CommonOptions, Materializer, path_entries
from leafe.learner.materializers.common import fast_prompt_sha256, sample_id_for
from leafe.learner.materializers.leafe import LeafeMaterializer, LeafeOptions
from leafe.learner.materializers.reflect import _PROMPTED_TRIGGERS, reflection_prompt
from leafe.learner.materializers.tree import BranchNode, EpisodeTree
from leafe.protocol.answers import AnswerFormat, AnswerTokenError, end_of_turn_id, expert_answer
from leafe.protocol.events import Reflection, Step
from leafe.protocol.prompt import ChatTokenizer
from leafe.protocol.samples import Sample

__all__ = [
    "DaggerMaterializer",
    "DaggerOptions",
    "OwnRehearsalMaterializer",
    "OwnRehearsalOptions",
    "SelfTaughtMaterializer",
    "SelfTaughtOptions",
]


def _explore_only(modes: Sequence[str], splits: Sequence[str]) -> None:
    if set(modes) - {"explore"}:
        raise ValueError(f"modes = {list(modes)!r}: these builders read explore trees only")
    if "test" in splits:
        raise ValueError(f"splits = {list(splits)!r}: a training set never reads the test split")


def _reflections(tree: EpisodeTree) -> list[Reflection]:
    return sorted((e for e in tree.seen.values() if isinstance(e, Reflection)), key=lambda e: e.seq)


class _Counting(Materializer):
    def _count(self, what: str, n: int = 1) -> None:
        key = f"{self.name}.{what}"
        self.stats.builders[key] = self.stats.builders.get(key, 0) + n


class DaggerOptions(CommonOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the ``dagger`` builder."""

    per_rollout: Literal["first", "all"] = "first"
    """The first mistake of each root rollout, or every distinct verdict on it."""
    max_samples: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """At most this many samples, in log order (``None``: all)."""
    answer_format: AnswerFormat = "tag"
    """How the solver's move is written as the answer."""
    action_stop: list[str] = msgspec.field(default_factory=lambda: ["</action>"])
    """The explorer's ``action_stop``: the answer's ids end with the first that matches."""
    weight: float = 1.0

    def __post_init__(self) -> None:
        _explore_only(self.modes, self.splits)


@dataclass(frozen=True)
class _Label:
    tau: int
    action: str
    reflection: Reflection


class DaggerMaterializer(_Counting):
    """The oracle's move at the policy's first mistake on its own rollouts (module docstring)."""

    name = "dagger"
    version = 1
    Options = DaggerOptions
    options: DaggerOptions

    def __init__(self, tokenizer: ChatTokenizer, options: DaggerOptions | None = None) -> None:
        super().__init__(tokenizer, options)
        self.tokenizer = tokenizer
        self.eot = end_of_turn_id(tokenizer)
        self._states: set[tuple[str, ...]] = set()
        self._emitted = 0

    def _on_finished(self, tree: EpisodeTree) -> list[Sample]:
        root = next(b for b in tree.branches.values() if b.parent_id is None)
        path = tree.path(root.branch_id)
        labels: dict[int, _Label] = {}
        for r in _reflections(tree):
            if r.branch_id != root.branch_id:
                continue
            tau = r.tau if r.source == "oracle" else r.oracle_tau
            if tau is None or not r.oracle_action:
                self._count("no_named_move")
                continue
            if not 0 <= tau < min(r.at_t, len(path)) or any(
                s.experience_in_context for s in path[: tau + 1]
            ):
                self._count("unrenderable")
                continue
            labels.setdefault(tau, _Label(tau, r.oracle_action, r))
        if not labels:
            self._count("rollouts_without_label")
            return []
        chosen = sorted(labels.values(), key=lambda x: x.tau)
        if self.options.per_rollout == "first":
            chosen = chosen[:1]
        out = []
        for label in chosen:
            sample = self._sample(tree, path, label)
            if sample is not None:
                out.append(sample)
        return out

    def _sample(self, tree: EpisodeTree, path: list[Step], label: _Label) -> Sample | None:
        s = tree.started
        prefix = path[: label.tau]
        key = (s.task_id, *(x.raw_text for x in prefix))
        if key in self._states:
            self._count("same_state_again")
            return None
        if self.options.max_samples is not None and self._emitted >= self.options.max_samples:
            self._count("over_max_samples")
            return None
        messages = self.render(tree, path_entries(prefix), tree.observation(path, label.tau), None)
        prompt_ids = self.prompts.encode(messages, s.response_prefix)
        if self.options.verify_prompts and path[label.tau].event_id not in tree.verified:
            self._verify(tree, path[label.tau], prompt_ids)
        try:
            answer = expert_answer(
                label.action,
                answer_format=self.options.answer_format,
                response_prefix=s.response_prefix,
                stop=self.options.action_stop,
                tokenizer=self.tokenizer,
                messages=messages,
                eot=self.eot,
            )
        except (ValueError, AnswerTokenError):
            self._count("unformattable")
            return None
        self._states.add(key)
        self._emitted += 1
        self._count("samples")
        self._count("same_as_blamed", path[label.tau].action == label.action)
        sources = [s.event_id, *(x.event_id for x in prefix), label.reflection.event_id]
        return self.finish_sample(
            tree,
            sample_id_for(self.tag, "cf", sources),
            kind="cf",
            messages=messages,
            answer=s.response_prefix + answer.text,
            prompt_ids=prompt_ids,
            completion_ids=answer.token_ids,
            policy_version=path[label.tau].policy_version,
            weight=self.options.weight,
            sources=sources,
        )


class OwnRehearsalOptions(LeafeOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the ``reh-own`` builder: LEAFE's, of which only the rehearsal ones matter."""


class OwnRehearsalMaterializer(LeafeMaterializer):
    """LEAFE's rehearsal set less guided steps and cf duplicates (module docstring)."""

    name = "reh-own"
    version = 1
    Options = OwnRehearsalOptions  # type: ignore[assignment]
    options: OwnRehearsalOptions

    def __init__(
        self, tokenizer: ChatTokenizer, options: OwnRehearsalOptions | None = None
    ) -> None:
        super().__init__(tokenizer, options)
        self._held: dict[str, tuple[list[Sample], list[Sample]]] = {}

    def _count(self, what: str, n: int = 1) -> None:
        key = f"{self.name}.{what}"
        self.stats.builders[key] = self.stats.builders.get(key, 0) + n

    def _on_outcome(self, tree: EpisodeTree, node: BranchNode) -> list[Sample]:
        cf, reh = self._held.setdefault(tree.started.episode_id, ([], []))
        for sample in super()._on_outcome(tree, node):
            (cf if sample.kind == "cf" else reh).append(sample)
            # finish_sample counted it: counted again only if emitted
            self.stats.samples[sample.kind] -= 1
            if not self.stats.samples[sample.kind]:
                del self.stats.samples[sample.kind]
        return []

    def _on_closed(self, tree: EpisodeTree, abandoned: bool) -> list[Sample]:
        super()._on_closed(tree, abandoned)  # releases the episode's events
        cf, reh = self._held.pop(tree.started.episode_id, ([], []))
        guided = {
            e.event_id
            for e in tree.seen.values()
            if isinstance(e, Step) and e.experience_in_context
        }
        identical = {(tuple(s.prompt_ids), tuple(s.completion_ids)) for s in cf}
        out: list[Sample] = []
        for s in reh:
            target = max(s.source_event_ids, key=lambda i: _seq(tree, i))
            if target in guided:
                self._count("guided_dropped")
                self._count(
                    "identical_to_cf", (tuple(s.prompt_ids), tuple(s.completion_ids)) in identical
                )
                continue
            if (tuple(s.prompt_ids), tuple(s.completion_ids)) in identical:
                self._count("identical_dropped")
                continue
            self._count("samples")
            self.stats.samples["reh"] = self.stats.samples.get("reh", 0) + 1
            out.append(s)
        return out


def _seq(tree: EpisodeTree, event_id: str) -> int:
    e = tree.seen.get(event_id)
    return -1 if e is None else e.seq


class SelfTaughtOptions(CommonOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the ``self-taught`` builder."""

    baseline: Literal["parent", "root"] = "parent"
    """The no-e outcome a branch must beat: its parent's continuation from tau, or the root's."""
    keep_ties: bool = False
    """Also keep a successful branch whose baseline succeeded too (reward 0)."""
    reflect_history_window: int = 0
    """As ``ExplorerConfig.reflect_history_window`` (the prompt digest checks it)."""
    reflect_stop: list[str] = msgspec.field(default_factory=lambda: ["</experience>"])
    """The explorer's ``reflect_stop``: the engine keeps a matched stop string in the answer's ids
    but not in its text; the sample's answer text gets it back."""
    weight: float = 1.0

    def __post_init__(self) -> None:
        _explore_only(self.modes, self.splits)


class SelfTaughtMaterializer(_Counting):
    """Model reflections whose branch beat the no-e baseline, as reflection targets."""

    name = "self-taught"
    version = 1
    Options = SelfTaughtOptions
    options: SelfTaughtOptions

    def __init__(self, tokenizer: ChatTokenizer, options: SelfTaughtOptions | None = None) -> None:
        super().__init__(tokenizer, options)
        self.tokenizer = tokenizer

    def _on_finished(self, tree: EpisodeTree) -> list[Sample]:
        opened = {b.reflection_event_id: b for b in tree.branches.values()}
        out: list[Sample] = []
        for r in _reflections(tree):
            if r.source != "model":
                continue
            self._count("seen")
            node = opened.get(r.event_id)
            if node is None or not r.parse_ok or not r.experience or not r.token_ids:
                self._count("no_branch" if node is None else "unparsed")
                continue
            reward = self._reward(tree, node)
            if reward is None:
                self._count("no_baseline")
                continue
            self._count(f"reward_{reward:+d}")
            if reward < 0 or (reward == 0 and not (self.options.keep_ties and _won(node))):
                continue
            sample = self._sample(tree, r)
            if sample is not None:
                out.append(sample)
        return out

    def _reward(self, tree: EpisodeTree, node: BranchNode) -> int | None:
        if node.outcome is None or node.parent_id is None:
            return None
        if self.options.baseline == "root":
            base = next(b for b in tree.branches.values() if b.parent_id is None)
        else:
            base = tree.branches[node.parent_id]
            at_tau = tree.path(base.branch_id)
            if len(at_tau) <= node.tau or at_tau[node.tau].experience_in_context:
                return None
        if base.outcome is None:
            return None
        return int(node.outcome.success) - int(base.outcome.success)

    def _sample(self, tree: EpisodeTree, r: Reflection) -> Sample | None:
        path = tree.path(r.branch_id)[: r.at_t]
        if r.trigger not in _PROMPTED_TRIGGERS or not path or len(path) != r.at_t:
            self._count("unrenderable")
            return None
        sources = [tree.started.event_id, *(s.event_id for s in path), r.event_id]
        sid = sample_id_for(self.tag, "sft", sources)
        if sid in tree.emitted:
            return None
        messages = reflection_prompt(
            tree, r, path_entries(path), self.options.reflect_history_window
        )
        prompt_ids = self.prompts.encode(messages)
        if self.options.verify_prompts:
            if not r.prompt_sha256:
                self.stats.prompts_unverifiable += 1
            elif fast_prompt_sha256(prompt_ids) == r.prompt_sha256:
                self.stats.prompts_verified += 1
            else:
                self.stats.prompt_mismatches += 1
        answer = r.raw_text
        tail = self.tokenizer.decode(list(r.token_ids[-16:]))
        for stop in self.options.reflect_stop:
            if stop and not answer.endswith(stop) and tail.endswith(stop):
                answer += stop
                break
        self._count("samples")
        return self.finish_sample(
            tree,
            sid,
            kind="sft",
            messages=messages,
            answer=answer,
            prompt_ids=prompt_ids,
            completion_ids=list(r.token_ids),
            policy_version=r.policy_version,
            weight=self.options.weight,
            sources=sources,
        )


def _won(node: BranchNode) -> bool:
    return node.outcome is not None and node.outcome.success
