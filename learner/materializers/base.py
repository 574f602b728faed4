"""The fold interface every materializer implements, and how a sample is built from an episode tree.

A materializer turns the event log into training samples as a pure fold: ``samples = m.apply(event)``
updates explicit in-memory state (one :class:`~learner.materializers.tree.EpisodeTree` per open
episode) and returns the samples that event completed. No I/O happens here; ``services/replayer.py``
(online) and ``services/replay.py`` (offline) feed it events and ship what it returns. Subclasses
(``leafe``, ``grpo``, ``rft``) only decide *which* steps become samples, through the hooks
``_on_started``, ``_on_outcome``, ``_on_finished`` and ``_on_closed``.

Contract with the actors: the prompt of step ``t`` on a branch's path is
``render_messages(instructions, task, history=path[:t], observation=o_t, experience=e of the step's branch
if Step.experience_in_context, history_window)`` tokenized by the same :class:`ChatTokenizer`; its
digest is ``Step.prompt_sha256``. Every target is checked against it (``verify_prompts``): a mismatch is
logged with context and counted in :class:`FoldStats`, never fatal.

Lifecycle: an episode's state is dropped at ``EpisodeFinished``; an abandoned one (no ``EpisodeFinished``)
is closed by :meth:`Materializer.close_stale` (online, by idle time) or :meth:`Materializer.close_all`
(end of an offline log), and closing never produces samples from a branch without ``Outcome``. Closed
episode ids are remembered (bounded) with their ``EpisodeFinished`` seq: late duplicates (seq at or below
it, or anything of an abandoned episode) are ignored, a new event past the end marker is rejected like any
other malformed event. :meth:`Materializer.drain_released`
lists the episodes whose events will never be needed again (the replayer acks their anchors then).

Sample ids hash the materializer tag, the kind and the sorted source event ids, so the sample *set* does
not depend on how episodes interleave, and replaying a log twice gives the same samples.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
import structlog

from learner.materializers.tree import BranchNode, EpisodeTree, ReplayError, history_entry
from protocol.events import EpisodeEvent, EpisodeFinished, EpisodeStarted, Outcome, Step
from protocol.prompt import PROMPT_FORMAT, ChatTokenizer, HistoryEntry, render_messages
from protocol.samples import ChatMessage, Sample, SampleKind

__all__ = [
    "CommonOptions",
    "FoldStats",
    "Materializer",
    "PromptCache",
    "ReplayError",
    "fast_prompt_sha256",
    "path_entries",
    "sample_id_for",
    "selected_fraction",
]

log = structlog.get_logger("learner.materializers")


class CommonOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options every materializer accepts."""

    modes: list[str] = msgspec.field(default_factory=lambda: ["explore"])
    """Episode modes that produce samples (``eval`` episodes should never be trained on)."""
    splits: list[str] = msgspec.field(default_factory=lambda: ["train"])
    """Task splits that produce samples."""
    skip_unparsed_targets: bool = True
    """Never train on a completion whose action could not be parsed (``Step.parse_ok`` False)."""
    verify_prompts: bool = True
    """Rebuild the exact prompt each target step was sent and compare it with ``Step.prompt_sha256``."""
    closed_memory: int = 100_000
    """How many closed episode ids are remembered so that late duplicates are ignored, not rejected."""
    prompt_cache: int = 4096
    """Entries of the tokenized-prompt LRU cache (cf, rehearsal and verification share prompts)."""


@dataclass
class FoldStats:
    """Counters of one fold; the replayer exports them and the dataset manifest records them."""

    events: int = 0
    duplicates: int = 0
    after_close: int = 0
    rejected: int = 0
    episodes_started: int = 0
    episodes_finished: int = 0
    episodes_abandoned: int = 0
    samples: dict[str, int] = field(default_factory=dict)
    prompts_verified: int = 0
    prompt_mismatches: int = 0
    prompts_unverifiable: int = 0
    skipped_unparsed: int = 0
    skipped_empty: int = 0
    skipped_no_target: int = 0
    groups_emitted: int = 0
    groups_zero_variance: int = 0
    groups_dropped: int = 0
    late_attempts: int = 0
    group_outsiders: int = 0
    unsupported_prompt_format: int = 0

    def as_dict(self) -> dict[str, object]:
        """Plain dict (sorted sample counts) for logs and manifests."""
        out: dict[str, object] = dict(self.__dict__)
        out["samples"] = dict(sorted(self.samples.items()))
        return out


def fast_prompt_sha256(token_ids: Sequence[int]) -> str:
    """:func:`protocol.prompt.prompt_sha256` (4-byte little-endian per id), packed in one call."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}I", *token_ids)).hexdigest()


def sample_id_for(materializer: str, kind: str, source_event_ids: Sequence[str]) -> str:
    """sha256 over the materializer tag, the sample kind and the sorted source event ids."""
    h = hashlib.sha256(f"{materializer}\n{kind}\n".encode())
    h.update("\n".join(sorted(source_event_ids)).encode())
    return h.hexdigest()


def selected_fraction(seed: int, key: str, fraction: float) -> bool:
    """Seeded, order-independent Bernoulli(fraction) decision for ``key``."""
    if fraction >= 1.0:
        return True
    if fraction <= 0.0:
        return False
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2.0**64


class PromptCache:
    """Tokenizes chat prompts through a :class:`ChatTokenizer`, with a small LRU cache."""

    def __init__(self, tokenizer: ChatTokenizer, size: int = 4096) -> None:
        self.tokenizer = tokenizer
        self.size = size
        self._cache: OrderedDict[tuple[str, ...], list[int]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def encode(self, messages: Sequence[ChatMessage], response_prefix: str = "") -> list[int]:
        """Token ids of ``messages`` (generation prompt and the prefilled answer start included)."""
        key = (response_prefix, *(part for m in messages for part in (m.role, m.content)))
        ids = self._cache.get(key)
        if ids is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return ids
        self.misses += 1
        ids = self.tokenizer.encode_chat(messages, response_prefix)
        self._cache[key] = ids
        if len(self._cache) > self.size:
            self._cache.popitem(last=False)
        return ids


class Materializer:
    """Base fold: validates events into episode trees and calls the subclass hooks.

    ``apply(event, now=...)`` returns the samples completed by ``event`` (raises :class:`ReplayError` for
    bad input, state unchanged); ``now`` is the caller's clock, used only by :meth:`close_stale`.
    """

    name: ClassVar[str] = "base"
    version: ClassVar[int] = 1
    Options: ClassVar[type[CommonOptions]] = CommonOptions

    def __init__(self, tokenizer: ChatTokenizer, options: CommonOptions | None = None) -> None:
        self.options = options if options is not None else self.Options()
        self.prompts = PromptCache(tokenizer, self.options.prompt_cache)
        self.stats = FoldStats()
        self._episodes: dict[str, EpisodeTree] = {}
        self._closed: OrderedDict[str, int | None] = OrderedDict()
        """Recently closed episodes -> the seq of their EpisodeFinished (None when abandoned)."""
        self._released: list[str] = []

    @property
    def tag(self) -> str:
        """Name and version stamped on samples, e.g. ``leafe/1``."""
        return f"{self.name}/{self.version}"

    def describe(self) -> dict[str, Any]:
        """Name, version and resolved options (for manifests and logs)."""
        return {"name": self.name, "version": self.version, "options": msgspec.to_builtins(self.options)}

    @property
    def open_episodes(self) -> int:
        """Episodes with state in memory."""
        return len(self._episodes)

    def is_open(self, episode_id: str) -> bool:
        """The episode has state in memory."""
        return episode_id in self._episodes

    def knows(self, episode_id: str) -> bool:
        """The episode is open or was closed recently (its events are applied or ignored, not rejected)."""
        return episode_id in self._episodes or episode_id in self._closed

    def apply(self, event: EpisodeEvent, *, now: float = 0.0) -> list[Sample]:
        """Fold one event; returns the samples it completed."""
        self.stats.events += 1
        tree = self._episodes.get(event.episode_id)
        if tree is None:
            return self._apply_unknown(event, now)
        if event.event_id in tree.seen:
            self.stats.duplicates += 1
            return []
        try:
            tree.add(event)
        except ReplayError:
            self.stats.rejected += 1
            raise
        if now > tree.last_active:
            tree.last_active = now
        if isinstance(event, Outcome):
            node = tree.branches[event.branch_id]
            return self._on_outcome(tree, node) if self.eligible(tree) else []
        if isinstance(event, EpisodeFinished):
            self.stats.episodes_finished += 1
            samples = self._on_finished(tree) if self.eligible(tree) else []
            return samples + self._close(tree, abandoned=False)
        return []

    def close_stale(self, now: float, timeout: float) -> list[Sample]:
        """Close episodes idle for more than ``timeout`` (abandoned by a crashed actor)."""
        stale = sorted(eid for eid, tree in self._episodes.items() if now - tree.last_active > timeout)
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
        """Episodes closed since the last call whose events are no longer needed by any future sample."""
        out, self._released = self._released, []
        return out

    def eligible(self, tree: EpisodeTree) -> bool:
        """The episode's mode and split produce samples, and its prompts can be rebuilt here."""
        s = tree.started
        return (
            s.mode in self.options.modes
            and s.split in self.options.splits
            and s.prompt_format == PROMPT_FORMAT
        )

    # -- hooks ---------------------------------------------------------------------------------------
    def _on_started(self, tree: EpisodeTree) -> list[Sample]:
        return []

    def _on_outcome(self, tree: EpisodeTree, node: BranchNode) -> list[Sample]:
        return []

    def _on_finished(self, tree: EpisodeTree) -> list[Sample]:
        return []

    def _on_closed(self, tree: EpisodeTree, abandoned: bool) -> list[Sample]:
        self._released.append(tree.started.episode_id)
        return []

    def _close_stale_extra(self, now: float, timeout: float) -> list[Sample]:
        return []

    def _close_all_extra(self) -> list[Sample]:
        return []

    # -- lifecycle -----------------------------------------------------------------------------------
    def _apply_unknown(self, event: EpisodeEvent, now: float) -> list[Sample]:
        if event.episode_id in self._closed:
            last = self._closed[event.episode_id]
            if last is not None and event.seq > last:
                self.stats.rejected += 1
                raise ReplayError(event, f"event after the episode's EpisodeFinished (seq {last})")
            self.stats.after_close += 1  # a redelivery, or a straggler of an abandoned episode
            return []
        if not isinstance(event, EpisodeStarted):
            self.stats.rejected += 1
            raise ReplayError(event, "unknown episode: no EpisodeStarted was applied before it")
        tree = EpisodeTree.start(event, now)
        self._episodes[event.episode_id] = tree
        self.stats.episodes_started += 1
        if event.prompt_format != PROMPT_FORMAT:
            self.stats.unsupported_prompt_format += 1
            log.warning(
                "replay.episode.prompt_format", episode_id=event.episode_id, format=event.prompt_format
            )
        return self._on_started(tree)

    def _abandon(self, tree: EpisodeTree) -> list[Sample]:
        self.stats.episodes_abandoned += 1
        open_branches = sorted(b for b, node in tree.branches.items() if node.outcome is None)
        log.info("replay.episode.abandoned", episode_id=tree.started.episode_id, open_branches=open_branches)
        return self._close(tree, abandoned=True)

    def _close(self, tree: EpisodeTree, *, abandoned: bool) -> list[Sample]:
        eid = tree.started.episode_id
        del self._episodes[eid]
        self._closed[eid] = tree.finished.seq if tree.finished is not None and not abandoned else None
        while len(self._closed) > self.options.closed_memory:
            self._closed.popitem(last=False)
        return self._on_closed(tree, abandoned)

    # -- building samples ----------------------------------------------------------------------------
    def render(
        self, tree: EpisodeTree, history: Sequence[HistoryEntry], observation: str, experience: str | None
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
        """Sample whose target is ``path[t]`` and whose input is ``q + h_t``, or ``None`` when skipped.

        The training prompt carries no experience unless ``keep_experience`` (GRPO trains on the exact
        behaviour prompt). ``entries[i]`` is the history entry of ``path[i]`` (at least ``t`` of them).
        Deduplicated within the episode by sample id; tokenizes only what is emitted.
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
                else self.prompts.encode(self.render(tree, entries[:t], observation, sent_e), prefix)
            )
            self._verify(tree, target, sent_ids)
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
            messages=[*messages, ChatMessage(role="assistant", content=prefix + target.raw_text)],
            target_turn=len(messages),
            prompt_ids=prompt_ids,
            completion_ids=target.token_ids,
            policy_version=target.policy_version,
            weight=weight,
            source_event_ids=sorted(source_event_ids),
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
