"""Building one sample from an episode tree: the prompt rebuilt from the log, verified, tokenized.

:class:`SampleBuilder` is the half of :class:`~leafe.learner.materializers.base.Materializer` that
turns a target step on a branch's path into a :class:`~leafe.protocol.samples.Sample`
(``build_sample``): the prompt is ``render_messages`` of the task and the history before the step
(without the experience unless asked), tokenized through the fold's
:class:`~leafe.learner.materializers.common.PromptCache`, and the exact prompt the actor sent is
checked against ``Step.prompt_sha256`` (``verify_prompts``; a mismatch is counted and logged, never
fatal). Samples are deduplicated within their episode by id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog

from leafe.learner.materializers.common import (
    CommonOptions,
    FoldStats,
    PromptCache,
    fast_prompt_sha256,
    sample_id_for,
)
from leafe.learner.materializers.tree import EpisodeTree, history_entry
from leafe.protocol.events import Step
from leafe.protocol.prompt import HistoryEntry, render_messages
from leafe.protocol.samples import ChatMessage, Sample, SampleKind

__all__ = ["SampleBuilder", "path_entries"]

log = structlog.get_logger("leafe.learner.materializers")


class SampleBuilder:
    """Builds and verifies samples; mixed into every materializer."""

    options: CommonOptions
    prompts: PromptCache
    stats: FoldStats

    @property
    def tag(self) -> str:
        """Name and version stamped on samples (the materializer's)."""
        raise NotImplementedError

    def render(
        self,
        tree: EpisodeTree,
        history: Sequence[HistoryEntry],
        observation: str,
        experience: str | None,
    ) -> list[ChatMessage]:
        """The prompt messages for a step with ``history`` before it."""
        s = tree.started
        return render_messages(
            instructions=s.instructions,
            task=s.task,
            history=history,
            observation=observation,
            experience=experience,
            history_window=s.history_window,
        )

    @staticmethod
    def sent_experience(tree: EpisodeTree, step: Step) -> str | None:
        """The experience that was in the prompt of ``step`` (``None`` when it had none)."""
        return tree.branches[step.branch_id].experience if step.experience_in_context else None

    def build_sample(
        self,
        tree: EpisodeTree,
        *,
        kind: SampleKind,
        path: Sequence[Step],
        t: int,
        entries: Sequence[HistoryEntry],
        source_event_ids: Sequence[str],
        weight: float = 1.0,
        keep_experience: bool = False,
        **extra: Any,
    ) -> Sample | None:
        """Sample whose target is ``path[t]`` and whose input is ``q + h_t``, or ``None`` when
        skipped.

        The training prompt carries no experience unless ``keep_experience`` (GRPO trains on the
        exact behaviour prompt). ``entries[i]`` is the history entry of ``path[i]`` (at least ``t``
        of them). Deduplicated within the episode by sample id; tokenizes only what is emitted.
        """
        target = path[t]
        if self.options.skip_unparsed_targets and not target.parse_ok:
            self.stats.skipped_unparsed += 1
            return None
        if not target.token_ids:
            self.stats.skipped_empty += 1
            return None
        sid = sample_id_for(self.tag, kind, source_event_ids)
        if sid in tree.emitted:
            return None
        sent_e = self.sent_experience(tree, target)
        train_e = sent_e if keep_experience else None
        observation = tree.observation(path, t)
        messages = self.render(tree, entries[:t], observation, train_e)
        prefix = tree.started.response_prefix
        prompt_ids = self.prompts.encode(messages, prefix)
        if self.options.verify_prompts and target.event_id not in tree.verified:
            sent_ids = (
                prompt_ids
                if sent_e == train_e
                else self.prompts.encode(
                    self.render(tree, entries[:t], observation, sent_e), prefix
                )
            )
            self._verify(tree, target, sent_ids)
        return self.finish_sample(
            tree,
            sid,
            kind=kind,
            messages=messages,
            answer=prefix + target.raw_text,
            prompt_ids=prompt_ids,
            completion_ids=target.token_ids,
            policy_version=target.policy_version,
            weight=weight,
            sources=source_event_ids,
            **extra,
        )

    def finish_sample(
        self,
        tree: EpisodeTree,
        sid: str,
        *,
        kind: SampleKind,
        messages: Sequence[ChatMessage],
        answer: str,
        prompt_ids: list[int],
        completion_ids: list[int],
        policy_version: str,
        weight: float,
        sources: Sequence[str],
        **extra: Any,
    ) -> Sample:
        """The chat-formatted sample ``messages`` -> ``answer`` (exact ids), recorded as emitted by
        ``tree`` and counted: the one way every materializer makes a sample."""
        tree.emitted.add(sid)
        self.stats.samples[kind] = self.stats.samples.get(kind, 0) + 1
        s = tree.started
        return Sample(
            sample_id=sid,
            run_id=s.run_id,
            kind=kind,
            materializer=self.tag,
            env=s.env,
            task_id=s.task_id,
            episode_id=s.episode_id,
            messages=[*messages, ChatMessage(role="assistant", content=answer)],
            target_turn=len(messages),
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            policy_version=policy_version,
            weight=weight,
            source_event_ids=sorted(sources),
            **extra,
        )

    def _verify(self, tree: EpisodeTree, step: Step, sent_ids: Sequence[int]) -> None:
        tree.verified.add(step.event_id)
        if not step.prompt_sha256:
            self.stats.prompts_unverifiable += 1
            return
        if fast_prompt_sha256(sent_ids) == step.prompt_sha256:
            self.stats.prompts_verified += 1
            return
        self.stats.prompt_mismatches += 1
        log.warning(
            "replay.prompt.mismatch",
            episode_id=step.episode_id,
            event_id=step.event_id,
            branch_id=step.branch_id,
            t=step.t,
            experience_in_context=step.experience_in_context,
            sent_tokens=step.prompt_tokens,
            rebuilt_tokens=len(sent_ids),
        )


def path_entries(path: Sequence[Step]) -> list[HistoryEntry]:
    """History entries of every step of ``path``."""
    return [history_entry(s) for s in path]
