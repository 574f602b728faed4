"""The reflection warm start: oracle-labelled reflections as supervised samples.

SmolLM2-135M's own reflections are noise, so few rolled-back branches succeed. This materializer
turns the oracle's verdict on the policy's *own* failing histories into SFT samples of the
reflection format, so a short SFT teaches the policy to name tau and e before Stage 1 runs with
model reflections.

A Reflection has an oracle verdict when the oracle wrote it (``source = "oracle"``: tau and e are
the verdict) or when the explorer labelled a model reflection (``ExplorerConfig.oracle_labels``:
``oracle_tau`` and ``oracle_experience``). For each such Reflection of a train-split ``explore``
episode whose oracle e is non-empty (the oracle found a mistake), one sample, kind ``sft`` (loss
term L_rft):

- prompt: exactly the reflection prompt the explorer renders for that branch at that point
  (``leafe.protocol.reflection.render_reflection_messages`` of the episode's instructions and task,
  the branch's first ``at_t`` steps, the last one's observation, the trigger and
  ``reflect_history_window``), tokenized by the same chat tokenizer, with no response prefix;
  checked against ``Reflection.prompt_sha256`` when the log has it (a model reflection), counted
  like step prompts (``prompts_verified``, ``prompt_mismatches``, ``prompts_unverifiable``);
- completion: ``format_reflection(oracle tau, oracle e)``
  (``<step>N</step><experience>e</experience>``, which ``leafe.actors.parsing.parse_reflection``
  reads back to the same tau and e), tokenized as the continuation of the prompt. It ends with the
  explorer's reflection stop string ``</experience>``, kept in the ids as an engine keeps a matched
  stop string, so, as the tagged ``sft`` actions end with ``</action>``, no end-of-turn token
  follows; the end-of-turn token is appended only when no stop string in ``reflect_stop`` ends the
  answer (as ``actors/demo.py`` does for answers).

Samples are emitted at the ``Outcome`` of the branch reflected upon; with ``only_failed_branches``
(the default: only the model's own failed episodes) a reflection on a branch that went on
to succeed (a periodic one) gives none. Counts: ``FoldStats.reflections_*``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

import msgspec
import structlog

from leafe.learner.materializers.base import (
    CommonOptions,
    Materializer,
    fast_prompt_sha256,
    path_entries,
    sample_id_for,
)
from leafe.learner.materializers.tree import BranchNode, EpisodeTree
from leafe.protocol.answers import AnswerTokenError, answer_ids, end_of_turn_id
from leafe.protocol.events import Reflection, ReflectionTrigger
from leafe.protocol.prompt import ChatTokenizer, HistoryEntry
from leafe.protocol.reflection import format_reflection, render_reflection_messages
from leafe.protocol.samples import ChatMessage, Sample

__all__ = ["ReflectMaterializer", "ReflectOptions", "oracle_verdict", "reflection_prompt"]

log = structlog.get_logger("leafe.learner.materializers")
_PROMPTED_TRIGGERS = frozenset(get_args(ReflectionTrigger)) - {"alternative"}


class ReflectOptions(CommonOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of the ``reflect`` materializer: explore episodes of train tasks only."""

    reflect_history_window: int = 0
    """Past steps shown in the reflection prompt, as ``ExplorerConfig.reflect_history_window``
    (default 0 = all); must equal the explorer's, which ``Reflection.prompt_sha256`` checks where
    the log has it."""
    reflect_stop: list[str] = msgspec.field(default_factory=lambda: ["</experience>"])
    """The explorer's ``reflect_stop``: an answer ending with one of them gets no end-of-turn
    token."""
    only_failed_branches: bool = True
    """Only reflections on branches whose Outcome is not a success (the model's own failures)."""
    weight: float = 1.0
    """Loss weight of every sample."""

    def __post_init__(self) -> None:
        if set(self.modes) - {"explore"}:
            raise ValueError(
                f"modes = {self.modes!r}: reflections are read from mode 'explore' only"
            )
        if "test" in self.splits:
            raise ValueError(
                f"splits = {self.splits!r}: the warm start never trains on the test split"
            )
        if self.reflect_history_window < 0:
            raise ValueError(
                f"reflect_history_window = {self.reflect_history_window}: must be >= 0"
            )


def oracle_verdict(event: Reflection) -> tuple[int, str] | None:
    """The oracle's (tau, e) for ``event``: its own when the oracle wrote it, the label beside a
    model reflection, or ``None`` when no oracle was asked."""
    if event.source == "oracle":
        return event.tau, event.experience
    if event.source == "model" and event.oracle_tau is not None:
        return event.oracle_tau, event.oracle_experience
    return None


def reflection_prompt(
    tree: EpisodeTree, event: Reflection, history: Sequence[HistoryEntry], history_window: int
) -> list[ChatMessage]:
    """The reflection messages the explorer rendered for ``event`` (``history``: its first ``at_t``
    steps)."""
    s = tree.started
    return render_reflection_messages(
        instructions=s.instructions,
        task=s.task,
        history=history,
        observation=history[-1].observation,
        trigger=event.trigger,
        history_window=history_window,
    )


class ReflectMaterializer(Materializer):
    """Oracle-labelled reflections as ``sft`` samples (see the module docstring)."""

    name = "reflect"
    version = 1
    Options = ReflectOptions
    options: ReflectOptions

    def __init__(self, tokenizer: ChatTokenizer, options: ReflectOptions | None = None) -> None:
        super().__init__(tokenizer, options)
        self.tokenizer = tokenizer
        self.eot = end_of_turn_id(tokenizer)

    def _on_outcome(self, tree: EpisodeTree, node: BranchNode) -> list[Sample]:
        assert node.outcome is not None
        reflections = sorted(
            (
                e
                for e in tree.seen.values()
                if isinstance(e, Reflection) and e.branch_id == node.branch_id
            ),
            key=lambda e: e.seq,
        )
        out: list[Sample] = []
        for event in reflections:
            sample = self._sample(tree, node, event)
            if sample is not None:
                out.append(sample)
        return out

    def _count(self, what: str) -> None:
        self.stats.reflections[what] = self.stats.reflections.get(what, 0) + 1

    def _sample(self, tree: EpisodeTree, node: BranchNode, event: Reflection) -> Sample | None:
        self._count("seen")
        verdict = oracle_verdict(event)
        if verdict is None:
            self._count("unlabelled")
            return None
        tau, experience = verdict
        if not experience:
            self._count("no_mistake")
            return None
        assert node.outcome is not None
        if self.options.only_failed_branches and node.outcome.success:
            self._count("branch_succeeded")
            return None
        path = tree.path(node.branch_id)[: event.at_t]
        if event.trigger not in _PROMPTED_TRIGGERS or not path or len(path) != event.at_t:
            self._count("unrenderable")
            log.warning("replay.reflect.unrenderable", event_id=event.event_id, at_t=event.at_t)
            return None
        sources = [tree.started.event_id, *(s.event_id for s in path), event.event_id]
        sid = sample_id_for(self.tag, "sft", sources)
        if sid in tree.emitted:
            return None
        messages = reflection_prompt(
            tree, event, path_entries(path), self.options.reflect_history_window
        )
        prompt_ids = self.prompts.encode(messages)
        self._verify_reflection(event, prompt_ids)
        try:
            text = format_reflection(tau, experience)
            completion = answer_ids(self.tokenizer, messages, "", text)
        except (ValueError, AnswerTokenError) as e:
            self._count("unformattable")
            log.warning("replay.reflect.unformattable", event_id=event.event_id, error=str(e)[:200])
            return None
        if not any(stop and text.endswith(stop) for stop in self.options.reflect_stop):
            completion = [*completion, self.eot]
        self._count("samples")
        return self.finish_sample(
            tree,
            sid,
            kind="sft",
            messages=messages,
            answer=text,
            prompt_ids=prompt_ids,
            completion_ids=completion,
            policy_version=event.policy_version,
            weight=self.options.weight,
            sources=sources,
        )

    def _verify_reflection(self, event: Reflection, prompt_ids: list[int]) -> None:
        """Compare the rebuilt prompt with the one the engine was sent (model reflections record
        it)."""
        if not self.options.verify_prompts:
            return
        if not event.prompt_sha256:
            self.stats.prompts_unverifiable += 1
            return
        if fast_prompt_sha256(prompt_ids) == event.prompt_sha256:
            self.stats.prompts_verified += 1
            return
        self.stats.prompt_mismatches += 1
        log.warning(
            "replay.reflect.prompt_mismatch",
            episode_id=event.episode_id,
            event_id=event.event_id,
            at_t=event.at_t,
            history_window=self.options.reflect_history_window,
        )
