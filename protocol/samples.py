"""Training samples: what materializers (``learner/materializers``) fold out of the event log.

Published on ``LEAFE_SAMPLES`` by ``leafe replayer`` and written as JSONL shards by ``leafe
replay``; consumed by the learner. A sample is chat-formatted (``messages`` + the index of the
trained assistant turn) and carries the exact token ids, so TRL/``datasets`` users can load the
shards directly.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["ChatMessage", "Sample", "SampleKind"]

SampleKind = Literal["cf", "reh", "rft", "grpo", "sft", "iwm", "sr"]
"""``cf``/``reh`` LEAFE, ``rft``, ``grpo``; ``sft`` a demonstration step; ``iwm`` implicit world
modelling (state + alternative action -> its observation); ``sr`` self-reflection (state -> why +
expert action)."""


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    """One chat turn."""

    role: Literal["system", "user", "assistant"]
    """Speaker."""
    content: str
    """Text of the turn."""


class Sample(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind_tag", tag="sample"):
    """One (prompt, completion) pair with its training weight and provenance."""

    sample_id: str
    """sha256 over the source event ids and the materializer version (``Nats-Msg-Id``)."""
    run_id: str
    """Run of the source events."""
    kind: SampleKind
    """``cf`` counterfactual, ``reh`` rehearsal, ``rft`` rejection-sampling SFT, ``grpo`` policy
    gradient, ``sft``/``iwm``/``sr`` demonstrations and the Early Experience baseline (see
    :data:`SampleKind`)."""
    materializer: str
    """Name and version of the materializer, e.g. ``leafe/1``."""
    env: str
    """Environment name."""
    task_id: str
    """Environment task id."""
    episode_id: str
    """Source episode."""
    messages: list[ChatMessage]
    """Chat: system, user(s) and the assistant target turn."""
    target_turn: int
    """Index in ``messages`` of the assistant turn that is trained."""
    prompt_ids: list[int]
    """Exact prompt token ids (chat template applied, generation prompt included)."""
    completion_ids: list[int]
    """Exact target token ids (the engine's ``output_ids``); the only tokens with loss."""
    policy_version: str
    """Weight version that produced the target."""
    weight: float = 1.0
    """Loss weight of this sample."""
    source_event_ids: list[str] = msgspec.field(default_factory=list)
    """Event ids the sample was built from (provenance)."""
    advantage: float | None = None
    """GRPO: group-normalised advantage of the trajectory; ``None`` for SFT kinds."""
    reward: float | None = None
    """GRPO/RFT: the trajectory's return."""
    behaviour_logprobs: list[float] | None = None
    """GRPO: logprobs of ``completion_ids`` under the behaviour policy, when recorded."""
    group_id: str | None = None
    """GRPO: group the trajectory belongs to."""
