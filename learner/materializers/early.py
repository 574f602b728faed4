"""The Early Experience baseline (Zhang et al. 2025) as folds over demonstration episodes.

A demonstration with alternatives (``actors/early.py``) holds, per expert state s_t, one-step
branches ``b_n`` (parent ``b0``, tau = t) whose single Step is the policy's alternative action a'
and the observation it led to, each after a ``Reflection(trigger="alternative")``. Two
materializers:

- ``iwm`` (implicit world modelling): for each alternative branch, input = the state's prompt with
  the closing question replaced by ``Action: a'`` and a request for the resulting observation;
  target = that observation *exactly as executed* (``Step.observation``), then the end-of-turn
  token. Kind ``iwm``.
- ``sr`` (self-reflection): for each alternative branch whose Reflection holds the policy's
  explanation (``source = "model"``), input = the state's prompt prefilled with ``<think>``; target
  = the explanation, ``</think>``, the response prefix, then the expert step's exact completion
  ids::

      <think>Left walks into the wall; up pushes the box onto the target.</think><action>up</action>

  (``leafe.actors.parsing.parse_action`` reads the action after the think block). Evaluate an
  ``sr``-trained policy with ``response_prefix = "<think>"`` (and a ``max_new_tokens`` that fits the
  reasoning). Kind ``sr``.

Both also emit the demonstrations themselves (kind ``sft``, ``demonstrations = true``, as
``learner/materializers/sft.py``): the paper trains IWM and then SFT on the demonstrations, and
mixes SR with them; one mixed dataset is our simplification (set ``demonstrations = false`` and
build an ``sft`` dataset separately for two stages). Every state prompt is checked against the
recorded ``Step.prompt_sha256`` of the alternative (the same prompt the expert step was sent);
IWM/SR targets are tokenized here with the served tokenizer (``leafe.protocol.answers``), since no
engine generated them.
"""

from __future__ import annotations

from collections.abc import Sequence

from leafe.learner.materializers.base import Materializer, path_entries, sample_id_for
from leafe.learner.materializers.sft import DemoOptions, demonstration_samples
from leafe.learner.materializers.tree import BranchNode, EpisodeTree
from leafe.protocol.answers import THINK_CLOSE, THINK_OPEN, answer_ids, end_of_turn_id
from leafe.protocol.events import ROOT_BRANCH, EpisodeEvent, Reflection, Step
from leafe.protocol.prompt import ChatTokenizer
from leafe.protocol.samples import ChatMessage, Sample, SampleKind

__all__ = ["IWM_QUESTION", "IwmMaterializer", "IwmOptions", "SrMaterializer", "SrOptions"]

_ACTION_QUESTION = "Your next action?"
IWM_QUESTION = "What do you observe after this action? Answer with the observation only."
"""Closes every IWM input (after ``Action: a'``)."""


class IwmOptions(DemoOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the ``iwm`` materializer."""

    demonstrations: bool = True
    """Also emit the demonstration steps as ``sft`` samples (one mixed dataset)."""
    weight: float = 1.0
    """Loss weight of every ``iwm`` sample."""


class SrOptions(DemoOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the ``sr`` materializer."""

    demonstrations: bool = True
    """Also emit the demonstration steps as ``sft`` samples (the paper mixes them in)."""
    weight: float = 1.0
    """Loss weight of every ``sr`` sample."""


class _EarlyExperience(Materializer):
    """Shared parts: alternative branches, the state prompt, and sample assembly."""

    options: IwmOptions | SrOptions

    def __init__(
        self, tokenizer: ChatTokenizer, options: IwmOptions | SrOptions | None = None
    ) -> None:
        super().__init__(tokenizer, options)
        self.eot = end_of_turn_id(tokenizer)

    def _on_outcome(self, tree: EpisodeTree, node: BranchNode) -> list[Sample]:
        if node.branch_id == ROOT_BRANCH:
            if not self.options.demonstrations:
                return []
            return demonstration_samples(self, tree, node, weight=self.options.demo_weight)
        if node.parent_id != ROOT_BRANCH or len(node.steps) != 1:
            return []  # not an Early Experience branch
        sample = self._alternative(tree, node, node.steps[0])
        return [] if sample is None else [sample]

    def _alternative(self, tree: EpisodeTree, node: BranchNode, alt: Step) -> Sample | None:
        raise NotImplementedError

    def state_messages(self, tree: EpisodeTree, alt: Step) -> list[ChatMessage]:
        """The prompt of state s_tau (shared by the expert step and the alternative), verified
        once."""
        path = tree.path(alt.branch_id)
        t = alt.t
        messages = self.render(tree, path_entries(path[:t]), tree.observation(path, t), None)
        if self.options.verify_prompts and alt.event_id not in tree.verified:
            self._verify(tree, alt, self.prompts.encode(messages, tree.started.response_prefix))
        return messages

    def assemble(
        self,
        tree: EpisodeTree,
        *,
        kind: SampleKind,
        messages: Sequence[ChatMessage],
        answer: str,
        prompt_ids: list[int],
        completion_ids: list[int],
        policy_version: str,
        sources: Sequence[str],
    ) -> Sample | None:
        """A sample of ``messages`` -> ``answer`` (deduplicated per episode, counted)."""
        sid = sample_id_for(self.tag, kind, sources)
        if sid in tree.emitted:
            return None
        return self.finish_sample(
            tree,
            sid,
            kind=kind,
            messages=messages,
            answer=answer,
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            policy_version=policy_version,
            weight=self.options.weight,
            sources=sources,
        )

    @staticmethod
    def sources(tree: EpisodeTree, node: BranchNode, alt: Step) -> list[str]:
        """Event ids a sample of this alternative depends on."""
        prefix = tree.path(ROOT_BRANCH)[: alt.t]
        ids = [tree.started.event_id, *(s.event_id for s in prefix), alt.event_id]
        return ids + [x for x in (node.event_id, node.reflection_event_id) if x is not None]


class IwmMaterializer(_EarlyExperience):
    """Implicit world modelling: (state, alternative action) -> the observation it led to."""

    name = "iwm"
    version = 1
    Options = IwmOptions
    options: IwmOptions

    def _alternative(self, tree: EpisodeTree, node: BranchNode, alt: Step) -> Sample | None:
        if alt.action is None:
            self.stats.skipped_unparsed += 1
            return None
        state = self.state_messages(tree, alt)
        question = state[-1].content.removesuffix(_ACTION_QUESTION).rstrip()
        user = f"{question}\n\nAction: {alt.action}\n{IWM_QUESTION}"
        messages = [*state[:-1], ChatMessage(role="user", content=user)]
        tokenizer = self.prompts.tokenizer
        return self.assemble(
            tree,
            kind="iwm",
            messages=messages,
            answer=alt.observation,
            prompt_ids=self.prompts.encode(messages),
            completion_ids=[*answer_ids(tokenizer, messages, "", alt.observation), self.eot],
            policy_version=alt.policy_version,
            sources=self.sources(tree, node, alt),
        )


class SrMaterializer(_EarlyExperience):
    """Self-reflection: state -> why the expert action beats the alternative, then the expert
    action."""

    name = "sr"
    version = 1
    Options = SrOptions
    options: SrOptions

    def __init__(self, tokenizer: ChatTokenizer, options: SrOptions | None = None) -> None:
        super().__init__(tokenizer, options)
        self._reflections: dict[str, dict[str, Reflection]] = {}

    def apply(self, event: EpisodeEvent, *, now: float = 0.0) -> list[Sample]:
        """Fold ``event``; Reflections of open episodes are kept for their branches' samples."""
        samples = super().apply(event, now=now)
        if isinstance(event, Reflection) and self.is_open(event.episode_id):
            self._reflections.setdefault(event.episode_id, {})[event.event_id] = event
        return samples

    def _on_closed(self, tree: EpisodeTree, abandoned: bool) -> list[Sample]:
        self._reflections.pop(tree.started.episode_id, None)
        return super()._on_closed(tree, abandoned)

    def _alternative(self, tree: EpisodeTree, node: BranchNode, alt: Step) -> Sample | None:
        kept = self._reflections.get(tree.started.episode_id, {})
        reflection = kept.get(node.reflection_event_id or "")
        expert = tree.path(ROOT_BRANCH)[alt.t]
        if reflection is None or reflection.source != "model" or not reflection.experience:
            self.stats.skipped_no_target += 1
            return None
        if self.options.skip_unparsed_targets and not expert.parse_ok:
            self.stats.skipped_unparsed += 1
            return None
        state = self.state_messages(tree, alt)
        prefix = tree.started.response_prefix
        head = f"{reflection.experience}{THINK_CLOSE}{prefix}"
        completion = [
            *answer_ids(self.prompts.tokenizer, state, THINK_OPEN, head),
            *expert.token_ids,
        ]
        return self.assemble(
            tree,
            kind="sr",
            messages=state,
            answer=f"{THINK_OPEN}{head}{expert.raw_text}",
            prompt_ids=self.prompts.encode(state, THINK_OPEN),
            completion_ids=completion,
            policy_version=reflection.policy_version,
            sources=[*self.sources(tree, node, alt), expert.event_id],
        )
