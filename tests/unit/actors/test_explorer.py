"""The LEAFE exploration tree against a scripted engine and the corridor env (no network, no
model)."""

from __future__ import annotations

from typing import Any

import pytest

from leafe.actors.config import ExplorerConfig
from leafe.actors.engine import EngineError
from leafe.actors.episode import EpisodeSpec, ListSink
from leafe.actors.explorer import Explorer
from leafe.actors.fakes import ByteChatTokenizer, CorridorEnv, ScriptedEngine
from leafe.protocol.events import Branch, EpisodeFinished, Outcome, Reflection, Rollback, Step
from leafe.protocol.prompt import prompt_sha256
from tests.support.event_checks import check_episode, rebuild_step_prompts

pytestmark = pytest.mark.anyio

LEFT, RIGHT, WAIT = "<action>left</action>", "<action>right</action>", "<action>wait</action>"
TOK = ByteChatTokenizer()


def spec(task: str = "corridor/train/00001", seed: int = 0) -> EpisodeSpec:
    return EpisodeSpec(
        run_id="r1",
        episode_id="task-1.a1",
        actor_id="actor-0",
        task_key="task-1",
        env="corridor",
        task_id=task,
        seed=seed,
    )


async def explore(
    engine: ScriptedEngine, env: CorridorEnv | None = None, **cfg: Any
) -> tuple[list, Any]:
    sink = ListSink()
    explorer = Explorer(
        engine=engine,
        tokenizer=TOK,
        env=env or CorridorEnv(),
        config=ExplorerConfig(**cfg),
        sink=sink,
        spec=spec(),
    )
    summary = await explorer.run()
    check_episode(sink.events, restart=cfg.get("restart_from") == "start")
    return sink.events, summary


def kinds(events: list) -> list[str]:
    return [type(e).__name__ for e in events]


async def test_failure_reflection_rollback_branch_success_in_that_order() -> None:
    """Root falls into the pit; the reflection blames step 0; the branch rolls back, opens,
    succeeds."""
    engine = ScriptedEngine(
        actions=[LEFT, RIGHT, RIGHT, RIGHT],
        reflections=["<step>0</step><experience>Go right, the pit is left.</experience>"],
    )
    events, summary = await explore(engine, k=0, max_depth=2)
    assert kinds(events) == [
        "EpisodeStarted",
        "Step",
        "Reflection",
        "Outcome",
        "Rollback",
        "Branch",
        "Step",
        "Step",
        "Step",
        "Outcome",
        "EpisodeFinished",
    ]
    refl, out0, rb, br = events[2], events[3], events[4], events[5]
    assert (refl.trigger, refl.tau, refl.at_t, refl.parse_ok) == ("failure", 0, 1, True)
    assert (out0.reason, out0.success) == ("env_done", False)
    assert (rb.from_branch, rb.tau, rb.method, rb.replay_steps) == ("b0", 0, "snapshot", 0)
    assert (br.branch_id, br.parent_branch_id, br.tau, br.depth) == ("b1", "b0", 0, 1)
    assert br.reflection_event_id == refl.event_id and br.experience == "Go right, the pit is left."
    assert (events[-2].reason, events[-2].success, events[-2].steps) == ("success", True, 3)
    assert (
        summary.success
        and summary.branches == 2
        and summary.actions == 4
        and summary.reflections == 1
    )


async def test_experience_is_in_the_branch_prompt_and_not_in_the_counterfactual_input() -> None:
    """a'_tau is sampled with e in its prompt; the same history rendered without e (D_cf input)
    lacks e."""
    lesson = "Never step left at the start"
    engine = ScriptedEngine(
        actions=[RIGHT, LEFT, LEFT, RIGHT, RIGHT, RIGHT],
        reflections=[f"<step>1</step><experience>{lesson}</experience>"],
    )
    events, _ = await explore(engine, k=0)
    branch_step = next(e for e in events if isinstance(e, Step) and e.branch_id == "b1")
    assert branch_step.t == 1 and branch_step.experience_in_context
    action_calls = [c for c in engine.calls if c.kind == "action"]
    sent = TOK.decode(action_calls[3].input_ids)
    assert lesson in sent
    rebuilt = dict((s.event_id, m) for s, m in rebuild_step_prompts(events))[branch_step.event_id]
    assert TOK.encode_chat(rebuilt) == action_calls[3].input_ids
    from leafe.protocol.prompt import HistoryEntry, render_messages

    start = events[0]
    parent_steps = [e for e in events if isinstance(e, Step) and e.branch_id == "b0"][:1]
    counterfactual = render_messages(
        instructions=start.instructions,
        task=start.task,
        history=[
            HistoryEntry(s.action, s.raw_text, s.observation, s.feedback) for s in parent_steps
        ],
        observation=parent_steps[-1].observation,
        experience=None,
    )
    assert all(lesson not in m.content for m in counterfactual)
    assert (
        TOK.encode_chat(counterfactual) == action_calls[1].input_ids
    )  # the parent's own prompt at tau


async def test_experience_scope_first_step_only_puts_e_in_the_first_branch_prompt() -> None:
    """With ``first_step``, e is in a'_tau's prompt only; with ``branch`` in every prompt of the
    branch."""
    for scope, expected in (("first_step", [True, False, False]), ("branch", [True, True, True])):
        engine = ScriptedEngine(actions=[LEFT, RIGHT, RIGHT, RIGHT])
        events, _ = await explore(engine, k=0, experience_scope=scope)
        in_ctx = [
            e.experience_in_context for e in events if isinstance(e, Step) and e.branch_id == "b1"
        ]
        assert in_ctx == expected, scope
        prompts = [TOK.decode(c.input_ids) for c in engine.calls if c.kind == "action"][1:]
        assert ["go right, not left" in p for p in prompts] == expected


async def test_prompts_rebuilt_from_events_match_what_the_engine_received() -> None:
    """Each Step's prompt_sha256 and the ids the engine got equal the prompt rebuilt from the
    log."""
    engine = ScriptedEngine(
        actions=[RIGHT, "hmm", LEFT, WAIT, LEFT, "<action>right</action> then right", RIGHT, RIGHT],
        reflections=["<step>2</step><experience>wait instead</experience>", "step 1: go right"],
    )
    events, _ = await explore(engine, k=2, history_window=2, horizon=6)
    action_calls = [c for c in engine.calls if c.kind == "action"]
    rebuilt = rebuild_step_prompts(events)
    assert len(rebuilt) == len(action_calls) > 4
    for (step, messages), call in zip(rebuilt, action_calls, strict=True):
        ids = TOK.encode_chat(messages, events[0].response_prefix)
        assert ids == call.input_ids
        assert prompt_sha256(ids) == step.prompt_sha256 and step.prompt_tokens == len(ids)


def longest_seen_prefix(prompts: list[list[int]]) -> list[int]:
    """Per prompt, the longest prefix some earlier prompt began with (its last token never
    counted)."""
    out = []
    for i, ids in enumerate(prompts):
        best = 0
        for old in prompts[:i]:
            n = 0
            while n < min(len(old), len(ids) - 1) and old[n] == ids[n]:
                n += 1
            best = max(best, n)
        out.append(best)
    return out


async def test_steps_and_reflections_record_the_engines_prompt_and_cached_tokens() -> None:
    """Each engine request's prompt length and prefix-cache hit reach its event, reflections
    included, so a log tells what a tree cost the engine (``leafe log inspect``'s engine table)."""
    engine = ScriptedEngine(
        actions=[RIGHT, LEFT, LEFT, RIGHT, RIGHT, RIGHT],
        reflections=["<step>1</step><experience>right, not left</experience>"],
    )
    events, _ = await explore(engine, k=0, max_depth=2, horizon=6)
    requests = [e for e in events if isinstance(e, Step | Reflection)]
    assert [c.kind for c in engine.calls] == [
        "reflection" if isinstance(e, Reflection) else "action" for e in requests
    ]
    expected = longest_seen_prefix([c.input_ids for c in engine.calls])
    assert [e.cached_tokens for e in requests] == expected
    assert [e.prompt_tokens for e in requests] == [len(c.input_ids) for c in engine.calls]
    branch = next(e for e in requests if isinstance(e, Step) and e.branch_id == "b1")
    reflection = next(e for e in requests if isinstance(e, Reflection))
    assert branch.cached_tokens > 0 and reflection.prompt_tokens > reflection.cached_tokens > 0


async def test_parse_failures_are_counted_actions_without_env_steps() -> None:
    """An unparseable completion is a Step with action None, unchanged observation, feedback; no env
    step."""
    env = CorridorEnv()
    engine = ScriptedEngine(actions=["I am not sure", "", RIGHT, RIGHT, RIGHT])
    events, summary = await explore(engine, env, k=0)
    steps = [e for e in events if isinstance(e, Step)]
    bad = steps[:2]
    assert [s.action for s in bad] == [None, None] and not any(s.parse_ok for s in bad)
    assert bad[0].observation == events[0].observation
    assert bad[0].feedback.startswith("invalid action: no valid action in 'I am not sure'")
    assert bad[0].feedback.endswith("valid actions: left, right, wait")
    assert bad[1].feedback.startswith("invalid action: empty completion")
    assert summary.parse_failures == 2 and summary.actions == 5 and env.env_steps == 3
    assert events[-1].parse_failures == 2


async def test_replay_rollback_skips_invalid_actions_and_counts_replay_steps() -> None:
    """Without snapshots, rollback resets and replays the prefix's parsed actions only."""
    env = CorridorEnv(supports_snapshot=False)
    engine = ScriptedEngine(
        actions=[RIGHT, "??", WAIT, LEFT, LEFT, RIGHT, RIGHT],
        reflections=["<step>3</step><experience>do not turn back</experience>"],
    )
    events, summary = await explore(engine, env, k=0)
    rb = next(e for e in events if isinstance(e, Rollback))
    assert (rb.method, rb.tau, rb.replay_steps) == ("replay", 3, 2)  # right, wait; "??" skipped
    assert summary.replay_steps == 2 and events[-1].replay_steps == 2
    assert env.resets == 2
    b1 = [e for e in events if isinstance(e, Step) and e.branch_id == "b1"]
    assert b1[0].t == 3 and b1[-1].success


async def test_action_budget_ends_the_branch_with_reason_budget() -> None:
    """``max_actions`` bounds policy actions over the whole tree; the branch that hits it ends
    'budget'."""
    engine = ScriptedEngine(default_action=WAIT)
    events, summary = await explore(engine, k=2, max_actions=5, horizon=50, max_branches=10)
    outcomes = [e for e in events if isinstance(e, Outcome)]
    assert summary.actions == 5 == sum(isinstance(e, Step) for e in events)
    assert outcomes[-1].reason == "budget"
    assert len(outcomes) == summary.branches


async def test_branch_budget_counts_queued_requests_and_stops_reflecting() -> None:
    """With max_branches=3, at most two reflections yield requests; no reflection is wasted after
    that."""
    lessons = [f"<step>0</step><experience>lesson {i}</experience>" for i in range(5)]
    engine = ScriptedEngine(default_action=WAIT, reflections=lessons)
    events, summary = await explore(engine, k=1, horizon=3, max_branches=3, max_depth=5)
    assert summary.branches == 3
    assert sum(isinstance(e, Reflection) for e in events) == 2
    assert all(o.reason == "horizon" for o in events if isinstance(o, Outcome))


async def test_max_depth_bounds_the_tree() -> None:
    """A branch at max_depth never reflects; depths never exceed it."""
    engine = ScriptedEngine(
        default_action=WAIT, default_reflection="<step>0</step><experience>x</experience>"
    )
    events, _ = await explore(
        engine, k=0, horizon=2, max_depth=2, max_branches=100, max_actions=100
    )
    depths = [e.depth for e in events if isinstance(e, Branch)]
    assert depths == [1, 2]
    deepest = next(e.branch_id for e in events if isinstance(e, Branch) and e.depth == 2)
    assert not [e for e in events if isinstance(e, Reflection) and e.branch_id == deepest]


async def test_periodic_reflections_queue_branches_served_breadth_first() -> None:
    """Every K own steps the branch reflects and goes on; requests are served in FIFO (BFS)
    order."""
    engine = ScriptedEngine(
        default_action=WAIT,
        reflections=[f"<step>{i}</step><experience>lesson {i}</experience>" for i in range(10)],
    )
    events, _ = await explore(engine, k=2, horizon=4, max_depth=2, max_branches=4, max_actions=100)
    refl = [e for e in events if isinstance(e, Reflection)]
    assert [(r.branch_id, r.trigger, r.at_t) for r in refl[:2]] == [
        ("b0", "periodic", 2),
        ("b0", "horizon", 4),
    ]
    branches = [e for e in events if isinstance(e, Branch)]
    assert [(b.branch_id, b.parent_branch_id, b.experience) for b in branches[:2]] == [
        ("b1", "b0", "lesson 0"),
        ("b2", "b0", "lesson 1"),
    ]
    assert [b.depth for b in branches] == [1, 1, 2]


async def test_first_success_stops_the_episode_unless_configured_otherwise() -> None:
    """Queued requests are dropped after a success with stop_on_first_success, explored without
    it."""
    script = [RIGHT] * 20
    for stop, expect_branches in ((True, 1), (False, 2)):
        engine = ScriptedEngine(
            actions=script, reflections=["<step>0</step><experience>e</experience>"]
        )
        _, summary = await explore(engine, k=1, max_branches=2, stop_on_first_success=stop)
        assert summary.success and summary.branches == expect_branches, stop


class LessonFollower:
    """Waits at the root and goes right whenever a lesson is in its prompt; each reflection names a
    new lesson (lesson 0, lesson 1, ...)."""

    def __init__(self) -> None:
        self.lessons = 0

    def __call__(self, kind: str, prompt: str) -> str:
        if kind == "action":
            return RIGHT if "lesson" in prompt else WAIT
        self.lessons += 1
        return f"<step>0</step><experience>lesson {self.lessons}</experience>"


async def test_without_stopping_at_first_success_the_tree_ends_after_max_corrections() -> None:
    """The paper's Stage 1: successful branches do not end the tree; it ends once
    ``max_corrections`` rolled-back branches succeeded (queued requests after that are dropped,
    never opened)."""
    for limit, opened in ((2, 3), (0, 5)):
        engine = ScriptedEngine(script=LessonFollower())
        cfg = dict(k=2, horizon=8, max_depth=1, max_branches=10, stop_on_first_success=False)
        events, summary = await explore(engine, max_corrections=limit, **cfg)
        wins = [o for o in events if isinstance(o, Outcome) and o.success]
        assert summary.branches == opened, limit
        assert len(wins) == opened - 1 and all(o.branch_id != "b0" for o in wins)


async def test_a_repeated_correction_is_requested_once() -> None:
    """Periodic reflections that name the same tau and e on the same branch open one branch, not
    four (a duplicate would only repeat its sibling's attempt)."""
    engine = ScriptedEngine(
        default_action=WAIT, default_reflection="<step>0</step><experience>same</experience>"
    )
    events, summary = await explore(engine, k=2, horizon=8, max_depth=1, max_branches=10)
    reflections = [e for e in events if isinstance(e, Reflection) and e.branch_id == "b0"]
    branches = [e for e in events if isinstance(e, Branch)]
    assert len(reflections) == 4 and len(branches) == 1 and summary.branches == 2
    assert branches[0].reflection_event_id == reflections[0].event_id


async def test_env_error_ends_the_episode_with_an_error_outcome() -> None:
    """A crashing env step ends the branch with reason 'error' and the episode still finishes."""
    env = CorridorEnv(broken_after=1)
    events, summary = await explore(ScriptedEngine(default_action=WAIT), env, k=1)
    out = next(e for e in events if isinstance(e, Outcome))
    assert out.reason == "error" and "crashed" in out.error and out.steps == 1
    assert isinstance(events[-1], EpisodeFinished) and "crashed" in summary.error


async def test_engine_error_propagates_and_leaves_the_episode_unfinished() -> None:
    """An engine failure is not recorded as an outcome: the episode is abandoned (no
    EpisodeFinished)."""

    def script(kind: str, prompt: str) -> str:
        raise EngineError("all servers down")

    sink = ListSink()
    explorer = Explorer(
        engine=ScriptedEngine(script=script),
        tokenizer=TOK,
        env=CorridorEnv(),
        config=ExplorerConfig(),
        sink=sink,
        spec=spec(),
    )
    with pytest.raises(EngineError, match="all servers down"):
        await explorer.run()
    assert kinds(sink.events) == [], (
        "no completion: EpisodeStarted is never emitted (nothing to orphan)"
    )


class _RouterEngine(ScriptedEngine):
    """Generates with one version while ``/get_model_info`` (through a router: the first healthy
    worker) reports another."""

    async def weight_version(self) -> str:
        return "v000001"


@pytest.mark.parametrize("cfg", [{}, {"k": 1}])
async def test_every_event_takes_its_version_from_completions_not_model_info(
    cfg: dict[str, Any],
) -> None:
    """EpisodeStarted included: its policy_version is the first completion's, never what
    ``weight_version()`` answers."""
    engine = _RouterEngine(actions=[LEFT, RIGHT, RIGHT, RIGHT], version="v000007")
    events, _ = await explore(engine, **cfg)
    assert kinds(events)[0] == "EpisodeStarted"
    assert {e.policy_version for e in events} == {"v000007"}


async def test_events_carry_the_engine_weight_version_and_deterministic_ids() -> None:
    """policy_version comes from the engine's completions; event ids are <episode>.<seq:06d>."""
    engine = ScriptedEngine(actions=[RIGHT, RIGHT, RIGHT], version="v000007")
    events, _ = await explore(engine)
    assert {e.policy_version for e in events} == {"v000007"}
    assert events[3].event_id == "task-1.a1.000003"


async def test_env_in_thread_gives_the_same_events() -> None:
    """Running env calls in a worker thread changes nothing observable."""
    script = [LEFT, RIGHT, WAIT, RIGHT, RIGHT]
    a, _ = await explore(ScriptedEngine(actions=script), k=2)
    b, _ = await explore(ScriptedEngine(actions=script), k=2, env_in_thread=True)
    clock = ("ts", "msg_nonce")  # the wall clock, and each event's random dedupe part
    strip = [{f: getattr(e, f) for f in e.__struct_fields__ if f not in clock} for e in a]
    assert strip == [{f: getattr(e, f) for f in e.__struct_fields__ if f not in clock} for e in b]


async def test_sampling_params_follow_the_config_and_seed() -> None:
    """Actions and reflections use their own sampling settings; seeds derive from the episode
    seed."""
    engine = ScriptedEngine(actions=[LEFT, RIGHT, RIGHT, RIGHT])
    await explore(
        engine,
        temperature=0.9,
        max_new_tokens=17,
        reflect_temperature=0.3,
        reflect_max_new_tokens=99,
    )
    act = next(c for c in engine.calls if c.kind == "action").params
    refl = next(c for c in engine.calls if c.kind == "reflection").params
    assert (act.temperature, act.max_new_tokens, act.stop) == (0.9, 17, ["</action>"])
    assert (refl.temperature, refl.max_new_tokens, refl.stop) == (0.3, 99, ["</experience>"])
    seeds = [c.params.sampling_seed for c in engine.calls]
    assert len(set(seeds)) == len(seeds)


async def test_iterative_refinement_restarts_from_step_zero_with_the_experience() -> None:
    """``restart_from = "start"`` (the IR baseline): the reflection still names tau, but the branch
    opens at t = 0 with e in its prompt, sharing none of the parent's steps."""
    engine = ScriptedEngine(
        actions=[RIGHT, LEFT, LEFT, RIGHT, RIGHT, RIGHT, RIGHT],
        reflections=["<step>1</step><experience>Never go left.</experience>"],
    )
    events, _ = await explore(engine, k=0, max_depth=1, restart_from="start")
    refl = next(e for e in events if isinstance(e, Reflection))
    branch = next(e for e in events if isinstance(e, Branch))
    rollback = next(e for e in events if isinstance(e, Rollback))
    assert refl.tau == 1 and branch.tau == 0 and rollback.tau == 0
    first = next(e for e in events if isinstance(e, Step) and e.branch_id == branch.branch_id)
    assert first.t == 0 and first.experience_in_context
