"""``leafe log inspect``'s engine table: what the engine was asked for, by kind, from the events
alone."""

from __future__ import annotations

import json

import msgspec
import pytest

from leafe.actors.config import ExplorerConfig
from leafe.actors.episode import EpisodeSpec, ListSink
from leafe.actors.explorer import Explorer
from leafe.actors.fakes import ByteChatTokenizer, CorridorEnv, ScriptedEngine
from leafe.protocol.events import EpisodeEvent, EpisodeStarted, Reflection, Step
from leafe.services.eventlog.fileformat import record_for
from leafe.services.eventlog.inspect import render, summarize

RIGHT, LEFT = "<action>right</action>", "<action>left</action>"


async def tree() -> list[EpisodeEvent]:
    """One corridor tree: the root falls into the pit, a model reflection, a branch that
    succeeds."""
    engine = ScriptedEngine(
        actions=[RIGHT, LEFT, LEFT, RIGHT, RIGHT, RIGHT],
        reflections=["<step>1</step><experience>right, not left</experience>"],
    )
    spec = EpisodeSpec(
        run_id="r1",
        episode_id="ep1",
        actor_id="a0",
        task_key="t1",
        env="corridor",
        task_id="corridor/train/00001",
    )
    sink = ListSink()
    cfg = ExplorerConfig(k=0, max_depth=2, horizon=6)
    explorer = Explorer(
        engine=engine,
        tokenizer=ByteChatTokenizer(),
        env=CorridorEnv(),
        config=cfg,
        sink=sink,
        spec=spec,
    )
    await explorer.run()
    return list(sink.events)


def as_episode(events: list[EpisodeEvent], episode_id: str, mode: str) -> list[EpisodeEvent]:
    out = []
    for e in events:
        e = msgspec.structs.replace(e, episode_id=episode_id, event_id=f"{episode_id}.{e.seq:06d}")
        out.append(msgspec.structs.replace(e, mode=mode) if isinstance(e, EpisodeStarted) else e)
    return out


def as_oracle(e: EpisodeEvent) -> EpisodeEvent:
    if not isinstance(e, Reflection):
        return e
    return msgspec.structs.replace(
        e, source="oracle", token_ids=[], prompt_sha256="", prompt_tokens=0, cached_tokens=None
    )


def sums(events: list[EpisodeEvent], keep: object) -> dict[str, int]:
    chosen = [e for e in events if isinstance(e, Step | Reflection) and keep(e)]  # type: ignore[operator]
    return {
        "requests": len(chosen),
        "prompt_tokens": sum(e.prompt_tokens for e in chosen),
        "cached_tokens": sum(e.cached_tokens or 0 for e in chosen),
        "output_tokens": sum(len(e.token_ids) for e in chosen),
        "unrecorded": sum(e.cached_tokens is None for e in chosen),
    }


@pytest.mark.anyio
async def test_engine_requests_by_kind_skip_the_experts_steps_and_the_oracles_reflections(
    capsys: pytest.CaptureFixture[str],
) -> None:
    explored = await tree()
    demo = as_episode(
        explored, "ep2", "demo"
    )  # its root steps stand for the expert's: no engine request
    oracle = [as_oracle(e) for e in as_episode(explored, "ep3", "explore")]
    log = explored + demo + oracle
    summary, _ = summarize(record_for(e, i + 1) for i, e in enumerate(log))

    def root(e: Step | Reflection) -> bool:
        return isinstance(e, Step) and e.branch_id == "b0"

    def branch(e: Step | Reflection) -> bool:
        return isinstance(e, Step) and e.branch_id != "b0"

    def model(e: Step | Reflection) -> bool:
        return isinstance(e, Reflection) and e.source == "model"

    got = {kind: msgspec.structs.asdict(u) for kind, u in summary.engine.items()}
    assert got == {
        "root_step": sums(explored + oracle, root),
        "branch_step": sums(log, branch),
        "reflection": sums(explored + demo, model),
    }
    assert got["reflection"]["requests"] == 2 and got["reflection"]["prompt_tokens"] > 0
    assert got["branch_step"]["cached_tokens"] > 0  # the branch's prompt begins like its parent's

    capsys.readouterr()  # the explorer's log lines
    render(summary, [], as_json=True)
    doc = json.loads(capsys.readouterr().out)
    share = doc["engine"]["branch_step"]["cache_share"]
    assert share == pytest.approx(
        got["branch_step"]["cached_tokens"] / got["branch_step"]["prompt_tokens"]
    )
    render(summary, [])
    assert "engine requests" in capsys.readouterr().out


@pytest.mark.anyio
async def test_a_log_older_than_the_cached_counts_has_an_unknown_share_not_zero() -> None:
    old = [
        msgspec.structs.replace(e, cached_tokens=None) if isinstance(e, Step) else e
        for e in await tree()
    ]
    summary, _ = summarize(record_for(e, i + 1) for i, e in enumerate(old))
    usage = summary.engine["root_step"]
    assert usage.unrecorded == usage.requests > 0 and usage.cache_share is None
    assert summary.engine["reflection"].cache_share is not None
