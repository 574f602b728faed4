"""Unit tests of learner/offline.py and ``leafe train`` (services/learner/train.py) on one rank."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from leafe.learner.config import TrainConfig, train_preset
from leafe.learner.offline import iter_batches, read_samples, steps_per_epoch
from leafe.services.config import load_config
from tests.support.learner import make_samples, write_shards

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(batches: list) -> list[list[str]]:
    return [[s.sample_id for s in b.samples] for b in batches]


@pytest.mark.parametrize("bare", [False, True])
def test_shards_round_trip(tmp_path: Path, bare: bool) -> None:
    """Samples written as a dataset (manifest) or as bare JSONL shards read back identical, in
    order."""
    samples = make_samples(10)
    write_shards(tmp_path / "d", samples, per_shard=4, bare=bare)
    assert read_samples(tmp_path / "d") == samples


def test_a_modified_dataset_shard_is_refused(tmp_path: Path) -> None:
    """A shard that no longer matches the dataset manifest's sha256 is an error naming the file."""
    from leafe.learner.dataset import DatasetError

    d = write_shards(tmp_path / "d", make_samples(3))
    with (d / "samples-00000.jsonl").open("a") as f:
        f.write("\n")
    with pytest.raises(DatasetError, match=r"samples-00000\.jsonl"):
        read_samples(d)


def test_a_bad_line_is_reported_with_file_and_line(tmp_path: Path) -> None:
    """A corrupt line of a bare shard raises an error naming the file and line number."""
    d = write_shards(tmp_path / "d", make_samples(3), bare=True)
    with (d / "shard-00000.jsonl").open("a") as f:
        f.write('{"not": "a sample"}\n')
    with pytest.raises(ValueError, match=r"shard-00000.jsonl:4"):
        read_samples(d)


def test_epochs_reshuffle_and_resume_continues_the_same_order() -> None:
    """Each epoch is a seeded permutation; resuming from (epoch, position) yields exactly the
    rest."""
    samples = make_samples(10)
    cfg = load_config(
        TrainConfig,
        preset=train_preset("cpu"),
        overrides={"epochs": 2, "trainer.batch.global_batch": 4},
    )
    full = list(iter_batches(samples, cfg))
    assert [len(b.samples) for b in full] == [4, 4, 2, 4, 4, 2]
    assert steps_per_epoch(10, 4, drop_last=False) == 3
    assert sorted(_ids(full[:3])[0] + _ids(full[:3])[1] + _ids(full[:3])[2]) == sorted(
        s.sample_id for s in samples
    )
    assert _ids(full[:3]) != _ids(full[3:])
    resumed = list(
        iter_batches(samples, cfg, start_epoch=full[1].epoch, start_position=full[1].position)
    )
    assert _ids(resumed) == _ids(full[2:])
    done_epoch = list(iter_batches(samples, cfg, start_epoch=0, start_position=10))
    assert _ids(done_epoch) == _ids(full[3:])


def test_leafe_train_runs_resumes_and_exports(dist_env, tiny_dir: Path, tmp_path: Path) -> None:
    """`leafe train` trains every batch of every epoch, writes metrics (and each step's loss to
    TensorBoard), checkpoints and a final export; a second invocation on the same --out resumes at
    the end and trains nothing more."""
    from leafe.learner.model_io import verify_manifest
    from leafe.learner.offline import train

    data = write_shards(tmp_path / "data", make_samples(12))
    overrides = {
        "epochs": 2,
        "trainer": {"batch": {"global_batch": 8}, "checkpoint_every": 1, "push_every": 2},
    }
    cfg = load_config(TrainConfig, preset=train_preset("cpu"), overrides=overrides)
    out = tmp_path / "out"
    result = train(cfg, data, str(tiny_dir), out, dist_env, tensorboard_dir=out / "tb")
    assert result.steps == 4
    assert verify_manifest(out / "final", result.final_sha256) is not None
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["v000002", "v000004"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["samples"] for m in metrics] == [8, 4, 8, 4]
    if importlib.util.find_spec("tensorboard") is not None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(out / "tb"))
        acc.Reload()
        losses = [(e.step, e.value) for e in acc.Scalars("loss/total")]
        assert losses == [(m["step"], pytest.approx(m["loss"], rel=1e-6)) for m in metrics]
    again = train(cfg, data, str(tiny_dir), out, dist_env)
    assert again.steps == 4 and again.last_loss is None


def test_a_training_killed_after_a_checkpoint_resumes_to_the_same_weights(
    dist_env, tiny_dir: Path, tmp_path: Path
) -> None:
    """What a paper-table phase cut by the end of a working period relies on: a `leafe train` killed
    after its step-2 checkpoint (emulated: only that checkpoint survives) resumes there, mid-epoch,
    and exports bit-identical weights to the run that was never interrupted."""
    import shutil

    from leafe.learner.offline import train

    data = write_shards(tmp_path / "data", make_samples(12))
    overrides = {
        "epochs": 2,
        "trainer": {"batch": {"global_batch": 4}, "checkpoint_every": 1, "keep_checkpoints": 9},
    }
    cfg = load_config(TrainConfig, preset=train_preset("cpu"), overrides=overrides)
    whole = train(cfg, data, str(tiny_dir), tmp_path / "whole", dist_env)
    assert whole.steps == 6
    cut = tmp_path / "cut" / "checkpoints"
    cut.mkdir(parents=True)
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step_00000002", cut / "step_00000002")
    resumed = train(cfg, data, str(tiny_dir), tmp_path / "cut", dist_env)
    assert resumed.steps == 6
    assert resumed.final_sha256 == whole.final_sha256


def test_a_run_asked_to_stop_checkpoints_its_last_step_and_resumes_to_the_same_weights(
    dist_env, tiny_dir: Path, tmp_path: Path
) -> None:
    """``stop`` (what SIGTERM sets in ``leafe train``) ends the run before its next step, with a
    checkpoint of the steps taken though none was due and no export; the rerun resumes there and
    exports the weights of the run never stopped. A stop asked during the last step changes nothing:
    that run exports."""
    from leafe.learner.checkpoint import latest_checkpoint
    from leafe.learner.offline import train

    data = write_shards(tmp_path / "data", make_samples(12))
    overrides = {"epochs": 2, "trainer": {"batch": {"global_batch": 4}, "checkpoint_every": 100}}
    cfg = load_config(TrainConfig, preset=train_preset("cpu"), overrides=overrides)
    whole = train(cfg, data, str(tiny_dir), tmp_path / "whole", dist_env)
    assert whole.steps == 6 and not whole.stopped

    asked = []

    def stop_after_two() -> bool:
        asked.append(1)
        return len(asked) > 2

    out = tmp_path / "stopped"
    stopped = train(cfg, data, str(tiny_dir), out, dist_env, stop=stop_after_two)
    assert (stopped.steps, stopped.stopped, stopped.final_dir) == (2, True, "")
    assert latest_checkpoint(out / "checkpoints").name == "step_00000002"  # type: ignore[union-attr]
    assert not (out / "final").exists()
    resumed = train(cfg, data, str(tiny_dir), out, dist_env)
    assert (resumed.steps, resumed.stopped) == (6, False)
    assert resumed.final_sha256 == whole.final_sha256

    late_out = tmp_path / "late"

    def stop_once_the_last_step_trained() -> bool:  # set while step 6 trains: seen only after it
        metrics = late_out / "metrics.jsonl"
        return metrics.is_file() and len(metrics.read_text().splitlines()) >= 6

    late = train(cfg, data, str(tiny_dir), late_out, dist_env, stop=stop_once_the_last_step_trained)
    assert (late.steps, late.stopped) == (6, False) and late.final_sha256 == whole.final_sha256
