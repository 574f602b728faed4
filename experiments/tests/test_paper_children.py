"""Dataset filtering and per-epoch weights of the paper table's training children
(``experiments/paper/children.py``)."""

from __future__ import annotations

from pathlib import Path

from experiments.paper.children import epoch_weights, filter_samples, kind_counts
from tests.support.learner import make_samples, write_shards


def test_filter_keeps_the_asked_kinds_of_the_asked_tasks(tmp_path: Path) -> None:
    """L_reh only keeps ``reh``; an SFT candidate keeps the samples of its first n demonstration
    tasks."""
    src = write_shards(tmp_path / "src", make_samples(28, kinds=("cf", "reh")))
    assert filter_samples(src, tmp_path / "reh", kinds=["reh"]) == 14
    assert kind_counts(tmp_path / "reh") == {"reh": 14}
    n = filter_samples(src, tmp_path / "two", task_ids=["toy/0", "toy/1"])
    assert n == 8 and kind_counts(tmp_path / "two") == {"cf": 4, "reh": 4}
    assert filter_samples(src, tmp_path / "none", kinds=["cf"], task_ids=["toy/9"]) == 0


def test_epoch_weights_name_the_export_after_each_epoch(tmp_path: Path) -> None:
    """20 samples at batch 8 = 3 steps per epoch: epoch 1 is v000003, epoch 2 v000006, the last
    ``final``; a step cap that ends the training earlier makes every later epoch the final
    weights."""
    assert epoch_weights(tmp_path, 20, 8, 1, 3) == tmp_path / "weights" / "v000003"
    assert epoch_weights(tmp_path, 20, 8, 2, 3) == tmp_path / "weights" / "v000006"
    assert epoch_weights(tmp_path, 20, 8, 3, 3) == tmp_path / "final"
    assert epoch_weights(tmp_path, 20, 8, 2, 3, max_steps=5) == tmp_path / "final"


def test_a_training_cut_short_resumes_and_counts_each_step_once(
    tmp_path: Path, monkeypatch
) -> None:
    """A training phase asks ``leafe train`` for periodic checkpoints (so a phase cut by the end of
    a working period resumes there) and reads its step records once per step: the first attempt
    logged steps 1-3 before it was killed, the resumed one steps 3-4 (step 3 again, from the
    checkpoint at 2); the record is steps 1-4 with the resumed attempt's step 3. On today's main the
    table said ``checkpoint_every = 0`` and the record listed 5 steps."""
    import asyncio
    import json
    import tomllib

    from experiments.paper import children

    out = tmp_path / "train"

    async def fake_leafe(
        args: list[str], log_file: Path, threads: int, grace_s: float = 10.0
    ) -> None:
        rows = [(1, 3.0), (2, 2.0), (3, 1.5), (3, 1.25), (4, 1.0)]
        (out / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "loss": x, "samples": 8}) + "\n" for s, x in rows)
        )
        (out / "final").mkdir(parents=True)
        (out / "final" / "manifest.json").write_text("{}")

    monkeypatch.setattr(children, "_leafe", fake_leafe)
    got = asyncio.run(
        children.train(
            data=tmp_path / "data",
            model="m",
            out=out,
            preset="cpu",
            lr=1e-5,
            epochs=1,
            beta=None,
            samples=32,
            trainer={"precision": "bf16"},
            export_epochs=False,
            threads=1,
            keep_checkpoints=False,
            checkpoint_every=2,
        )
    )
    table = tomllib.loads((out / "train.toml").read_text())["trainer"]
    assert table["checkpoint_every"] == 2 and table["keep_checkpoints"] == 1
    assert (
        got["steps"] == 4
        and got["losses"] == [3.0, 2.0, 1.25, 1.0]
        and got["trained_samples"] == 32
    )
    assert children.step_records(tmp_path / "absent.jsonl") == []


def test_a_child_killed_by_a_signal_is_named_so(tmp_path: Path, monkeypatch) -> None:
    """The GRPO training of the effect-hard run was OOM-killed; its error said ``exited -9`` and the
    report showed only the middle of the log. A child's exit now names the signal, and SIGKILL
    points at the out-of-memory killer."""
    import asyncio

    import pytest

    from experiments.paper import children

    async def killed(
        cmd: list[str], log_file: Path, env: dict[str, str], grace_s: float = 10.0
    ) -> int:
        log_file.write_text("step 1120\n" * 400)  # noqa: ASYNC240 (a fake)
        return -9

    monkeypatch.setattr(children, "run_logged", killed)
    with pytest.raises(RuntimeError) as err:
        asyncio.run(children._leafe(["train", "--data", "d"], tmp_path / "train.log", 2))
    first = str(err.value).splitlines()[0]
    assert first.startswith(
        "leafe train was killed by SIGKILL (the kernel's out-of-memory killer"
    ), first
    assert children.exit_description(3) == "exited 3"
    assert children.exit_description(-15) == "was killed by SIGTERM"
    assert "stopped by a signal after checkpointing its last step" in children.exit_description(75)
