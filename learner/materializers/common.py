"""What every materializer shares besides the fold itself: options, counters, ids and the prompt
cache.

``sample_id_for`` hashes the materializer tag, the sample kind and the sorted source event ids, so
the sample *set* does not depend on how episodes interleave. ``selected_fraction`` is a seeded,
order-independent coin. :class:`PromptCache` tokenizes chat prompts once for cf, rehearsal and
verification.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from leafe.protocol.prompt import ChatTokenizer
from leafe.protocol.samples import ChatMessage

__all__ = [
    "CommonOptions",
    "FoldStats",
    "PromptCache",
    "fast_prompt_sha256",
    "sample_id_for",
    "selected_fraction",
    "vocab_size_of",
]

MAX_TOKEN_ID = 2**31 - 1
"""Largest id any tokenizer may give (int32, what the learner's tensors hold): the bound of a
tokenizer that does not say its vocabulary size."""


class CommonOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options every materializer accepts."""

    modes: list[str] = msgspec.field(default_factory=lambda: ["explore"])
    """Episode modes that produce samples (``eval`` episodes should never be trained on)."""
    splits: list[str] = msgspec.field(default_factory=lambda: ["train"])
    """Task splits that produce samples."""
    skip_unparsed_targets: bool = True
    """Never train on a completion whose action could not be parsed (``Step.parse_ok`` False)."""
    verify_prompts: bool = True
    """Rebuild the exact prompt each target step was sent and compare it with
    ``Step.prompt_sha256``."""
    closed_memory: int = 100_000
    """How many closed episode ids are remembered so that late duplicates are ignored, not
    rejected."""
    prompt_cache: int = 4096
    """Entries of the tokenized-prompt LRU cache (cf, rehearsal and verification share prompts)."""
    max_branches: int = 2048
    """Branches one episode may open (real trees have tens); a Branch past it is rejected. Bounds
    the cost of rebuilding a path (proportional to the branch's depth) and the episode's state."""
    max_episode_events: int = 32_768
    """Events one episode may hold (real episodes have hundreds); an event past it is rejected."""


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
    episodes_superseded: int = 0
    """Of the abandoned: closed when a later delivery attempt of the same task started."""
    samples: dict[str, int] = field(default_factory=dict)
    prompts_verified: int = 0
    prompt_mismatches: int = 0
    prompts_unverifiable: int = 0
    skipped_unparsed: int = 0
    skipped_empty: int = 0
    skipped_no_target: int = 0
    skipped_repeated_action: int = 0
    """Counterfactuals dropped because the branch repeated the blamed action
    (``cf_drop_repeated_action``)."""
    groups_emitted: int = 0
    groups_zero_variance: int = 0
    groups_dropped: int = 0
    late_attempts: int = 0
    group_outsiders: int = 0
    unsupported_prompt_format: int = 0
    episodes_ignored: int = 0
    """Episodes whose mode, split or prompt format gives no samples: they hold no state."""
    ignored_events: int = 0
    """Events of those episodes (dropped on arrival)."""
    episodes_refused: int = 0
    """EpisodeStarted refused because too many episodes were open (``OpenLimits``)."""
    episodes_failed: int = 0
    """Episodes dropped because folding them raised (the reason is in the ``EpisodeFailed``)."""
    conflicts: int = 0
    """Events whose id was already applied with different content (the first copy wins)."""
    foreign_events: int = 0
    """Events of an episode that another actor started (rejected, ``foreign_episode``)."""
    reflections: dict[str, int] = field(default_factory=dict)
    """The ``reflect`` materializer's counts: reflections ``seen`` (at their branch's Outcome),
    without an oracle verdict (``unlabelled``), the oracle found no mistake (``no_mistake``), on a
    branch that succeeded (``branch_succeeded``, with ``only_failed_branches``), ``unrenderable``,
    ``unformattable``, and ``samples``."""
    follow: dict[str, int] = field(default_factory=dict)
    """The ``follow`` materializer's counts: reflections passed over (no verdict naming an action:
    ``no_named_action``; ``unrenderable``; the same prompt again: ``duplicate_prompt``), verdicts
    ``seen``, ``unformattable`` and ``samples``."""
    builders: dict[str, int] = field(default_factory=dict)
    """The fair rows' builders' counts (``dagger``, ``reh-own``, ``self-taught``;
    ``learner/materializers/fair.py``), as ``<builder>.<what>``."""

    def as_dict(self) -> dict[str, object]:
        """Plain dict (sorted sample counts) for logs and manifests."""
        out: dict[str, object] = dict(self.__dict__)
        out["samples"] = dict(sorted(self.samples.items()))
        out["reflections"] = dict(sorted(self.reflections.items()))
        out["follow"] = dict(sorted(self.follow.items()))
        out["builders"] = dict(sorted(self.builders.items()))
        return out


def vocab_size_of(tokenizer: ChatTokenizer) -> int:
    """The tokenizer's ``vocab_size`` (ids are ``0..vocab_size-1``), or ``MAX_TOKEN_ID + 1`` when it
    has none."""
    size = getattr(tokenizer, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else MAX_TOKEN_ID + 1


def fast_prompt_sha256(token_ids: Sequence[int]) -> str:
    """:func:`leafe.protocol.prompt.prompt_sha256` (4-byte little-endian per id), packed in one
    call."""
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
