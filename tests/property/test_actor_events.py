"""Hypothesis over the actor's emitted event streams: random completions, reflections and budgets.

Whatever the policy says and however the tree is configured, the stream is well formed (every Branch
names an earlier Reflection of its parent and a tau inside the parent's path, every branch has
exactly one Outcome, counts add up), and the prompt of every Step, rebuilt from the events alone, is
byte-for-byte the prompt the engine received (and hashes to the recorded ``prompt_sha256``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leafe.actors.config import ExplorerConfig
from leafe.actors.episode import EpisodeSpec, ListSink
from leafe.actors.explorer import Explorer
from leafe.actors.fakes import ByteChatTokenizer, CorridorEnv, ScriptedEngine
from leafe.protocol.events import Branch, Step
from leafe.protocol.prompt import ChatTokenizer, prompt_sha256
from tests.support.event_checks import check_episode, path_of, rebuild_step_prompts

ACTION_TEXTS = [
    "<action>left</action>",
    "<action>right</action>",
    "<action>wait</action>",
    "I would go right.",
    "left or right? right",
    "<action>jump</action>",
    "",
    "no idea",
]
EXPERIENCES = ["go right", "wait first", "the pit is on the left", "", "  "]

reflection_texts = st.one_of(
    st.builds(
        lambda tau, e: f"<step>{tau}</step><experience>{e}</experience>",
        st.integers(min_value=-3, max_value=25),
        st.sampled_from(EXPERIENCES),
    ),
    st.builds(
        lambda tau: f"I think step {tau} was wrong; go right.",
        st.integers(min_value=0, max_value=9),
    ),
    st.sampled_from(["", "garbage", "<step>x</step>"]),
)

configs = st.fixed_dictionaries(
    {
        "k": st.integers(min_value=0, max_value=4),
        "max_depth": st.integers(min_value=0, max_value=3),
        "max_branches": st.integers(min_value=1, max_value=6),
        "max_actions": st.integers(min_value=1, max_value=30),
        "horizon": st.integers(min_value=1, max_value=8),
        "history_window": st.integers(min_value=0, max_value=3),
        "experience_scope": st.sampled_from(["first_step", "branch"]),
        "stop_on_first_success": st.booleans(),
    }
)


class Cycling:
    """Answers from two fixed lists in turn (so a drawn script fits any tree size)."""

    def __init__(self, actions: list[str], reflections: list[str]) -> None:
        self.actions, self.reflections = actions, reflections
        self.i = self.j = 0

    def __call__(self, kind: str, prompt: str) -> str:
        if kind == "reflection":
            self.j += 1
            return self.reflections[(self.j - 1) % len(self.reflections)]
        self.i += 1
        return self.actions[(self.i - 1) % len(self.actions)]


def run_episode(
    cfg: dict[str, Any],
    actions: list[str],
    reflections: list[str],
    snapshots: bool,
    tokenizer: ChatTokenizer,
) -> tuple[list, ScriptedEngine, CorridorEnv]:
    engine = ScriptedEngine(script=Cycling(actions, reflections), tokenizer=tokenizer)
    env = CorridorEnv(supports_snapshot=snapshots)
    sink = ListSink()
    spec = EpisodeSpec(
        run_id="prop",
        episode_id="t.a1",
        actor_id="a",
        task_key="t",
        env="corridor",
        task_id="corridor/train/00005",
    )
    explorer = Explorer(
        engine=engine,
        tokenizer=tokenizer,
        env=env,
        config=ExplorerConfig(**cfg),
        sink=sink,
        spec=spec,
    )
    asyncio.run(explorer.run())
    return sink.events, engine, env


def assert_prompts_rebuilt(events: list, engine: ScriptedEngine, tokenizer: ChatTokenizer) -> None:
    action_calls = [c for c in engine.calls if c.kind == "action"]
    rebuilt = rebuild_step_prompts(events)
    assert len(rebuilt) == len(action_calls)
    for (step, messages), call in zip(rebuilt, action_calls, strict=True):
        ids = tokenizer.encode_chat(messages, events[0].response_prefix)
        assert ids == call.input_ids, (
            f"prompt of {step.event_id} differs from what the engine received"
        )
        assert prompt_sha256(ids) == step.prompt_sha256 and len(ids) == step.prompt_tokens


@given(
    cfg=configs,
    actions=st.lists(st.sampled_from(ACTION_TEXTS), min_size=1, max_size=12),
    reflections=st.lists(reflection_texts, min_size=1, max_size=6),
    snapshots=st.booleans(),
)
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_event_streams_are_well_formed_and_prompts_rebuild(
    cfg: dict[str, Any], actions: list[str], reflections: list[str], snapshots: bool
) -> None:
    """Structure invariants hold and every Step's prompt is rebuilt exactly from the log."""
    tok = ByteChatTokenizer()
    events, engine, env = run_episode(cfg, actions, reflections, snapshots, tok)
    check_episode(events)
    assert_prompts_rebuilt(events, engine, tok)
    fin = events[-1]
    assert fin.actions <= cfg["max_actions"] and fin.branches <= cfg["max_branches"]
    assert all(b.depth <= cfg["max_depth"] for b in events if isinstance(b, Branch))
    assert all(s.t < cfg["horizon"] for s in events if isinstance(s, Step))
    parsed_steps = sum(1 for s in events if isinstance(s, Step) and s.action is not None)
    assert env.env_steps == parsed_steps + fin.replay_steps


@given(
    cfg=configs,
    actions=st.lists(st.sampled_from(ACTION_TEXTS), min_size=1, max_size=12),
    reflections=st.lists(reflection_texts, min_size=1, max_size=6),
)
@settings(max_examples=25, deadline=None)
def test_snapshot_and_replay_rollback_produce_the_same_tree(
    cfg: dict[str, Any], actions: list[str], reflections: list[str]
) -> None:
    """Only the Rollback method and replay counts differ between a snapshot env and a replay env."""
    tok = ByteChatTokenizer()
    a, _, _ = run_episode(cfg, actions, reflections, True, tok)
    b, _, _ = run_episode(cfg, actions, reflections, False, tok)
    skip = {"ts", "msg_nonce", "method", "replay_steps"}
    assert [{f: getattr(e, f) for f in e.__struct_fields__ if f not in skip} for e in a] == [
        {f: getattr(e, f) for f in e.__struct_fields__ if f not in skip} for e in b
    ]


@given(
    cfg=configs,
    actions=st.lists(st.sampled_from(ACTION_TEXTS), min_size=1, max_size=12),
    reflections=st.lists(reflection_texts, min_size=1, max_size=6),
)
@settings(max_examples=25, deadline=None)
def test_branch_prefix_is_the_parents_path(
    cfg: dict[str, Any], actions: list[str], reflections: list[str]
) -> None:
    """A branch's first step starts from the observation the parent had at tau (rollback state)."""
    events, _, _ = run_episode(cfg, actions, reflections, False, ByteChatTokenizer())
    for br in (e for e in events if isinstance(e, Branch)):
        prefix = path_of(br.parent_branch_id, br.tau, events)
        first = next(e for e in events if isinstance(e, Step) and e.branch_id == br.branch_id)
        assert first.t == br.tau
        assert path_of(br.branch_id, br.tau, events) == prefix


def test_prompts_rebuild_with_the_real_chat_template(tiny_dir: Path) -> None:
    """With SmolLM2's tokenizer and chat template, the rebuilt prompt ids equal the ids sent."""
    from leafe.learner.model_io import HFChatTokenizer

    tok = HFChatTokenizer.from_dir(tiny_dir)
    cfg = {
        "k": 2,
        "max_depth": 2,
        "max_branches": 4,
        "max_actions": 20,
        "horizon": 6,
        "history_window": 2,
    }
    events, engine, _ = run_episode(
        cfg, ACTION_TEXTS, ["<step>1</step><experience>é ✓ go</experience>"], True, tok
    )
    check_episode(events)
    assert_prompts_rebuilt(events, engine, tok)
    assert any(isinstance(e, Branch) for e in events)
