"""The ``effect`` protocol on harder rooms: ``effect.rooms`` chooses the rows'
room variant with the warm start on validation (never on test), and every row, the audit and GRPO
then run on it; ``effect.inherit`` takes another experiment's warm start (its carried records and
logs) instead of running Stage A again, rebuilds only the weights a phase loads, and refuses a
parent registered with other settings. The committed ``effect`` registration is unchanged by these
options."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from experiments.paper import carry
from experiments.paper.carry import state_dir
from experiments.paper.choices import Choices
from experiments.paper.config import PaperConfig, load_paper_config, scale_path
from experiments.paper.effect import GATE, inherited
from experiments.paper.phases import CollectSpec, EvalSpec, closure
from experiments.paper.plans import plan
from experiments.paper.protocol import check_inherited, protocol_of
from experiments.paper.runner import Runner
from experiments.paper.specs import ROOMS
from experiments.tests.test_paper_carry import WritingSteps
from experiments.tests.test_paper_effect import TOML

ROOMS_TOML = """
[effect.rooms]
long = { max_solution_len = 6, min_solution_len = 4, horizon = 16, history_window = 2 }
two = { num_boxes = 2, max_solution_len = 6, horizon = 16, history_window = 2 }
"""


def _load(tmp_path: Path, text: str, name: str = "fx") -> PaperConfig:
    path = tmp_path / f"{name}.toml"
    path.write_text(text, encoding="utf-8")
    return load_paper_config(path)


def _child(tmp_path: Path, extra: str = "", parent_toml: str = TOML) -> PaperConfig:
    """The fixture experiment on harder rooms, taking ``fx``'s warm start."""
    text = parent_toml.replace('name = "fx"', 'name = "fxh"').replace('"fx_report"', '"fxh_report"')
    text = text.replace("[effect]\n", '[effect]\ninherit = "fx"\n') + ROOMS_TOML + extra
    return _load(tmp_path, text, "fxh")


def test_every_row_runs_on_the_rooms_chosen_with_the_warm_start_on_validation(
    tmp_path: Path,
) -> None:
    """Each candidate is the warm start on its validation slice; ``select-rooms`` needs no test
    result; the audit, both Stage-1 collections, GRPO's collections and validations and every test
    row name the chosen rooms (and so come after the choice); the warm start's own phases keep its
    rooms."""
    cfg = _child(tmp_path)
    phases = plan(cfg)
    by = {p.name: p for p in phases}
    for v in ("long", "two"):
        spec = by[f"val-rooms-{v}"].spec
        assert isinstance(spec, EvalSpec) and (spec.model, spec.split, spec.variant) == (
            "warm",
            "val",
            v,
        )
    assert not any(n.startswith("eval-") for n in closure(phases, ["select-rooms"]))
    after_warm = [p for p in phases if "select-warm" in closure(phases, [p.name]) - {p.name}]
    for p in after_warm:
        if isinstance(p.spec, CollectSpec) or (
            isinstance(p.spec, EvalSpec) and not p.name.startswith("val-rooms")
        ):
            assert p.spec.variant == ROOMS and "select-rooms" in p.deps, p.name
    assert {f"eval-{r}" for r in cfg.rows} <= {p.name for p in after_warm}
    assert by["labels"].spec.variant == "" and "select-rooms" not in closure(
        phases, ["select-warm"]
    )  # type: ignore[union-attr]
    assert GATE in closure(phases, ["eval-warm"]) and "select-rooms" in closure(phases, [GATE])
    assert inherited(cfg) == closure(phases, ["select-warm"])


def _val(pass1: float, passk: float, parse: float = 0.0) -> dict[str, Any]:
    return {"passk": {"1": pass1, "4": passk}, "parse_failure_rate": parse}


def test_select_rooms_takes_a_candidate_with_room_at_large_k(tmp_path: Path) -> None:
    """The rule on validation: ``long`` is too easy at large k (Pass@4 90% > 70%), so ``two``
    (Pass@1 20%, Pass@4 60%) is the rows' rooms, with its options; the warm start's weights are
    named."""
    cfg = _child(tmp_path)
    phases = plan(cfg)
    done = {
        "val-rooms-long": _val(0.45, 0.90),
        "val-rooms-two": _val(0.20, 0.60),
        "select-warm": {"weights": "/w/warm"},
    }
    choices = Choices(cfg, SimpleNamespace(), phases, done.get)  # type: ignore[arg-type]
    spec = next(p.spec for p in phases if p.name == "select-rooms")
    out = choices.select(spec)  # type: ignore[arg-type]
    assert out["variant"] == "two" and out["rule_met"] and out["val_phase"] == "val-rooms-two"
    assert out["env_options"] == dict(cfg.effect.rooms["two"]) and out["weights"] == "/w/warm"
    done["select-rooms"] = out
    assert choices.variant(ROOMS) == "two"
    assert choices.env_options(ROOMS) == {"num_boxes": 2, "max_solution_len": 6}
    assert choices._rollout(ROOMS) == {"horizon": 16, "history_window": 2}


def _parent(tmp_path: Path, results: Path, stop_after: str = "") -> Runner:
    cfg = _load(tmp_path, TOML)
    runner = Runner(cfg, tmp_path / "fx-work", results, 1e18, carried=True)
    steps = WritingSteps(tmp_path / "fx-work", runner.state.plan, stop_after=stop_after)
    steps.runner = runner
    asyncio.run(runner.run(steps))
    return runner


def test_an_inheriting_experiment_runs_no_stage_a_and_rebuilds_the_warm_start(
    tmp_path: Path,
) -> None:
    """The parent's finished warm start is restored, never run again: only its training is rebuilt
    (once, before the first phase that loads the warm start, its losses checked), and every row runs
    on the chosen rooms; the child's records carry the inherited ones too (self-contained next
    period)."""
    results = tmp_path / "results"
    _parent(tmp_path, results, stop_after="select-warm")
    cfg = _child(tmp_path)
    work = tmp_path / "fxh-work"
    runner = Runner(cfg, work, results, 1e18, carried=True)
    steps = WritingSteps(work, runner.state.plan)
    steps.runner = runner
    asyncio.run(runner.run(steps))
    warm = inherited(cfg)
    assert set(runner.restored) == warm
    assert [c for c in steps.calls if c in warm] == ["warm-train"]  # the rebuild, nothing else
    assert steps.calls.index("warm-train") < steps.calls.index("val-rooms-long")
    assert runner.state.phases["warm-train"]["rebuilds"][-1]["agrees"]
    assert all(f"eval-{r}" in runner.state.phases for r in cfg.rows) and not runner.state.blocked
    assert {p.stem for p in state_dir(results, "fxh").glob("*.json")} >= warm | {
        "select-rooms",
        "protocol",
    }
    proto = json.loads((work / "protocol.json").read_text())["protocol"]
    assert proto["effect"]["inherit"] == "fx" and set(proto["effect"]["rooms"]) == {"long", "two"}
    md = (results / "fxh_report.md").read_text()
    assert "The rows' rooms" in md and "Warm start taken from `fx`" in md
    assert (
        "the rows' candidate rooms: 16" in md
    )  # the test's horizon is the chosen rooms', not the base's
    chosen = runner.state.phases["select-rooms"]["val_phase"]
    assert f"| 0 | warm start W ({chosen}) |" in md  # GRPO's round 0: its start on the rows' rooms


def test_an_unfinished_parent_blocks_the_rows_and_says_why(tmp_path: Path) -> None:
    """The parent stopped before its warm start was chosen: the child runs none of the parent's
    phases and nothing after them, and says what is missing."""
    results = tmp_path / "results"
    _parent(tmp_path, results, stop_after="labels")
    cfg = _child(tmp_path)
    runner = Runner(cfg, tmp_path / "fxh-work", results, 1e18, carried=True)
    steps = WritingSteps(tmp_path / "fxh-work", runner.state.plan)
    asyncio.run(runner.run(steps))
    assert not any(c in inherited(cfg) or c.startswith(("val-rooms", "eval-")) for c in steps.calls)
    assert "taken from 'fx'" in runner.state.blocked["warm-train"]
    assert "eval-warm" in runner.state.blocked


def test_a_parent_registered_with_other_settings_is_refused(tmp_path: Path) -> None:
    """The child validates on another slice than the parent's warm start was chosen on: refused,
    naming it; a missing parent registration is refused too."""
    results = tmp_path / "results"
    with pytest.raises(ValueError, match="no registered protocol"):
        Runner(_child(tmp_path), tmp_path / "w0", results, 1e18, carried=True)
    _parent(tmp_path, results, stop_after="demos-w0")
    other = _child(tmp_path, parent_toml=TOML.replace("val_tasks = 2", "val_tasks = 3"))
    with pytest.raises(ValueError, match="differs in validation"):
        Runner(other, tmp_path / "w1", results, 1e18, carried=True)


def test_the_committed_effect_registration_is_unchanged_and_effect_hard_may_inherit_it() -> None:
    """``experiments/configs/paper_effect.toml`` still gives the protocol registered in the
    repository (the options are absent from it), and ``experiments/configs/paper_effect-hard.toml``
    (``extends = "effect"``) agrees with it on the warm start's settings, the same training and
    serving, and has rooms to choose from."""
    results = Path(__file__).resolve().parents[2] / "experiments" / "results"
    registered = json.loads((state_dir(results, "effect") / "protocol.json").read_text())[
        "protocol"
    ]
    effect = load_paper_config(scale_path("effect"))
    assert protocol_of(effect) == registered
    hard = load_paper_config(scale_path("effect-hard"))
    assert check_inherited(results, hard) == registered
    assert (hard.training, hard.serving, hard.warm) == (
        effect.training,
        effect.serving,
        effect.warm,
    )
    assert (
        hard.effect.inherit == "effect"
        and len(hard.effect.rooms) >= 2
        and hard.name == "effect-hard"
    )
    assert all(v["history_window"] == 2 for v in hard.effect.rooms.values())  # W's prompt format


def test_inherited_weights_still_on_this_disk_are_linked_not_trained_again(tmp_path: Path) -> None:
    """A machine that kept the other experiment's work dir (``runs/paper/fx`` beside
    ``runs/paper/fxh``): the warm start's weights are hard-linked from it (same loss curve), not
    trained again; a local record with another loss curve is not trusted, and the training is
    rebuilt from the logs."""
    results, paper = tmp_path / "results", tmp_path / "paper"
    cfg = _load(tmp_path, TOML)
    parent = Runner(cfg, paper / "fx", results, 1e18, carried=True)
    psteps = WritingSteps(paper / "fx", parent.state.plan, stop_after="select-warm")
    psteps.runner = parent
    asyncio.run(parent.run(psteps))
    marker = paper / "fx" / "warm-train" / "e1" / "weights.bin"
    marker.write_bytes(b"w")

    child = _child(tmp_path)
    runner = Runner(child, paper / "fxh", results, 1e18, carried=True)
    steps = WritingSteps(paper / "fxh", runner.state.plan, stop_after="select-rooms")
    steps.runner = runner
    asyncio.run(runner.run(steps))
    assert "warm-train" not in steps.calls and "val-rooms-long" in steps.calls
    linked = paper / "fxh" / "warm-train" / "e1" / "weights.bin"
    assert linked.read_bytes() == b"w" and linked.stat().st_ino == marker.stat().st_ino
    assert runner.state.phases["warm-train"]["rebuilds"][-1]["linked_from"].endswith("fx")

    done = paper / "fx" / "warm-train" / "done.json"
    record = json.loads(done.read_text())
    done.write_text(json.dumps({**record, "losses": [x + 1 for x in record["losses"]]}))
    other = Runner(child, paper / "fxh2", results, 1e18, carried=True)
    steps2 = WritingSteps(paper / "fxh2", other.state.plan, stop_after="select-rooms")
    steps2.runner = other
    asyncio.run(other.run(steps2))
    assert steps2.calls.count("warm-train") == 1


def test_grpo_is_judged_against_the_warm_start_on_the_rows_rooms(tmp_path: Path) -> None:
    """GRPO's round is chosen against its start on the same validation slice: with ``effect.rooms``
    that is the warm start on the chosen rooms (``val-rooms-two``), not on its own rooms
    (``val-warm-e2``)."""
    cfg = _child(tmp_path)
    phases = plan(cfg)
    done = {
        "val-warm-e2": _val(0.30, 0.80),
        "val-rooms-two": _val(0.20, 0.60),
        "select-warm": {"val_phase": "val-warm-e2", "weights": "/w/warm"},
        "select-rooms": {"val_phase": "val-rooms-two", "variant": "two"},
        "grpo-r1-val-lr0": _val(0.25, 0.62),
        "grpo-r1-select": {"chosen": "grpo-r1-val-lr0", "lr": 1e-5, "weights": "/w/r1"},
    }
    choices = Choices(cfg, SimpleNamespace(), phases, done.get)  # type: ignore[arg-type]
    spec = next(p.spec for p in phases if p.name == "select-grpo")
    out = choices.select(spec)  # type: ignore[arg-type]
    assert (
        out["curve"][0]["name"] == "val-rooms-two" and out["beats_start"]
    )  # 25% > 20% (not > 30%)


def test_relative_work_dirs_move_the_inherited_weights_into_this_experiment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As ``paper_table.py`` runs them (``runs/paper/<name>``, relative): the other experiment's
    records name its weights under its own work dir; restored here they name this work dir (the
    servers load only from under it), and the weights still on disk there are linked in, not used in
    place or retrained."""
    monkeypatch.chdir(tmp_path)
    results, paper = Path("results"), Path("runs/paper")
    parent = Runner(_load(tmp_path, TOML), paper / "fx", results, 1e18, carried=True)
    psteps = WritingSteps(paper / "fx", parent.state.plan, stop_after="select-warm")
    psteps.runner = parent
    asyncio.run(parent.run(psteps))
    saved = (state_dir(results, "fx") / "warm-train.json").read_text()
    assert "runs/paper/fx" not in saved and "$WORK/warm-train" in saved  # rooted, portable

    # a record as the committed `effect` state has it: written before relative paths were rooted
    (state_dir(results, "fx") / "warm-train.json").write_text(
        saved.replace("$WORK", "runs/paper/fx")
    )
    (state_dir(results, "fx") / "select-warm.json").write_text(
        (state_dir(results, "fx") / "select-warm.json")
        .read_text()
        .replace("$WORK", "runs/paper/fx")
    )
    child = Runner(_child(tmp_path), paper / "fxh", results, 1e18, carried=True)
    here = (paper / "fxh").resolve()
    assert child.state.phases["select-warm"]["weights"].startswith(str(here))
    assert all(
        str(p).startswith(str(here)) for p in carry.weight_paths(child.state.phases["warm-train"])
    )
    steps = WritingSteps(paper / "fxh", child.state.plan, stop_after="select-rooms")
    steps.runner = child
    asyncio.run(child.run(steps))
    assert (
        "warm-train" not in steps.calls
        and "linked_from" in child.state.phases["warm-train"]["rebuilds"][-1]
    )
    assert Path(child.state.phases["select-warm"]["weights"]).is_dir()
