"""Typed events of the LEAFE log (the `LEAFE_EVENTS` and `LEAFE_WEIGHTS` streams).

Every event is a frozen, kw_only msgspec Struct tagged by ``kind``. Episode events share
:class:`EpisodeEventBase`; ``WeightsPublished`` lives on its own stream. Rules that keep old logs
readable: fields are only ever *added*, and always with a default.

Where each event is produced and consumed (``explorer``, ``rollout`` and ``demo`` are in
``actors/``):

| event            | produced by              | consumed by                                      |
|------------------|--------------------------|--------------------------------------------------|
| EpisodeStarted   | explorer, rollout, demo  | learner/materializers, leafe log inspect         |
| Step             | explorer, rollout, demo  | learner/materializers (history + targets)        |
| Reflection       | explorer, demo           | learner/materializers (Branch provenance, sr)    |
| Rollback         | explorer, demo           | reports (replay cost)                            |
| Branch           | explorer, demo           | learner/materializers (counterfactuals, iwm, sr) |
| Outcome          | explorer, rollout, demo  | learner/materializers (emit samples)             |
| EpisodeFinished  | explorer, rollout, demo  | learner/materializers (close the episode)        |
| WeightsPublished | services/learner_service | services/weight_sync_service, actor_service      |

Branch geometry: the root branch is ``"b0"``. A branch ``b`` with parent ``p`` and rollback point
``tau`` shares ``p``'s steps ``0..tau-1``; its own steps start at ``t = tau``. ``h_t`` of any branch
is rebuilt from the log alone (see ``leafe.protocol.prompt``).

Demonstration episodes (mode ``demo``, ``actors/demo.py``): the root branch ``b0`` is the expert's
path, its Steps carry ``policy_version = "expert"`` (:data:`EXPERT_VERSION`). The Early Experience
baseline adds, after expert step ``t``, one-step branches off it: ``Reflection(b0, at_t=t+1, tau=t,
trigger="alternative")`` (the self-reflection text when one was asked for, else empty with
``source="none"``), ``Rollback(b0, tau=t)``, ``Branch(b_n, parent b0, tau=t, depth 1, experience
"")``, one ``Step(b_n, t)`` with the policy's alternative action and the observation it led to, and
its ``Outcome`` (``budget`` unless it solved or ended the task); after a state's alternatives,
``Rollback(b0, tau=t+1)`` puts the env back on the path.
"""

from __future__ import annotations

import secrets
from typing import Literal

import msgspec

__all__ = [
    "EXPERT_VERSION",
    "MSG_NONCE_HEX",
    "ROOT_BRANCH",
    "Branch",
    "EpisodeEvent",
    "EpisodeEventBase",
    "EpisodeFinished",
    "EpisodeStarted",
    "Mode",
    "Outcome",
    "OutcomeReason",
    "Reflection",
    "ReflectionSource",
    "ReflectionTrigger",
    "Rollback",
    "RollbackMethod",
    "Step",
    "WeightsPublished",
    "event_id_for",
    "new_msg_nonce",
]

ROOT_BRANCH = "b0"
"""Id of the first branch of every episode."""

Mode = Literal["explore", "rollout", "eval", "demo"]
"""How an episode was played: ``explore`` the LEAFE tree; ``rollout`` one plain sample (GRPO/RFT);
``eval`` one plain sample for Pass@k (never trained on); ``demo`` an expert demonstration of a train
task (the environment's solver, walkthrough, gold path or canonical solution), its steps written as
the policy would answer them, optionally with the policy's alternative actions off the expert path
(Early Experience)."""
ReflectionTrigger = Literal["periodic", "failure", "horizon", "alternative"]
"""Why a reflection happened; ``alternative``: an Early Experience branch point on a
demonstration."""
ReflectionSource = Literal["model", "oracle", "none"]
"""Who wrote tau and e: the policy (``model``), the environment's oracle (``oracle``, an ablation),
or nobody (``none``: an Early Experience branch point without self-reflection)."""

EXPERT_VERSION = "expert"
"""``policy_version`` of the events of a demonstration's expert steps (no weights produced them)."""
RollbackMethod = Literal["snapshot", "replay"]
OutcomeReason = Literal["success", "env_done", "horizon", "budget", "error"]


def event_id_for(episode_id: str, seq: int) -> str:
    """Deterministic event id ``<episode_id>.<seq:06d>`` (the episode id names its actor,
    ``leafe.protocol.tasks.episode_id_for``)."""
    return f"{episode_id}.{seq:06d}"


MSG_NONCE_HEX = 16
"""Hex digits of :attr:`EpisodeEventBase.msg_nonce` (64 bits from ``secrets``)."""


def new_msg_nonce() -> str:
    """A fresh :attr:`EpisodeEventBase.msg_nonce`."""
    return secrets.token_hex(MSG_NONCE_HEX // 2)


class EpisodeEventBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """Fields every episode event carries."""

    event_id: str
    """Deterministic id, ``<episode_id>.<seq:06d>``; with :attr:`msg_nonce`, the ``Nats-Msg-Id``."""
    run_id: str
    """Run this event belongs to (also the second token of the subject)."""
    episode_id: str
    """Episode id, unique per (task assignment, delivery attempt): a redelivered task gets a new
    one. ``<task_key>.a<attempt>@<actor>``: it names the actor that started the episode, the only
    one whose events it admits (``leafe.protocol.tasks``)."""
    actor_id: str
    """Actor process that produced the event."""
    seq: int
    """0-based position of this event within its episode (EpisodeStarted is 0)."""
    policy_version: str = "default"
    """Weight version of the engine that produced the event (SGLang's ``weight_version``)."""
    ts: float = 0.0
    """Wall-clock time of production, seconds since the Unix epoch. Never used for ordering."""
    msg_nonce: str = ""
    """Drawn by the publishing actor for this event (:func:`new_msg_nonce`); its ``Nats-Msg-Id`` is
    ``<event_id>:<msg_nonce>`` (``leafe.protocol.codec.message_id``), which a retried publish keeps
    and no other publisher can predict: JetStream dedupes ``Nats-Msg-Id`` stream-wide, so an id
    stored first by someone else would have this event dropped as a duplicate. Empty in logs
    written before it (their ``Nats-Msg-Id`` is the event id)."""


class EpisodeStarted(EpisodeEventBase, frozen=True, kw_only=True, tag="episode_started"):
    """An actor began an episode (explore tree, plain rollout or evaluation sample)."""

    task_key: str
    """Id of the task assignment message (``TaskAssignment.task_key``) this episode serves."""
    env: str
    """Environment registry name, e.g. ``sokoban``."""
    task_id: str
    """Environment-level task id (stable across runs), e.g. ``sokoban/train/00017``."""
    split: str
    """``train`` or ``test``."""
    seed: int
    """Sampling seed of the episode."""
    mode: Mode
    """``explore`` (LEAFE tree), ``rollout`` (plain sample for GRPO/RFT), ``eval`` or ``demo`` (see
    :data:`Mode`)."""
    task: str
    """Task text q shown to the agent."""
    observation: str
    """Initial observation o_0."""
    instructions: str
    """System prompt (action format, rules) the agent was given; part of every prompt."""
    prompt_format: str = "leafe-chat-v1"
    """Version of ``leafe.protocol.prompt`` used to render prompts for this episode."""
    history_window: int = 0
    """How many past (action, observation) pairs are shown in a prompt; 0 = all."""
    response_prefix: str = ""
    """Text prefilled at the start of every action answer (its tokens end the prompt; e.g.
    ``<action>``)."""
    group_id: str | None = None
    """Groups plain rollouts of one task for GRPO; ``None`` outside a group."""
    group_size: int = 1
    """Number of episodes in ``group_id``."""
    config_digest: str = ""
    """sha256 of the actor's resolved configuration (for provenance)."""
    attempt: int = 1
    """Delivery attempt of the task assignment (2+ means an earlier attempt was abandoned)."""


class Step(EpisodeEventBase, frozen=True, kw_only=True, tag="step"):
    """One policy action a_t on a branch and the environment's answer."""

    branch_id: str
    """Branch the step belongs to."""
    t: int
    """Step index within the branch's full history (inherited prefix included)."""
    action: str | None
    """Parsed, canonical action; ``None`` when the completion could not be parsed."""
    raw_text: str
    """The completion text as the engine returned it."""
    token_ids: list[int]
    """Exact completion token ids (SGLang ``output_ids``); the training target."""
    logprobs: list[float] | None = None
    """Behaviour log-probabilities of ``token_ids`` when the engine returned them."""
    observation: str
    """Observation o_{t+1} after the action."""
    reward: float = 0.0
    """Reward of this transition."""
    done: bool = False
    """The environment ended the episode on this step."""
    success: bool = False
    """The task is solved after this step."""
    feedback: str = ""
    """Environment feedback for the agent (e.g. "invalid action: ..."); empty when none."""
    parse_ok: bool = True
    """False when no valid action was found in ``raw_text`` (the step is an invalid action)."""
    experience_in_context: bool = False
    """Whether the branch's experience e was in the prompt of this step."""
    prompt_tokens: int = 0
    """Length of the prompt in tokens."""
    prompt_sha256: str = ""
    """sha256 of the prompt token ids sent to the engine (lets replay verify it rebuilt the
    prompt)."""
    cached_tokens: int | None = None
    """Prompt tokens the engine served from its prefix cache (``meta_info.cached_tokens``); ``None``
    where no engine answered (demonstrations) and in logs older than the field."""
    finish_reason: str = ""
    """Engine finish reason: ``stop``, ``length`` or ``abort``."""


class Reflection(EpisodeEventBase, frozen=True, kw_only=True, tag="reflection"):
    """The policy reflected on a branch and named the faulty step tau and an experience e."""

    branch_id: str
    """Branch reflected upon."""
    at_t: int
    """Length of the branch's history when reflecting (number of steps taken)."""
    trigger: ReflectionTrigger
    """Why: every K steps, on failure, or at the horizon."""
    tau: int
    """Step whose action was the mistake, after clamping to ``0..at_t-1``."""
    experience: str
    """Short diagnosis-and-fix instruction e (empty when it could not be parsed)."""
    raw_text: str
    """The reflection completion as the engine returned it."""
    token_ids: list[int] = msgspec.field(default_factory=list)
    """Exact completion token ids of the reflection."""
    parse_ok: bool = True
    """False when the tagged answer could not be fully parsed (see ``flags``)."""
    flags: list[str] = msgspec.field(default_factory=list)
    """Parse notes: ``tau_missing``, ``tau_clamped``, ``experience_missing``..."""
    source: ReflectionSource = "model"
    """Who wrote tau and e (``oracle`` marks the oracle-reflection ablation; see
    :data:`ReflectionSource`)."""
    oracle_tau: int | None = None
    """The oracle's tau for the same history (``ExplorerConfig.oracle_labels``: a label beside a
    model reflection, clamped like ``tau``); ``None`` when the oracle was not asked. The branch
    follows ``tau``."""
    oracle_experience: str = ""
    """The oracle's e for the same history (empty: not asked, or the oracle found no mistake)."""
    oracle_action: str = ""
    """The action the oracle's verdict names as the fix (its e's "do X instead"), whether the
    verdict is this reflection (``source = "oracle"``) or a label beside it; empty when the oracle
    was not asked, found no mistake or names no action. The ``follow`` materializer's target."""
    prompt_sha256: str = ""
    """sha256 of the reflection prompt's token ids sent to the engine
    (``leafe.protocol.prompt.prompt_sha256``; empty when no prompt was sent: oracle reflections,
    older logs)."""
    prompt_tokens: int = 0
    """Length of the reflection prompt in tokens (0 when no prompt was sent, and in older logs)."""
    cached_tokens: int | None = None
    """Prompt tokens of the reflection the engine served from its prefix cache (``None``: no prompt
    was sent, or a log older than the field)."""


class Rollback(EpisodeEventBase, frozen=True, kw_only=True, tag="rollback"):
    """The environment was returned to the state before step tau of ``from_branch``."""

    from_branch: str
    """Branch whose prefix was restored."""
    tau: int
    """Restored state is the one before action a_tau (after tau actions)."""
    method: RollbackMethod
    """``snapshot`` (state copy) or ``replay`` (reset + re-executing a_0..a_{tau-1})."""
    replay_steps: int = 0
    """Environment steps spent replaying (0 for snapshots)."""


class Branch(EpisodeEventBase, frozen=True, kw_only=True, tag="branch"):
    """A new branch opened at tau of its parent, with the reflection's experience in context."""

    branch_id: str
    """New branch id."""
    parent_branch_id: str
    """Branch whose steps ``0..tau-1`` the new one shares."""
    tau: int
    """First step index that belongs to the new branch."""
    reflection_event_id: str
    """Event id of the Reflection that produced e."""
    experience: str
    """The experience e put in context (copied from the Reflection for self-contained replay)."""
    depth: int
    """Depth in the exploration tree (root = 0)."""


class Outcome(EpisodeEventBase, frozen=True, kw_only=True, tag="outcome"):
    """A branch ended. Exactly one per branch."""

    branch_id: str
    """Branch that ended."""
    success: bool
    """The task was solved on this branch."""
    score: float = 0.0
    """Environment score (e.g. ScienceWorld points, fraction of tests passed)."""
    steps: int = 0
    """Length of the branch's full history (inherited prefix included)."""
    reason: OutcomeReason = "env_done"
    """Why the branch ended."""
    error: str = ""
    """Error text when ``reason == "error"``."""


class EpisodeFinished(EpisodeEventBase, frozen=True, kw_only=True, tag="episode_finished"):
    """The episode is complete: every branch has its Outcome. Its absence marks an abandoned
    episode."""

    success: bool
    """Any branch succeeded."""
    branches: int = 1
    """Number of branches in the tree."""
    actions: int = 0
    """Policy actions taken (the interaction budget spent), reflections excluded."""
    reflections: int = 0
    """Reflection calls made."""
    replay_steps: int = 0
    """Environment steps spent replaying prefixes for rollbacks."""
    parse_failures: int = 0
    """Completions that contained no valid action."""


EpisodeEvent = EpisodeStarted | Step | Reflection | Rollback | Branch | Outcome | EpisodeFinished
"""Everything on the events stream."""


class WeightsPublished(
    msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag="weights_published"
):
    """The learner exported a new weight version (on the ``LEAFE_WEIGHTS`` stream)."""

    event_id: str
    """Deterministic id ``weights.<version>``."""
    run_id: str
    """Run id."""
    version: str
    """New weight version, e.g. ``v000012``; engines report it as ``weight_version``."""
    uri: str
    """Directory (local path or mounted volume) of the HF safetensors export."""
    manifest_sha256: str
    """sha256 of the export's ``manifest.json`` (which lists every file's sha256)."""
    learner_step: int
    """Optimizer step that produced the weights."""
    base_model: str
    """Model the run started from."""
    samples_seq: int = 0
    """Last samples-stream sequence trained on before the export."""
    ts: float = 0.0
    """Wall-clock time of the export."""
