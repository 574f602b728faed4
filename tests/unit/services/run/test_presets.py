"""``leafe run``'s config (services/run/presets.py): typed sections validated before anything
starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from leafe.actors.config import ActorServiceConfig
from leafe.learner.config import LearnerConfig
from leafe.services.config import ConfigError
from leafe.services.run.presets import PRESETS, RunConfig, resolve_run_config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_resolves_and_owns_its_run_id(name: str) -> None:
    """Each preset is a valid RunConfig whose run id is its own name (presets never share a run
    dir)."""
    cfg = resolve_run_config(name)
    assert isinstance(cfg, RunConfig) and cfg.run_id == name
    assert isinstance(cfg.actor, ActorServiceConfig) and isinstance(cfg.learner, LearnerConfig)
    assert cfg.replayer.materializer == cfg.materializer and cfg.replayer.model == cfg.model


def test_service_sections_are_typed_and_validated_up_front(tmp_path: Path) -> None:
    """A typo inside [actor], [replayer] or [learner] is an error naming it, at load time."""
    for table in ("actor", "replayer", "learner"):
        path = tmp_path / f"{table}.toml"
        path.write_text(f"[{table}]\nno_such_field = 1\n")
        with pytest.raises(ConfigError, match="no_such_field"):
            resolve_run_config("tiny", files=[path])
    with pytest.raises(ConfigError, match="in_progress_interval_s"):
        resolve_run_config("tiny", overrides={"actor.ack_wait_s": 1.0})


def test_learner_section_starts_from_its_preset_and_the_durable_is_used() -> None:
    """[learner] fields override the ``learner_preset``'s trainer settings, the rest stays the
    preset's."""
    cfg = resolve_run_config(
        "explore-only", overrides={"learner_preset": "paper", "learner.durable": "lrn-x"}
    )
    assert cfg.learner.trainer.optim.lr == 1e-6  # paper
    assert cfg.learner.trainer.batch.global_batch == 16  # the preset's own override
    assert cfg.learner.durable == "lrn-x"


def test_materializer_and_learner_kinds_must_agree() -> None:
    """A GRPO run whose learner trains cf/reh would train nothing: refused with the way out; the
    replayer cannot be given another materializer than the run's."""
    with pytest.raises(ConfigError, match=r"learner\.kinds.*set \[learner\] kinds"):
        resolve_run_config("tiny", overrides={"materializer": "grpo"})
    ok = resolve_run_config("tiny", overrides={"materializer": "grpo", "learner.kinds": ["grpo"]})
    assert ok.replayer.materializer == "grpo"
    with pytest.raises(ConfigError, match=r"replayer\.materializer"):
        resolve_run_config("tiny", overrides={"replayer.materializer": "rft"})
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        resolve_run_config("huge")


def test_the_validation_slice_is_disjoint_from_the_pool_and_the_demonstrations() -> None:
    """The learning curve is measured on train tasks nothing trains on: by default right after the
    pool and the demonstrations; an offset overlapping either is refused naming both ranges."""
    cfg = resolve_run_config("leafe")
    start, _ = cfg.validation_slice()
    assert start >= max(
        cfg.explore.offset + cfg.explore.tasks, cfg.explore.demo_offset + cfg.explore.demos
    )
    for offset, what in ((4, "explore pool"), (90, "demonstrations")):
        with pytest.raises(ConfigError, match=what):
            resolve_run_config("leafe", overrides={"online_eval.offset": offset})
    with pytest.raises(ConfigError, match="every k must be <= samples"):
        resolve_run_config("leafe", overrides={"online_eval.ks": [1, 8]})


def test_demo_epochs_submit_every_demonstration_once_per_epoch_under_distinct_keys() -> None:
    """``explore.demo_epochs = 2``: each demonstration task twice (the learner trains it twice),
    with keys JetStream's dedupe keeps apart; pass 0 keeps the one-pass keys (older run directories
    resume)."""
    from leafe.services.run.rounds import demo_assignments

    one = demo_assignments(resolve_run_config("leafe"))
    two = demo_assignments(resolve_run_config("leafe", overrides={"explore.demo_epochs": 2}))
    assert len(two) == 2 * len(one) == 2 * 96
    assert [a.task_key for a in two[: len(one)]] == [a.task_key for a in one]
    assert len({a.task_key for a in two}) == len(two)
    assert [a.task_id for a in two[len(one) :]] == [a.task_id for a in one]
    with pytest.raises(ConfigError, match="demo_epochs"):
        resolve_run_config("leafe", overrides={"explore.demo_epochs": 0})


def test_the_default_run_is_bounded_by_work_and_an_endless_one_is_refused() -> None:
    """``make run`` is phased with no wall-clock budget (the same work on any machine; the continual
    presets keep a budget); rounds until a limit with no limit at all would never stop and is
    refused."""
    default = resolve_run_config("default")
    assert (default.explore.schedule, default.budget_minutes, default.explore.rounds) == (
        "phased",
        0.0,
        1,
    )
    assert default.eval.before and default.eval.after_warm_start and default.eval.after
    assert resolve_run_config("leafe").explore.schedule == "continuous"
    with pytest.raises(ConfigError, match="would never stop"):
        resolve_run_config("default", overrides={"explore.rounds": 0})
    resolve_run_config("default", overrides={"explore.rounds": 0, "explore.max_learner_steps": 4})


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_typed_run_configs_built_over_the_chosen_learner_preset(name: str) -> None:
    """A preset is a function of the learner preset giving a ``RunConfig`` (no untyped table): what
    the run preset sets wins over the learner preset's value (``default`` keeps its 16-sample batch
    under ``paper``, whose own is 128), what it leaves alone comes from the learner preset."""
    from leafe.learner.config import learner_preset

    paper, cpu = learner_preset("paper"), learner_preset("cpu")
    assert isinstance(PRESETS[name](cpu), RunConfig)
    cfg = resolve_run_config(name, overrides={"learner_preset": "paper"})
    assert cfg.learner == PRESETS[name](paper).learner
    assert cfg.learner.trainer.optim.betas == paper.trainer.optim.betas
    if name == "default":
        assert paper.trainer.batch.global_batch == 128
        assert cfg.learner.trainer.batch.global_batch == 16


@pytest.mark.parametrize("preset", ["default", "leafe", "grpo", "warmstart", "explore-only"])
def test_the_presets_learner_steps_as_leafe_train_does(preset: str) -> None:
    """Issue 62: no preset's learner steps on a partial batch before the stream's tail
    (``min_batch`` 0, the global batch), and the tail is trained at the full lr, as ``leafe
    train`` trains an epoch's last batch (the warm-start presets scaled a partial step's lr down;
    with the floor that made only the tail differ from offline)."""
    cfg = resolve_run_config(preset)
    assert cfg.learner.min_batch == 0
    assert not cfg.learner.trainer.optim.scale_partial_batches


def test_a_continuous_run_gates_its_actors_by_the_learners_staleness_bound() -> None:
    """The grpo preset's actors get the staleness gate: a version is 16 x 4 samples, a rollout
    gives ~7.5 (the shipped record), so ~8.5 episodes a version, and at least one group of 4; the
    learner's ``max_policy_lag``; off with ``explore.backpressure = false`` and in phased runs;
    kept when set by hand."""
    gate = resolve_run_config("grpo").actor_config().staleness
    assert gate.episodes_per_version == pytest.approx(16 * 4 / 7.5)
    assert gate.max_policy_lag == 4
    small = resolve_run_config(
        "grpo", overrides={"learner.trainer.push_every": 1, "services.actors": 2}
    )
    assert small.actor_config().staleness.episodes_per_version == 4.0  # one group of 4
    off = resolve_run_config("grpo", overrides={"explore.backpressure": False})
    assert off.actor_config().staleness.episodes_per_version == 0.0
    assert resolve_run_config("default").actor_config().staleness.episodes_per_version == 0.0
    mine = resolve_run_config("leafe", overrides={"actor.staleness.episodes_per_version": 3.0})
    assert mine.actor_config().staleness.episodes_per_version == 3.0
