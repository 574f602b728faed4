"""Hand-built explore episodes for the materializer tests: :class:`Tree` emits one episode event by
event with exact prompt digests (fake byte tokenizer), :func:`fold` runs a materializer over it."""

from __future__ import annotations

from typing import Any

from leafe.actors.fake_episodes import INSTRUCTIONS, EventWriter
from leafe.actors.fakes import ByteChatTokenizer
from leafe.learner.materializers import make_materializer
from leafe.protocol.events import (
    Branch,
    EpisodeEvent,
    EpisodeFinished,
    EpisodeStarted,
    Outcome,
    Reflection,
    Rollback,
    Step,
)
from leafe.protocol.prompt import HistoryEntry, prompt_sha256, render_messages
from leafe.protocol.samples import Sample

__all__ = ["TOK", "E", "Tree", "fold"]

TOK = ByteChatTokenizer()
E = "EXPERIENCE#1: push the box left first"


class Tree:
    """Builds one explore episode event by event, with exact prompt digests."""

    def __init__(
        self, episode_id: str = "ep1", *, actor_id: str = "actor-0", **started: Any
    ) -> None:
        # ids as given (folded in memory, never admitted): the tests name episodes by them
        self.w = EventWriter("r1", episode_id, actor_id=actor_id, legacy=True)
        fields = dict(
            task_key=f"{episode_id}-task",
            env="sokoban",
            task_id="sokoban/train/00001",
            split="train",
            seed=0,
            mode="explore",
            task="Push the box.",
            observation="o0",
            instructions=INSTRUCTIONS,
        )
        fields.update(started)
        self.started = self.w.emit(EpisodeStarted, **fields)
        self.paths: dict[str, list[Step]] = {"b0": []}
        self.experience: dict[str, str] = {"b0": ""}

    def step(
        self, branch: str, action: str | None = "up", *, with_e: bool = False, **kw: Any
    ) -> Step:
        path = self.paths[branch]
        t = len(path)
        e = self.experience[branch] if with_e else None
        messages = render_messages(
            instructions=self.started.instructions,
            task=self.started.task,
            history=[HistoryEntry(s.action, s.raw_text, s.observation, s.feedback) for s in path],
            observation=path[-1].observation if path else self.started.observation,
            experience=e,
            history_window=self.started.history_window,
        )
        fields = dict(
            branch_id=branch,
            t=t,
            action=action,
            raw_text=f"<action>{action}</action>",
            token_ids=[100 + t, 200 + len(self.paths)],
            observation=f"o{t + 1}-{branch}",
            experience_in_context=with_e,
            prompt_sha256=prompt_sha256(TOK.encode_chat(messages)),
            parse_ok=action is not None,
        )
        fields.update(kw)
        s = self.w.emit(Step, **fields)
        path.append(s)
        return s

    def branch(
        self, parent: str, tau: int, new: str, experience: str = E
    ) -> tuple[Reflection, Branch]:
        refl = self.w.emit(
            Reflection,
            branch_id=parent,
            at_t=len(self.paths[parent]),
            trigger="failure",
            tau=tau,
            experience=experience,
            raw_text="r",
        )
        self.w.emit(Rollback, from_branch=parent, tau=tau, method="snapshot")
        br = self.w.emit(
            Branch,
            branch_id=new,
            parent_branch_id=parent,
            tau=tau,
            reflection_event_id=refl.event_id,
            experience=experience,
            depth=1,
        )
        self.paths[new] = list(self.paths[parent][:tau])
        self.experience[new] = experience
        return refl, br

    def outcome(self, branch: str, success: bool) -> Outcome:
        return self.w.emit(
            Outcome, branch_id=branch, success=success, steps=len(self.paths[branch])
        )

    def finish(self) -> EpisodeFinished:
        return self.w.emit(EpisodeFinished, success=True)

    @property
    def events(self) -> list[EpisodeEvent]:
        return list(self.w.events)


def fold(
    events: list[EpisodeEvent], name: str = "leafe", **options: Any
) -> tuple[list[Sample], Any]:
    m = make_materializer(name, TOK, **options)
    out: list[Sample] = []
    for e in events:
        out += m.apply(e)
    return out + m.close_all(), m
