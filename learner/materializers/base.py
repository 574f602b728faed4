"""The fold interface every materializer implements, and how a sample is built from an episode tree.

A materializer turns the event log into training samples as a pure fold: ``samples =
m.apply(event)`` updates explicit in-memory state (one
:class:`~leafe.learner.materializers.tree.EpisodeTree` per open episode) and returns the samples
that event completed. No I/O happens here; ``services/replayer/main.py`` (online) and
``services/replayer/replay.py`` (offline) feed it events and ship what it returns. Subclasses
(``leafe``, ``grpo``, ``rft``) only decide *which* steps become samples, through the hooks
``_on_started``, ``_on_outcome``, ``_on_finished`` and ``_on_closed``.

Contract with the actors: the prompt of step ``t`` on a branch's path is
``render_messages(instructions, task, history=path[:t], observation=o_t, experience=e of the step's
branch if Step.experience_in_context, history_window)`` tokenized by the same
:class:`ChatTokenizer`; its digest is ``Step.prompt_sha256``. Every target is checked against it
(``verify_prompts``): a mismatch is logged with context and counted in :class:`FoldStats`, never
fatal.

Lifecycle (``leafe.learner.materializers.lifecycle``): an episode whose mode, split or prompt format
gives no samples is never opened (its events are dropped, counted). Others are held from
``EpisodeStarted`` until released: at ``EpisodeFinished``, or when closed as abandoned: by
:meth:`Materializer.close_stale` (online, by idle time), by the ``EpisodeStarted`` of a later
delivery attempt of the same task (its earlier attempt lost the task: its actor crashed or stalled
past the ack wait; at the same event online and offline, so both decide alike), or by
:meth:`Materializer.close_all` (end of an offline log); closing never produces samples from a branch
without ``Outcome``. :meth:`Materializer.drain_released` lists the episodes whose events will never
be needed again (the replayer acks their anchors then). ``limits`` (:class:`OpenLimits`) caps held
episodes per run and per actor, and the bytes they hold (per run and per publishing actor): an
``EpisodeStarted`` past a cap is refused, an event past a byte cap rejected, each with its cap's
code.

An episode belongs to the actor that started it: an event whose ``actor_id`` (its publisher's
NATS identity, ``leafe.protocol.codec.admit_event``) is not its EpisodeStarted's is rejected with
code ``foreign_episode`` ("episode X belongs to actor A, which started it; event from actor B"),
while the episode is open and after it ended (finished, abandoned, ignored, refused, failed: the
fold remembers who started it), so no actor can add steps, outcomes or a second start to another's
episode, nor end it. A later delivery attempt closes an earlier one as abandoned only when the same
actor started both; another actor's EpisodeStarted naming the same task key (a claim anyone can
write) leaves the earlier attempt open, to finish or go stale on its own. Admission refuses
episode ids that name another actor before the fold sees them; the fold's check holds for any id,
also in logs recorded before ids named their owner.

Token ids (``Step.token_ids``, ``Reflection.token_ids``) must lie in the tokenizer's vocabulary
(``vocab_size``, :func:`~leafe.learner.materializers.common.vocab_size_of`): an id that is negative
or past it (which the model's embedding would raise on, in the learner) is rejected here, before it
can become a training target.

Bad input never escapes as anything but :class:`ReplayError`: a malformed event is rejected with the
tree unchanged; any other exception while folding an event (a bug that input reached) drops the
event's whole episode and raises :class:`EpisodeFailed` with the cause, and the episode's later
events are rejected with that reason. Both are deterministic, so a replay of the same log decides
the same way.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec
import structlog

from leafe.learner.materializers.common import (
    CommonOptions,
    FoldStats,
    PromptCache,
    fast_prompt_sha256,
    sample_id_for,
    selected_fraction,
    vocab_size_of,
)
from leafe.learner.materializers.lifecycle import Closed, Ledger, OpenLimits, event_bytes
from leafe.learner.materializers.samples import SampleBuilder, path_entries
from leafe.learner.materializers.tree import BranchNode, EpisodeFailed, EpisodeTree, ReplayError
from leafe.protocol.codec import FOREIGN_EPISODE
from leafe.protocol.events import (
    EpisodeEvent,
    EpisodeFinished,
    EpisodeStarted,
    Outcome,
    Reflection,
    Step,
)
from leafe.protocol.prompt import PROMPT_FORMAT, ChatTokenizer
from leafe.protocol.samples import Sample

__all__ = [
    "CommonOptions",
    "EpisodeFailed",
    "FoldStats",
    "Materializer",
    "OpenLimits",
    "PromptCache",
    "ReplayError",
    "fast_prompt_sha256",
    "path_entries",
    "sample_id_for",
    "selected_fraction",
]

log = structlog.get_logger("leafe.learner.materializers")


def _shown(value: str, limit: int = 80) -> str:
    return repr(value if len(value) <= limit else value[: limit - 3] + "...")


class Materializer(SampleBuilder):
    """Base fold: validates events into episode trees and calls the subclass hooks.

    ``apply(event, now=...)`` returns the samples completed by ``event`` (raises
    :class:`ReplayError` for bad input, state unchanged); ``now`` is the caller's clock, used only
    by :meth:`close_stale`.
    """

    name: ClassVar[str] = "base"
    version: ClassVar[int] = 1
    Options: ClassVar[type[CommonOptions]] = CommonOptions

    def __init__(self, tokenizer: ChatTokenizer, options: CommonOptions | None = None) -> None:
        self.options = options if options is not None else self.Options()
        self.prompts = PromptCache(tokenizer, self.options.prompt_cache)
        self.stats = FoldStats()
        self._episodes: dict[str, EpisodeTree] = {}
        self._attempts: dict[tuple[str, str], str] = {}
        """(actor id, task key) -> the open episode of that actor's latest delivery attempt."""
        self._ledger = Ledger(self.options.closed_memory)
        self.vocab_size = vocab_size_of(tokenizer)
        """Token ids must be below this (the tokenizer's vocabulary)."""

    @property
    def tag(self) -> str:
        """Name and version stamped on samples, e.g. ``leafe/1``."""
        return f"{self.name}/{self.version}"

    @property
    def limits(self) -> OpenLimits:
        """Caps on held episodes (none by default; the replayer sets them from its config)."""
        return self._ledger.limits

    @limits.setter
    def limits(self, value: OpenLimits) -> None:
        self._ledger.limits = value

    def describe(self) -> dict[str, Any]:
        """Name, version and resolved options (for manifests and logs)."""
        return {
            "name": self.name,
            "version": self.version,
            "options": msgspec.to_builtins(self.options),
        }

    @property
    def open_episodes(self) -> int:
        """Episodes with state in memory."""
        return len(self._episodes)

    @property
    def held_episodes(self) -> int:
        """Episodes started and not yet released (open, or closed but still needed, as GRPO
        members)."""
        return len(self._ledger.held)

    def is_open(self, episode_id: str) -> bool:
        """The episode has state in memory."""
        return episode_id in self._episodes

    def knows(self, episode_id: str) -> bool:
        """The episode is open or remembered as ended (finished, abandoned, ignored, refused or
        failed)."""
        return episode_id in self._episodes or episode_id in self._ledger.closed

    def readmit(self, episode_id: str) -> bool:
        """Forget that ``episode_id`` was refused (a cap was reached), so that its EpisodeStarted,
        published again by ``leafe replayer redrive``, is tried against the caps anew; ``False`` if
        it was not refused."""
        closed = self._ledger.closed.get(episode_id)
        if closed is None or closed.ending != "refused":
            return False
        del self._ledger.closed[episode_id]
        return True

    def apply(self, event: EpisodeEvent, *, now: float = 0.0) -> list[Sample]:
        """Fold one event; returns the samples it completed (see the module docstring for
        errors)."""
        self.stats.events += 1
        try:
            tree = self._episodes.get(event.episode_id)
            if tree is None:
                return self._apply_unknown(event, now)
            return self._apply_open(tree, event, now)
        except ReplayError:
            self.stats.rejected += 1
            raise
        except Exception as e:  # contained to its episode, reported with the cause
            self.stats.rejected += 1
            raise self._fail(event, e) from e

    def close_stale(self, now: float, timeout: float) -> list[Sample]:
        """Close episodes idle for more than ``timeout`` (abandoned by a crashed actor)."""
        stale = sorted(
            eid for eid, tree in self._episodes.items() if now - tree.last_active > timeout
        )
        out: list[Sample] = []
        for eid in stale:
            out += self._abandon(self._episodes[eid])
        return out + self._close_stale_extra(now, timeout)

    def close_all(self) -> list[Sample]:
        """End of the log: close every open episode as abandoned and drop incomplete work."""
        out: list[Sample] = []
        for eid in sorted(self._episodes):
            out += self._abandon(self._episodes[eid])
        return out + self._close_all_extra()

    def drain_released(self) -> list[str]:
        """Episodes closed since the last call whose events are no longer needed by any future
        sample."""
        return self._ledger.drain()

    def eligible(self, tree: EpisodeTree) -> bool:
        """The episode's mode and split produce samples, and its prompts can be rebuilt here."""
        return self._eligible_start(tree.started)

    def _eligible_start(self, s: EpisodeStarted) -> bool:
        return (
            s.mode in self.options.modes
            and s.split in self.options.splits
            and s.prompt_format == PROMPT_FORMAT
        )

    # -- hooks
    # ---------------------------------------------------------------------------------------
    def _on_started(self, tree: EpisodeTree) -> list[Sample]:
        return []

    def _on_outcome(self, tree: EpisodeTree, node: BranchNode) -> list[Sample]:
        return []

    def _on_finished(self, tree: EpisodeTree) -> list[Sample]:
        return []

    def _on_closed(self, tree: EpisodeTree, abandoned: bool) -> list[Sample]:
        self._release(tree.started.episode_id)
        return []

    def _close_stale_extra(self, now: float, timeout: float) -> list[Sample]:
        return []

    def _close_all_extra(self) -> list[Sample]:
        return []

    def _release(self, episode_id: str) -> None:
        """The episode's events will never be needed again (its anchor may be acked)."""
        self._ledger.release(episode_id)

    # -- lifecycle
    # -----------------------------------------------------------------------------------
    def _check_owner(self, event: EpisodeEvent, owner: str) -> None:
        """``event`` comes from ``owner``, the actor that started its episode, or
        :class:`ReplayError` (``foreign_episode``) naming both."""
        if owner and event.actor_id != owner:
            self.stats.foreign_events += 1
            raise ReplayError(
                event,
                f"episode {_shown(event.episode_id, 160)} belongs to actor {_shown(owner)}, which "
                f"started it; event from actor {_shown(event.actor_id)}",
                FOREIGN_EPISODE,
            )

    def _apply_open(self, tree: EpisodeTree, event: EpisodeEvent, now: float) -> list[Sample]:
        self._check_owner(event, tree.started.actor_id)
        try:
            if tree.is_duplicate(event):
                self.stats.duplicates += 1
                return []
        except ReplayError:
            self.stats.conflicts += 1
            raise
        if isinstance(event, (Step, Reflection)):
            self._check_tokens(event)
        if not self._ledger.limits.bounds_bytes:
            tree.add(event)
        else:
            size = event_bytes(event)
            over = self._ledger.over_bytes(size, event.actor_id)
            if over is not None:
                raise ReplayError(event, over.reason, over.code)
            tree.add(event)
            self._ledger.charge(event.episode_id, size, event.actor_id)
        if now > tree.last_active:
            tree.last_active = now
        if isinstance(event, Outcome):
            return self._on_outcome(tree, tree.branches[event.branch_id])
        if isinstance(event, EpisodeFinished):
            self.stats.episodes_finished += 1
            samples = self._on_finished(tree)
            return samples + self._close(tree, Closed("finished", event.seq))
        return []

    def _check_tokens(self, event: Step | Reflection) -> None:
        """Every token id of ``event`` is in the vocabulary, or :class:`ReplayError` naming one that
        is not."""
        ids, vocab = event.token_ids, self.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            bad = next(i for i in ids if not 0 <= i < vocab)
            raise ReplayError(event, f"token id {bad} is outside the vocabulary (0..{vocab - 1})")

    def _apply_unknown(self, event: EpisodeEvent, now: float) -> list[Sample]:
        closed = self._ledger.closed.get(event.episode_id)
        if closed is not None:
            return self._apply_closed(event, closed)
        if not isinstance(event, EpisodeStarted):
            raise ReplayError(event, "unknown episode: no EpisodeStarted was applied before it")
        if not self._eligible_start(event):
            return self._ignore(event)
        refusal = self._ledger.refusal(event)
        if refusal is not None:
            self.stats.episodes_refused += 1
            self._ledger.remember(
                event.episode_id,
                Closed("refused", reason=refusal.reason, code=refusal.code, owner=event.actor_id),
            )
            raise ReplayError(event, refusal.reason, refusal.code)
        opts = self.options
        tree = EpisodeTree.start(
            event, now, max_branches=opts.max_branches, max_events=opts.max_episode_events
        )
        superseded = self._supersede(event)
        self._episodes[event.episode_id] = tree
        self._attempts.setdefault(
            (event.actor_id, event.task_key), event.episode_id
        )  # (an older attempt never replaces)
        self._ledger.hold(event)
        self.stats.episodes_started += 1
        return superseded + self._on_started(tree)

    def _supersede(self, event: EpisodeStarted) -> list[Sample]:
        """Close the open earlier attempt of ``event``'s task by the same actor as abandoned: the
        task was delivered again, so that attempt will not finish here (its late events are ignored
        as stragglers). Another actor's attempt is left to finish or go stale: a task key in an
        EpisodeStarted is a claim any actor can write."""
        key = (event.actor_id, event.task_key)
        earlier = self._episodes.get(self._attempts.get(key, ""))
        if earlier is None or earlier.started.attempt >= event.attempt:
            return []
        del self._attempts[key]  # (closing it below would too; the new attempt takes its place)
        self.stats.episodes_superseded += 1
        log.info(
            "replay.episode.superseded",
            episode_id=earlier.started.episode_id[:80],
            by=event.episode_id[:80],
        )
        return self._abandon(earlier)

    def _apply_closed(self, event: EpisodeEvent, closed: Closed) -> list[Sample]:
        self._check_owner(event, closed.owner)
        match closed.ending:
            case "ignored":
                self.stats.ignored_events += 1
                return []
            case "refused" | "failed":
                raise ReplayError(
                    event, f"its episode was {closed.ending}: {closed.reason}", closed.code
                )
            case "finished" if closed.last_seq is not None and event.seq > closed.last_seq:
                raise ReplayError(
                    event, f"event after the episode's EpisodeFinished (seq {closed.last_seq})"
                )
        self.stats.after_close += 1  # a redelivery, or a straggler of an abandoned episode
        return []

    def _ignore(self, event: EpisodeStarted) -> list[Sample]:
        self.stats.episodes_ignored += 1
        if event.prompt_format != PROMPT_FORMAT:
            self.stats.unsupported_prompt_format += 1
            log.warning(
                "replay.episode.prompt_format",
                episode_id=event.episode_id,
                format=event.prompt_format[:80],
            )
        self._ledger.remember(event.episode_id, Closed("ignored", owner=event.actor_id))
        return []

    def _fail(self, event: EpisodeEvent, error: Exception) -> EpisodeFailed:
        """Drop ``event``'s episode after an unexpected exception; the error to raise."""
        reason = f"folding its episode raised {type(error).__name__}: {error}"[:400]
        self.stats.episodes_failed += 1
        tree = self._episodes.pop(event.episode_id, None)
        owner = tree.started.actor_id if tree is not None else event.actor_id
        self._ledger.remember(
            event.episode_id, Closed("failed", reason=reason, code="episode_failed", owner=owner)
        )
        log.error(
            "replay.episode.failed",
            episode_id=event.episode_id[:80],
            event_id=event.event_id[:80],
            reason=reason,
        )
        if tree is not None:
            try:
                self._on_closed(tree, True)
            except Exception as e:  # the episode is gone either way: say so
                log.error(
                    "replay.episode.close_failed",
                    episode_id=event.episode_id[:80],
                    error=repr(e)[:300],
                )
        self._release(event.episode_id)
        return EpisodeFailed(event, reason)

    def _abandon(self, tree: EpisodeTree) -> list[Sample]:
        self.stats.episodes_abandoned += 1
        open_branches = sorted(b for b, node in tree.branches.items() if node.outcome is None)
        log.info(
            "replay.episode.abandoned",
            episode_id=tree.started.episode_id,
            open_branches=open_branches[:20],
        )
        return self._close(tree, Closed("abandoned"))

    def _close(self, tree: EpisodeTree, closed: Closed) -> list[Sample]:
        eid, started = tree.started.episode_id, tree.started
        del self._episodes[eid]
        key = (started.actor_id, started.task_key)
        if self._attempts.get(key) == eid:
            del self._attempts[key]
        self._ledger.remember(eid, closed._replace(owner=started.actor_id))
        return self._on_closed(tree, closed.ending == "abandoned")
