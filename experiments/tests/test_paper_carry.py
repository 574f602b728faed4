"""A staged paper-table run across working periods (``experiments/paper/carry.py``): the records
committed at the end of one stage restore in a fresh checkout, and a restored training whose weights
a pending phase reads is trained again (only it, once, before that phase), its loss curve checked
against the record."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import msgspec

from experiments.paper.carry import state_dir
from experiments.paper.config import PaperConfig, load_paper_config
from experiments.paper.phases import EvalSpec, Phase, SelectSpec, TrainSpec
from experiments.paper.runner import Runner
from experiments.tests.conftest import FakeSteps


class WritingSteps(FakeSteps):
    """Fake results whose trainings write their weight directories under ``work`` (as the real ones
    do) and whose selections name the chosen candidate's weights; ``stop_after`` ends the stage
    there."""

    def __init__(
        self, work: Path, plan: list[Phase], loss_shift: float = 0.0, stop_after: str = ""
    ) -> None:
        super().__init__()
        self.work, self.by_name = work, {p.name: p for p in plan}
        self.loss_shift, self.stop_after = loss_shift, stop_after
        self.runner: Runner | None = None

    def _weights(self, ref: str) -> str:
        phase, _, epoch = ref.removeprefix("train:").partition("@")
        return str(self.work / phase / (f"e{epoch}" if epoch else "final"))

    async def run(self, phase: Phase) -> dict[str, Any]:
        result = await super().run(phase)
        spec = phase.spec
        if isinstance(spec, TrainSpec):
            result["final"] = self._weights(f"train:{phase.name}")
            result["epoch_weights"] = {
                e: self._weights(f"train:{phase.name}@{e}") for e in result["epoch_weights"]
            }
            result["losses"] = [loss + self.loss_shift for loss in result["losses"]]
            for path in [result["final"], *result["epoch_weights"].values()]:
                Path(path).mkdir(parents=True)  # noqa: ASYNC240 (a fake: no event loop to keep free)
        if isinstance(spec, SelectSpec) and "weights" in result:
            chosen = self.by_name[result["chosen"]].spec
            if isinstance(chosen, EvalSpec) and chosen.model.startswith("train:"):
                result["weights"] = self._weights(chosen.model)
        if phase.name == self.stop_after and self.runner is not None:
            self.runner.deadline = -1.0  # the stage's time box: no later phase starts
        return result


def _stage(cfg: PaperConfig, work: Path, results: Path, **kw: Any) -> tuple[Runner, WritingSteps]:
    runner = Runner(cfg, work, results, 1e18, carried=True)
    steps = WritingSteps(work, runner.state.plan, **kw)
    steps.runner = runner
    asyncio.run(runner.run(steps))
    return runner, steps


def _cfg(small_cfg: PaperConfig) -> PaperConfig:
    return msgspec.structs.replace(small_cfg, rows=["base", "sft", "iwm"], table3=False)


def test_a_fresh_checkout_restores_the_records_and_rebuilds_only_the_weights_it_reads(
    small_cfg: PaperConfig, tmp_path: Path
) -> None:
    """Stage 1 stops after select-sft; its work dir is gone (a new working period, another path).
    Stage 2 restores every record, runs none of them again except the chosen SFT candidate's
    training, once and before the evaluation that serves it (the other candidate's weights are read
    by nothing pending), and records that its losses agree; every phase is then finished and
    carried."""
    cfg, results = _cfg(small_cfg), tmp_path / "results"
    first, _ = _stage(cfg, tmp_path / "w1", results, stop_after="select-sft")
    done_first = set(first.state.phases)
    chosen = first.state.phases["select-sft"]
    trained = chosen["val_phase"].removeprefix("val-").rsplit("-e", 1)[0]
    assert trained in done_first and set(first.state.skipped)
    shutil.rmtree(tmp_path / "w1")

    second, steps = _stage(cfg, tmp_path / "w2", results)
    assert set(second.restored) == done_first
    rerun = [c for c in steps.calls if c in done_first]
    assert rerun == [trained]
    assert steps.calls.index(trained) < steps.calls.index("eval-sft")
    record = second.state.phases[trained]
    [rebuild] = record["rebuilds"]
    assert {k: rebuild[k] for k in ("steps", "max_loss_diff", "agrees", "tol")} == {
        "steps": [2, 2],
        "max_loss_diff": 0.0,
        "agrees": True,
        "tol": 1e-4,
    }
    assert str(tmp_path / "w2") in second.state.phases["select-sft"]["weights"]
    assert not second.state.failed and not second.state.skipped and not second.state.blocked
    carried = state_dir(results, cfg.name)
    assert {p.stem for p in carried.glob("*.json")} >= {p.name for p in second.state.plan} | {
        "protocol"
    }
    assert (
        "$WORK" in (carried / "select-sft.json").read_text()
        and "w2" not in (carried / "select-sft.json").read_text()
    )


def test_a_rebuild_with_other_losses_is_recorded_as_differing(
    small_cfg: PaperConfig, tmp_path: Path
) -> None:
    """Rebuilt weights that train to another loss curve are not taken on trust: the record says
    DIFFERS with the largest difference and the CPU it was rebuilt on, and the report flags it at
    its top (rows trained after it start from the rebuild; another CPU's kernels give other bf16
    losses from step 1)."""
    cfg, results = _cfg(small_cfg), tmp_path / "results"
    _stage(cfg, tmp_path / "w1", results, stop_after="select-sft")
    shutil.rmtree(tmp_path / "w1")
    second, _ = _stage(cfg, tmp_path / "w2", results, loss_shift=0.01)
    rebuilt = [name for name in second.restored if "rebuilds" in second.state.phases[name]]
    assert len(rebuilt) == 1
    agreement = second.state.phases[rebuilt[0]]["rebuilds"][0]
    assert not agreement["agrees"] and abs(agreement["max_loss_diff"] - 0.01) < 1e-9
    on_disk = json.loads((tmp_path / "w2" / rebuilt[0] / "done.json").read_text())
    assert on_disk["rebuilds"] == [agreement]
    assert agreement["host"]["cpu_model"] and "commit" in agreement["host"]
    assert (
        second.state.phases["eval-sft"]["host"] == agreement["host"]
    )  # every phase says where it ran
    md = (results / f"{cfg.report_name}.md").read_text()
    head = md.split("## Protocol")[0]
    assert (
        f"{rebuilt[0]} was rebuilt with another loss curve (largest difference 1.00e-02" in head
    ), head
    assert agreement["host"]["cpu_model"] in head
    after = [n for n, p in second.state.phases.items() if p.get("ended", "") > agreement["ended"]]
    assert "eval-sft" in after and rebuilt[0] not in after and "select-sft" not in after
    assert f"finished after it: {', '.join(sorted(after))})" in head, head


def test_a_dependency_for_the_room_variant_does_not_retrain_the_chosen_sft(tmp_path: Path) -> None:
    """The effect protocol's warm start trains from Base; it depends on ``select-sft`` only for the
    room variant and the demonstration count. A new working period that resumes after ``labels``
    must not retrain the chosen SFT (about 12 minutes a period on 2 cores for weights nothing
    reads): no restored phase runs again, and every later one finishes."""
    from experiments.tests.test_paper_effect import TOML

    (tmp_path / "fx.toml").write_text(TOML, encoding="utf-8")
    cfg, results = load_paper_config(tmp_path / "fx.toml"), tmp_path / "results"
    first, _ = _stage(cfg, tmp_path / "w1", results, stop_after="labels")
    assert "select-sft" in first.state.phases and "warm-train" not in first.state.phases
    shutil.rmtree(tmp_path / "w1")

    second, steps = _stage(cfg, tmp_path / "w2", results)
    assert [c for c in steps.calls if c in second.restored] == []
    assert steps.calls[0] == "warm-train"
    assert not second.state.failed and not second.state.blocked


def test_an_invocation_stopped_before_its_rebuild_finished_rebuilds_it_next_time(
    small_cfg: PaperConfig, tmp_path: Path
) -> None:
    """The first invocation of a new working period restores the records into its work dir and is
    stopped while it rebuilds a training (the period ends). The next invocation finds those records
    on disk, not in the repository: it must still rebuild the training whose weights a pending phase
    reads (it failed that phase with "not an HF model directory" instead, effect-hard)."""
    from experiments.paper.carry import restore_state

    cfg, results = _cfg(small_cfg), tmp_path / "results"
    first, _ = _stage(cfg, tmp_path / "w1", results, stop_after="select-sft")
    trained = first.state.phases["select-sft"]["val_phase"].removeprefix("val-").rsplit("-e", 1)[0]
    shutil.rmtree(tmp_path / "w1")
    assert trained in restore_state(
        tmp_path / "w2", results, cfg.name
    )  # the stopped invocation's restore

    second, steps = _stage(cfg, tmp_path / "w2", results)
    assert second.restored == []
    assert [c for c in steps.calls if c in first.state.phases] == [trained]
    assert steps.calls.index(trained) < steps.calls.index("eval-sft")
    assert second.state.phases[trained]["rebuilds"][0]["agrees"]
    assert not second.state.failed and not second.state.blocked


def test_a_rebuild_in_a_work_dir_given_relative_keeps_its_weights_where_the_record_says(
    small_cfg: PaperConfig, tmp_path: Path, monkeypatch: Any
) -> None:
    """The runner's work dir is relative by default (``runs/paper/<name>``): restored records name
    absolute paths, a training run there returns relative ones. The same directories, so the rebuild
    is recorded (it failed with "rebuilding warm-train wrote its weights elsewhere",
    effect-hard)."""
    cfg, results = _cfg(small_cfg), tmp_path / "results"
    first, _ = _stage(cfg, tmp_path / "w1", results, stop_after="select-sft")
    trained = first.state.phases["select-sft"]["val_phase"].removeprefix("val-").rsplit("-e", 1)[0]
    shutil.rmtree(tmp_path / "w1")
    monkeypatch.chdir(tmp_path)
    second, steps = _stage(cfg, Path("w2"), results)
    assert [c for c in steps.calls if c in first.state.phases] == [trained]
    assert second.state.phases[trained]["rebuilds"][0]["agrees"]
    assert not second.state.failed and not second.state.blocked
    from experiments.paper.carry import moved_weights

    here = {"final": str(tmp_path / "w2" / "t" / "final"), "epoch_weights": {"1": "w2/t/e1"}}
    assert (
        moved_weights(
            here, {"final": "w2/t/final", "epoch_weights": {"1": str(tmp_path / "w2/t/e1")}}
        )
        == []
    )
    assert moved_weights(here, {**here, "final": "w3/t/final"}) == ["final"]
