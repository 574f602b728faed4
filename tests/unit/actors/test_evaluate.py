"""Pass@k evaluation (``actors/evaluate.py``) on the scripted engine, byte tokenizer and corridor
env."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

import pytest

from leafe.actors.engine import Completion, SamplingParams
from leafe.actors.episode import ListSink
from leafe.actors.evaluate import EvalRequest, EvalResult, evaluate
from leafe.actors.fakes import ByteChatTokenizer, CorridorEnv, ScriptedEngine
from leafe.protocol.events import EpisodeStarted, Step
from leafe.services.admin.tasks import make_assignments
from tests.support.event_checks import check_episode

pytestmark = pytest.mark.anyio

# corridor/test/0000i has its goal at 3 + i (start 1; "left" falls into the pit at 0).
TASKS = ["corridor/test/00000", "corridor/test/00001", "corridor/test/00002"]
CORRECT = {3: 0, 4: 1, 5: 3}
"""Goal position -> how many of the n samples of that task walk right (the rest step left at
once)."""


def _corridor(name: str, **options: object) -> CorridorEnv:
    assert name == "corridor"
    return CorridorEnv(**options)  # type: ignore[arg-type]


def _scripted(correct: dict[int, int]) -> ScriptedEngine:
    """First-step prompts of a task are identical across its samples: the first ``correct[goal]`` of
    them are answered "right" (then "right" until the goal), the others "left" (the pit). Success
    counts per task are therefore exact whatever order the rollouts run in."""
    seen: Counter[int] = Counter()

    def script(kind: str, prompt: str) -> str:
        goal = int(re.search(r"Walk to position (\d+)", prompt).group(1))  # type: ignore[union-attr]
        if "(step 0)" not in prompt:
            return "<action>right</action>"
        seen[goal] += 1
        return "<action>right</action>" if seen[goal] <= correct[goal] else "<action>left</action>"

    return ScriptedEngine(script=script, version="v7")


async def _run(
    engine: ScriptedEngine | _Gauge,
    *,
    n: int = 4,
    sink: ListSink | None = None,
    **fields: object,
) -> EvalResult:
    """An evaluation of the corridor tasks; ``fields`` override the request's."""
    base: dict[str, object] = dict(
        env="corridor",
        task_ids=TASKS,
        split="test",
        samples=n,
        ks=[1, 2, 4],
        run_id="r1",
        label="m1",
        concurrency=4,
        rollout_overrides={"horizon": 10},
    )
    request = EvalRequest(**{**base, **fields})  # type: ignore[arg-type]
    return await evaluate(
        request, engine=engine, tokenizer=ByteChatTokenizer(), sink=sink, env_factory=_corridor
    )


async def test_passk_matches_hand_computed_values() -> None:
    """c = 0, 1, 3 correct of n = 4: Pass@1 = 1/3, Pass@2 = (0 + 1/2 + 1)/3, Pass@4 = 2/3; per-task
    success lists, success rate, mean steps and the engine's version are reported."""
    result = await _run(_scripted(CORRECT))
    assert [sum(result.successes[t]) for t in TASKS] == [0, 1, 3]
    assert all(len(v) == 4 for v in result.successes.values())
    assert result.passk == pytest.approx({1: 1 / 3, 2: 0.5, 4: 2 / 3})
    assert result.success_rate == pytest.approx(4 / 12)
    # failures take 1 action; successes goal - 1 actions: 4*1 + (3 + 3*1) + (3*4 + 1) = 23
    assert result.mean_steps == pytest.approx(23 / 12)
    assert result.parse_failure_rate == 0.0 and result.env_errors == 0
    assert result.weight_version == "v7" and result.policy_versions == ["v7"]
    assert (result.episodes, result.samples, result.task_ids) == (12, 4, TASKS)


async def test_weight_version_is_the_completions_not_model_info() -> None:
    """Through a router ``weight_version()`` answers from the first healthy worker: the result and
    every event report the version the completions carry instead."""

    class Routed(ScriptedEngine):
        async def weight_version(self) -> str:
            return "v1"

    sink = ListSink()
    engine = Routed(script=_scripted(CORRECT).script, version="v7")
    result = await _run(engine, sink=sink)
    assert result.weight_version == "v7" and result.policy_versions == ["v7"]
    assert {e.policy_version for e in sink.events} == {"v7"}


@pytest.mark.parametrize(
    ("seeds", "overrides", "want"),
    [
        ({}, {}, "unknown"),
        ({"seeds_honoured": "yes"}, {}, "yes"),
        ({"seeds_honoured": "no"}, {}, "no"),
        ({"seeds_honoured": "yes"}, {"seeded_sampling": False}, "no"),
    ],
)
async def test_reproducible_says_whether_seeds_are_sent_and_honoured(
    seeds: dict[str, str], overrides: dict[str, object], want: str
) -> None:
    """A client cannot see whether the engine honours seeds: unstated is ``unknown``; seeded
    sampling off is never reproducible."""
    result = await _run(_scripted(CORRECT), rollout_overrides={"horizon": 10, **overrides}, **seeds)
    assert result.reproducible == want


async def test_k_above_n_is_left_out_and_all_above_n_is_an_error() -> None:
    """ks larger than the sample count are not extrapolated; if none is <= n the call fails naming
    ks."""
    result = await _run(_scripted({3: 1, 4: 1, 5: 1}), n=2, ks=[1, 2, 4])
    assert sorted(result.passk) == [1, 2]
    with pytest.raises(ValueError, match=r"ks = \[4, 8\]"):
        await _run(_scripted(CORRECT), n=2, ks=[4, 8])


async def test_episode_ids_are_deterministic_and_match_task_submission() -> None:
    """Episode ids, groups and seeds depend only on (run, label, task, sample): the same at any
    concurrency, equal to ``leafe tasks submit --mode eval --prefix <label>``'s keys (with the
    evaluating actor's id), and distinct between labels; every rollout is a well-formed eval
    episode."""

    def starts(sink: ListSink) -> set[tuple[str, str | None, int, int, str]]:
        return {
            (e.episode_id, e.group_id, e.group_size, e.seed, e.task_id)
            for e in sink.events
            if isinstance(e, EpisodeStarted) and e.mode == "eval"
        }

    a, b, other = ListSink(), ListSink(), ListSink()
    await _run(_scripted(CORRECT), concurrency=1, sink=a, seed=5)
    await _run(_scripted(CORRECT), concurrency=7, sink=b, seed=5)
    await _run(_scripted(CORRECT), concurrency=7, sink=other, seed=5, label="m2")
    assignments = make_assignments(
        run_id="r1",
        env="corridor",
        task_ids=TASKS,
        mode="eval",
        split="test",
        samples=4,
        seed=5,
        prefix="m1",
    )
    expected = {(f"{x.task_key}.a1@eval", x.group_id, 4, x.seed, x.task_id) for x in assignments}
    assert starts(a) == starts(b) == expected
    assert "r1-m1-corridor-test-00002-x3.a1@eval" in {s[0] for s in expected}
    assert not {s[0] for s in starts(other)} & {s[0] for s in expected}
    for episode in {e.episode_id for e in a.events}:
        check_episode([e for e in a.events if e.episode_id == episode])


class _Gauge:
    """Wraps an engine and records the most generate calls in flight at once."""

    def __init__(self, inner: ScriptedEngine) -> None:
        self.inner = inner
        self.now = 0
        self.peak = 0

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        n: int = 1,
        return_logprob: bool = False,
    ) -> list[Completion]:
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            return await self.inner.generate(input_ids, params, n=n, return_logprob=return_logprob)
        finally:
            self.now -= 1

    async def weight_version(self) -> str:
        return await self.inner.weight_version()


async def test_concurrency_bounds_rollouts_in_flight_over_all_tasks() -> None:
    """With 12 rollouts and concurrency 3, never more than 3 requests are in flight, and 3 are
    reached (the bound is shared by every task's samples, not per task)."""
    engine = _scripted(CORRECT)
    engine.latency_s = 0.002
    gauge = _Gauge(engine)
    result = await _run(gauge, concurrency=3)
    assert gauge.peak == 3 and result.episodes == 12
    gauge1 = _Gauge(_scripted(CORRECT))
    gauge1.inner.latency_s = 0.002
    await _run(gauge1, concurrency=1)
    assert gauge1.peak == 1


async def test_parse_failures_and_prompt_tokens_per_step() -> None:
    """Unparseable answers are policy steps with no env step: rate 1.0, the horizon reached; mean
    prompt tokens equals the mean length of the prompts the engine received; events reach the
    sink."""
    engine = ScriptedEngine(default_action="I am not sure what to do")
    sink = ListSink()
    result = await _run(engine, n=2, ks=[1], sink=sink, rollout_overrides={"horizon": 3})
    assert (
        result.parse_failure_rate == 1.0 and result.mean_steps == 3 and result.success_rate == 0.0
    )
    prompts: Sequence[int] = [len(c.input_ids) for c in engine.calls]
    assert len(prompts) == 3 * 2 * 3
    assert result.mean_prompt_tokens == pytest.approx(sum(prompts) / len(prompts))
    assert sum(isinstance(e, Step) for e in sink.events) == len(prompts)
    assert all(not c.params.stop or c.params.stop == ["</action>"] for c in engine.calls)


async def test_env_errors_are_failures_and_counted() -> None:
    """A crashing env backend ends each rollout with an error outcome: scored as a failure,
    counted."""
    result = await _run(_scripted({3: 4, 4: 4, 5: 4}), n=2, ks=[1], env_options={"broken_after": 0})
    assert result.env_errors == 6 and result.passk == {1: 0.0}


async def test_bad_arguments_name_the_value() -> None:
    """Concurrency < 1, no tasks, duplicate tasks and samples < 1 are rejected with the value
    named."""
    engine = _scripted(CORRECT)
    with pytest.raises(ValueError, match="concurrency = 0"):
        await _run(engine, concurrency=0)
    with pytest.raises(ValueError, match="task_ids is empty"):
        await _run(engine, task_ids=[])
    with pytest.raises(ValueError, match=r"duplicates.*corridor/test/00000"):
        await _run(engine, task_ids=[TASKS[0], TASKS[0]])
    with pytest.raises(ValueError, match="samples = 0"):
        await _run(engine, n=0, ks=[1])
