"""The figures the docs quote come from their results files, not from memory: the README's
results table (each cell from the JSON beside the ``.md`` its row links), the registered online
comparison in ``docs/experiments.md`` (``experiments/results/online_paper.json`` and each run's
``report.json``) and the online effect figures that ``docs/experiments.md`` and ``CHANGELOG.md``
quote. A figure that drifts from the file it reports fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"


def _section() -> str:
    text = (ROOT / "docs" / "experiments.md").read_text(encoding="utf-8")
    start = text.index("## The registered online comparison")
    return text[start : text.index("\n## ", start + 5)]


def _report(run: str) -> dict:
    return json.loads((RESULTS / "online_paper" / run / "report.json").read_text(encoding="utf-8"))


def _table_row(section: str, label: str) -> list[str]:
    line = next(x for x in section.splitlines() if x.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_the_throughput_table_is_the_runs_reports() -> None:
    """Learner steps, samples, pushes, lag and stale samples of each run, as its report says."""
    section = _section().split("**Throughput**", 1)[1]
    summary = json.loads((RESULTS / "online_paper.json").read_text(encoding="utf-8"))["throughput"]
    for run, label in (("leafe", "online LEAFE"), ("grpo", "online GRPO")):
        report, thr = _report(run), summary[f"online-paper-{run}"]
        cells = _table_row(section, label)
        assert int(cells[1]) == report["run"]["learner_step"], label
        counts = dict(re.findall(r"(\w+) ([\d,]+)", cells[2]))
        assert {k: int(v.replace(",", "")) for k, v in counts.items()} == report["run"][
            "samples"
        ], label
        assert int(cells[3]) == round(thr["samples_per_min"]) and int(cells[4]) == thr["pushes"], (
            label
        )
        assert (
            float(cells[5]) == thr["mean_policy_lag"]
            and int(cells[6].replace(",", "")) == thr["stale_dropped"]
        )


def test_round_times_curves_and_warm_starts_are_the_reports() -> None:
    """GRPO's full rounds (min-max minutes), LEAFE's validation Pass@4 drop after round 0, and both
    warm starts' seconds, as the reports say."""
    section = " ".join(_section().split())
    grpo, leafe = _report("grpo"), _report("leafe")
    full = [r["wall_s"] / 60 for r in grpo["rounds"] if r["finished"]]
    assert f"({min(full):.1f}-{max(full):.1f} min each)" in section
    curve = leafe["curve"]
    drop = 100 * (curve[0]["passk"]["4"] - curve[1]["passk"]["4"])
    assert f"dropped {drop:.1f} points after round 0" in section
    for run, report in (("LEAFE", leafe), ("GRPO", grpo)):
        assert f"{run} warm start took {report['timings']['warm_start']:.0f} s" in section


def test_the_online_effect_hard_figures_are_the_results_file() -> None:
    """The online LEAFE half of the online effect comparison, as ``CHANGELOG.md`` and
    ``docs/experiments.md`` quote it: its Pass@1/Pass@16, its samples and its paired difference to W
    at k = 16, from ``experiments/results/online_effect_hard.json``."""
    data = json.loads((RESULTS / "online_effect_hard.json").read_text(encoding="utf-8"))
    run = "online-effect-hard-leafe"
    passk = data["rows"][run]["passk"]
    pair = next(
        p for p in data["pairs"] if p["a"] == run and p["b"] == "offline-warm" and p["k"] == 16
    )
    at16 = f"{100 * pair['diff']:.1f} [{100 * pair['lo']:.1f}, {100 * pair['hi']:.1f}]"
    samples = data["throughput"][run]["samples"]
    docs = " ".join((ROOT / "docs" / "experiments.md").read_text(encoding="utf-8").split())
    changelog = " ".join((ROOT / "CHANGELOG.md").read_text(encoding="utf-8").split())
    for text in (docs, changelog):
        assert (
            f"Pass@1 {100 * passk['1']:.1f}" in text and f"Pass@16 {100 * passk['16']:.1f}" in text
        )
        assert f"{at16} at k = 16" in text
    assert f"{samples['cf']} cf and {samples['reh']} reh samples" in docs


def test_the_online_verdict_leafe_against_grpo_is_the_results_file() -> None:
    """Item 7's verdict as ``CHANGELOG.md`` and ``docs/experiments.md`` quote it: online GRPO's
    Pass@1/Pass@16 (its final evaluation taken standalone, in chunks) and LEAFE - GRPO at k = 1 and
    16, from ``experiments/results/online_effect_hard.json``."""
    data = json.loads((RESULTS / "online_effect_hard.json").read_text(encoding="utf-8"))
    leafe, grpo = "online-effect-hard-leafe", "online-effect-hard-grpo"
    assert data["rows"][grpo]["source"].startswith("standalone leafe eval in 8 chunks")
    passk = data["rows"][grpo]["passk"]

    def pair(k: int) -> str:
        p = next(p for p in data["pairs"] if (p["a"], p["b"], p["k"]) == (leafe, grpo, k))
        return f"{100 * p['diff']:.1f} [{100 * p['lo']:.1f}, {100 * p['hi']:.1f}]"

    docs = " ".join((ROOT / "docs" / "experiments.md").read_text(encoding="utf-8").split())
    changelog = " ".join((ROOT / "CHANGELOG.md").read_text(encoding="utf-8").split())
    for text in (docs, changelog):
        assert (
            f"online GRPO (Pass@1 {100 * passk['1']:.1f}, Pass@16 {100 * passk['16']:.1f})" in text
        )
        assert f"LEAFE - GRPO {pair(1)} at k = 1 and {pair(16)} at k = 16" in text


README_ROWS = {
    ("paper_table", "LEAFE (model's e) - GRPO"): ("leafe", "grpo"),
    ("paper_table", "LEAFE (model's e) - rehearsal alone"): ("leafe", "reh"),
    ("effect_hard_table", "LEAFE (oracle's e) - rehearsal alone"): ("leafe-oracle", "reh-oracle"),
    ("effect_hard_table", "LEAFE (model's e) - rehearsal alone"): ("leafe", "reh"),
    ("effect_hard_table", "LEAFE (oracle's e) - GRPO"): ("leafe-oracle", "grpo"),
    ("online_effect_hard", "online LEAFE (model's e) - online GRPO, 35 min each"): (
        "online-effect-hard-leafe",
        "online-effect-hard-grpo",
    ),
}
"""The README's results rows: (results file, row label) -> the compared rows (a, b) in its JSON."""


def _readme_results_rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## Results")
    section = text[start : text.index("\n## ", start + 5)]
    lines = [x for x in section.splitlines() if x.startswith("| ")]
    assert lines and lines[0].startswith(
        "| comparison (a - b) | rooms, test tasks x samples | Pass@1 |"
    )
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[1:]]


def _interval(c: dict) -> str:
    return f"{100 * c['diff']:+.1f} [{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}]"


def test_the_readme_results_table_is_the_results_files() -> None:
    """Each row's Pass@1 and Pass@16 difference and interval equal the comparison in the JSON beside
    the results file the row links; every row is one this test knows, and each links a file that
    exists."""
    rows = _readme_results_rows()
    assert len(rows) == len(README_ROWS), [r[0] for r in rows]
    for label, _rooms, at1, at16, link in rows:
        match = re.fullmatch(r"\[[^\]]+\]\((experiments/results/([\w-]+)\.md)\)", link)
        assert match, f"{label}: the results cell {link!r} links no experiments/results/*.md"
        path, stem = match.groups()
        assert (ROOT / path).is_file(), f"{label}: {path} does not exist"
        assert (stem, label) in README_ROWS, f"{label} ({stem}): a row this test does not know"
        a, b = README_ROWS[(stem, label)]
        data = json.loads((RESULTS / f"{stem}.json").read_text(encoding="utf-8"))
        comparisons = data.get("comparisons") or data["pairs"]
        for k, cell in ((1, at1), (16, at16)):
            found = [c for c in comparisons if (c["a"], c["b"], c["k"]) == (a, b, k)]
            assert len(found) == 1, f"{label}: {a} - {b} at k = {k} is not once in {stem}.json"
            assert cell == _interval(found[0]), f"{label}, Pass@{k}: README {cell}, {stem}.json"
