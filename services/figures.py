"""Run reports: the Pass@k table (markdown), Pass@k curves and one exploration tree (PNG).

Pure functions of results and events; matplotlib runs headless (Agg). Used by ``leafe run``,
``leafe eval`` and ``experiments/paper_table.py``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from leafe.protocol.events import Branch, EpisodeEvent, EpisodeStarted, Outcome, Step

__all__ = ["lag_histogram", "passk_markdown", "plot_curve", "plot_passk", "plot_tree"]


def passk_markdown(table: Mapping[str, Mapping[int, float]], *, title: str = "") -> str:
    """A markdown table, one row per model/method, one column per k (values in %)."""
    ks = sorted({k for row in table.values() for k in row})
    lines = [f"### {title}", ""] if title else []
    lines.append("| model | " + " | ".join(f"Pass@{k}" for k in ks) + " |")
    lines.append("|---|" + "---|" * len(ks))
    for name, row in table.items():
        cells = [f"{100 * row[k]:.1f}" if k in row else "-" for k in ks]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def lag_histogram(cumulative: Mapping[str, float]) -> dict[str, int]:
    """Per-bucket counts (``"0"``, ``"1"``, ``"2-3"``... ``">32"``) from Prometheus' cumulative
    ``..._bucket{le="x"}`` samples."""
    edges: list[tuple[float, float]] = []
    for key, value in cumulative.items():
        le = key.split('le="', 1)[-1].rstrip('"}')
        edges.append((float("inf") if le == "+Inf" else float(le), value))
    out: dict[str, int] = {}
    prev_edge, prev_count = -1.0, 0.0
    for edge, count in sorted(edges):
        lo = int(prev_edge) + 1
        name = (
            f">{int(prev_edge)}"
            if edge == float("inf")
            else (f"{lo}" if lo == int(edge) else f"{lo}-{int(edge)}")
        )
        out[name] = int(count - prev_count)
        prev_edge, prev_count = edge, count
    return out


def _axes() -> tuple[Any, Any]:
    """A headless (Agg) figure and its axes, the size every report figure has."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6, 4))


def _finish(fig: Any, ax: Any, out: Path, *, xlabel: str, ylabel: str, title: str) -> Path:
    """Percent axis 0..100, grid, legend; saved to ``out`` and closed."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_curve(
    points: Sequence[Mapping[str, Any]], out: Path, *, title: str = "Learning curve"
) -> Path:
    """Pass@k and unparseable answers on the validation slice against the learner step."""
    steps = [int(p["learner_step"]) for p in points]
    rows: list[dict[int, float]] = [
        {int(k): float(v) for k, v in p["passk"].items()} for p in points
    ]
    fig, ax = _axes()
    for k in sorted({k for row in rows for k in row}):
        ax.plot(steps, [100 * row.get(k, 0.0) for row in rows], marker="o", label=f"Pass@{k}")
    unparseable = [100 * float(p["parse_failure_rate"]) for p in points]
    ax.plot(steps, unparseable, "k--", marker="x", label="unparseable")
    return _finish(
        fig, ax, out, xlabel="learner step", ylabel="% on the validation slice", title=title
    )


def plot_passk(
    table: Mapping[str, Mapping[int, float]], out: Path, *, title: str = "Pass@k"
) -> Path:
    """Pass@k curves (log2 k on x), one line per model/method."""
    fig, ax = _axes()
    for name, row in table.items():
        ks = sorted(row)
        ax.plot(ks, [100 * row[k] for k in ks], marker="o", label=name)
    ax.set_xscale("log", base=2)
    return _finish(fig, ax, out, xlabel="k", ylabel="Pass@k (%)", title=title)


def plot_tree(events: Sequence[EpisodeEvent], out: Path) -> Path:
    """One episode's exploration tree: a lane per branch, steps as dots, rollbacks as vertical links
    from the parent's step tau, green/red by outcome, the experience e printed beside each
    branch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    started = next((e for e in events if isinstance(e, EpisodeStarted)), None)
    branches: dict[str, Branch | None] = {"b0": None}
    steps: dict[str, list[Step]] = {}
    outcomes: dict[str, Outcome] = {}
    for e in events:
        if isinstance(e, Branch):
            branches[e.branch_id] = e
        elif isinstance(e, Step):
            steps.setdefault(e.branch_id, []).append(e)
        elif isinstance(e, Outcome):
            outcomes[e.branch_id] = e
    lane = {b: i for i, b in enumerate(branches)}
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.7 * len(lane)))
    for b, y in lane.items():
        oc = outcomes.get(b)
        color = "tab:green" if oc and oc.success else ("tab:red" if oc else "tab:gray")
        ts = [s.t for s in steps.get(b, [])]
        br = branches[b]
        if br is not None:
            ax.plot(
                [br.tau - 0.5, br.tau - 0.5], [lane[br.parent_branch_id], y], color="tab:blue", lw=1
            )
            ax.plot([br.tau - 0.5, br.tau], [y, y], color="tab:blue", lw=1)
            label = textwrap.shorten(f"e: {br.experience}", 70)
            ax.annotate(label, (max(ts, default=br.tau) + 0.6, y), fontsize=7, va="center")
        if ts:
            ax.plot(ts, [y] * len(ts), "-o", color=color, ms=4)
            for s in steps[b]:
                if s.action is None:
                    ax.plot([s.t], [y], "x", color="black", ms=6)
    ax.set_yticks(list(lane.values()), list(lane))
    ax.invert_yaxis()
    ax.set_xlabel("step t")
    name = f"{started.task_id} ({started.episode_id})" if started else "episode"
    ax.set_title(f"Exploration tree: {name}", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
