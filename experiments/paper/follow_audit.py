"""Does the policy act on its experience? The follow rate at the exact prompt a counterfactual uses.

For every oracle verdict that names an action in an explore log
(``leafe.learner.materializers.follow. follow_probes``: the history at the oracle's tau, its e, the
move X it names, the move the branch took there), the policy is sampled ``samples`` times at the
same state under each condition:

| condition | prompt | what it measures |
|---|---|---|
| ``oracle`` | history at tau + the oracle's e (a branch's first prompt) | follow rate: X's share |
| ``none`` | the same history without e (the cf sample's input) | X's share without being told |
| ``placebo`` | the oracle's e, X replaced by another move Y | does e's *content* steer? Y's share |
| ``own`` | a model reflection's own tau and e (labelled logs) | does the model act on its own e? |
| ``direction`` | the oracle's e with X as a compass direction | X without the word X to copy |
| ``box`` | the oracle's e naming the box X pushes by its position | X from the box, not a word |
| ``mistake`` | the oracle's e without its fix clause | off the blamed move, onto X untold? |

The last three (``experiments/paper/follow_probe.py``) do not reward copying: W was trained on
(e -> the move e names), so X's share with the oracle's e may be the last move word copied.

The follow rate counts as acting on e only against ``none`` at the same states; a placebo that moves
the choice to Y the way the oracle's e moves it to X shows the model reads the named move, not just
the presence of text. Shares carry a 95% bootstrap interval over verdicts (the samples of one state
are not independent). Results: ``<out>.json``, ``<out>.md``, ``<out>.png`` and one record per
sampled answer, ``<out>_records.jsonl`` (gzip above 2 MB), from which every share can be recounted.

    .venv/bin/python -m experiments.paper.follow_audit LOG.leafelog.gz --model DIR \
        --out experiments/results/follow_audit
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from experiments.paper.follow_probe import PROBES, rewrites
from leafe.actors.engine import Engine, SamplingParams
from leafe.actors.parsing import parse_action
from leafe.learner.materializers.follow import FollowMaterializer, FollowProbe, follow_probes
from leafe.learner.materializers.tree import EpisodeTree
from leafe.protocol.events import EpisodeStarted, Step
from leafe.protocol.prompt import ChatTokenizer, HistoryEntry, render_messages
from leafe.protocol.samples import Sample
from leafe.services.eventlog.fileformat import read_events

__all__ = [
    "CONDITIONS",
    "AuditItem",
    "answer_records",
    "audit_items",
    "audit_phase",
    "run_audit",
    "summarize",
    "write_records",
    "write_report",
]

CONDITIONS = ("oracle", "none", "placebo", "own", *PROBES)
"""Appended only (a condition's sampling seed is its index)."""


@dataclass
class AuditItem:
    """One verdict's state and the answers sampled there, per condition."""

    episode_id: str
    task_id: str
    named: str
    """X: the move the oracle's e names."""
    blamed: str | None
    """The move the branch took at tau (what e corrects)."""
    placebo: str
    """Y: the move the placebo e names instead of X (empty: e does not spell X out, no placebo)."""
    own_named: str
    """The move the model's own e names ("" when it names none or there is no model reflection)."""
    prompts: dict[str, list[int]] = field(default_factory=dict)
    """Condition -> prompt ids (conditions that do not apply are absent)."""
    answers: dict[str, list[str | None]] = field(default_factory=dict)
    """Condition -> the parsed action of every sample (``None``: unparseable)."""


class _ProbeFold(FollowMaterializer):
    """The follow fold, keeping the probes (with their episode's start) instead of making
    samples."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        super().__init__(tokenizer)
        self.found: list[tuple[EpisodeStarted, FollowProbe]] = []

    def _on_finished(self, tree: EpisodeTree) -> list[Sample]:
        probes, _ = follow_probes(tree)
        self.found += [(tree.started, p) for p in probes]
        return []


def _named_move(text: str, actions: Sequence[str]) -> str:
    """The last of ``actions`` an experience names in "move X" form ("" when none)."""
    words = "|".join(re.escape(a) for a in actions)
    found = re.findall(rf"\bmove ({words})\b", text, flags=re.IGNORECASE)
    return found[-1].lower() if found else ""


def _placebo(
    e: str, named: str, blamed: str | None, actions: Sequence[str], rng: random.Random
) -> tuple[str, str]:
    """e with its named move replaced by another (not the blamed one where possible); ("", "") when
    e does not spell the named move out as "move X"."""
    if not re.search(rf"\bmove {re.escape(named)}\b", e):
        return "", ""
    others = [a for a in actions if a not in (named, blamed)] or [a for a in actions if a != named]
    y = rng.choice(sorted(others))
    head, _, tail = e.rpartition(f"move {named}")
    return f"{head}move {y}{tail}", y


def _prompt(
    tok: ChatTokenizer, s: EpisodeStarted, prefix: list[Step], observation: str, e: str | None
) -> list[int]:
    history = [HistoryEntry(x.action, x.raw_text, x.observation, x.feedback) for x in prefix]
    messages = render_messages(
        instructions=s.instructions,
        task=s.task,
        history=history,
        observation=observation,
        experience=e,
        history_window=s.history_window,
    )
    return tok.encode_chat(messages, s.response_prefix)


def audit_items(
    log: Path, tok: ChatTokenizer, actions: Sequence[str], *, seed: int = 0
) -> list[AuditItem]:
    """Every verdict naming one of ``actions`` in ``log``, with its prompts under each condition."""
    fold = _ProbeFold(tok)
    for event in read_events(log):
        fold.apply(event)
    fold.close_all()
    rng = random.Random(seed)
    items = []
    for started, p in fold.found:
        if p.action not in actions:
            continue
        y_e, y = _placebo(p.experience, p.action, p.blamed, actions, rng)
        model_e = p.reflection.experience if p.reflection.source == "model" else ""
        item = AuditItem(
            episode_id=started.episode_id,
            task_id=started.task_id,
            named=p.action,
            blamed=p.blamed,
            placebo=y,
            own_named=_named_move(model_e, actions),
        )
        item.prompts["oracle"] = _prompt(tok, started, p.prefix, p.observation, p.experience)
        item.prompts["none"] = _prompt(tok, started, p.prefix, p.observation, None)
        if y_e:
            item.prompts["placebo"] = _prompt(tok, started, p.prefix, p.observation, y_e)
        if p.own_prefix is not None and model_e:
            own_obs = p.own_prefix[-1].observation if p.own_prefix else started.observation
            item.prompts["own"] = _prompt(tok, started, p.own_prefix, own_obs, model_e)
        for probe, text in rewrites(p.experience, p.action, p.observation).items():
            item.prompts[probe] = _prompt(tok, started, p.prefix, p.observation, text)
        items.append(item)
    return items


async def run_audit(
    engine: Engine,
    items: list[AuditItem],
    *,
    samples: int,
    params: SamplingParams,
    response_prefix: str,
    actions: Sequence[str],
    seed: int = 0,
    concurrency: int = 16,
) -> None:
    """Sample every item's prompts ``samples`` times each (seeded), filling ``item.answers``."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, item: AuditItem, condition: str) -> None:
        ids = item.prompts[condition]
        p = msgspec.structs.replace(
            params, sampling_seed=seed + 7919 * i + CONDITIONS.index(condition)
        )
        async with gate:
            outs = await engine.generate(ids, p, n=samples)
        item.answers[condition] = [
            parse_action(response_prefix + o.text, actions).action for o in outs
        ]

    await asyncio.gather(*(one(i, it, c) for i, it in enumerate(items) for c in it.prompts))


def _share(
    items: list[AuditItem], condition: str, target: str, rng: random.Random
) -> dict[str, Any]:
    """Share of answers equal to each item's ``target`` field under ``condition``, with a 95%
    bootstrap interval over items."""
    rows = [
        (sum(a == getattr(it, target) for a in it.answers[condition]), len(it.answers[condition]))
        for it in items
        if condition in it.answers and getattr(it, target)
    ]
    if not rows:
        return {"items": 0}
    hits, total = sum(h for h, _ in rows), sum(n for _, n in rows)
    draws = []
    for _ in range(2000):
        pick = [rows[rng.randrange(len(rows))] for _ in rows]
        draws.append(sum(h for h, _ in pick) / max(1, sum(n for _, n in pick)))
    draws.sort()
    return {
        "items": len(rows),
        "share": round(hits / total, 4),
        "interval": [round(draws[49], 4), round(draws[1949], 4)],
    }


def summarize(items: list[AuditItem], *, gate: float) -> dict[str, Any]:
    """The audit's figures (see the module docstring); ``gate`` is the required follow rate."""
    rng = random.Random(0)
    unparseable = {
        c: round(
            sum(a is None for it in items for a in it.answers.get(c, []))
            / max(1, sum(len(it.answers.get(c, [])) for it in items)),
            4,
        )
        for c in CONDITIONS
    }
    out: dict[str, Any] = {
        "verdicts": len(items),
        "named_with_oracle_e": _share(items, "oracle", "named", rng),
        "named_without_e": _share(items, "none", "named", rng),
        "named_with_placebo_e": _share(items, "placebo", "named", rng),
        "placebo_move_with_placebo_e": _share(items, "placebo", "placebo", rng),
        "placebo_move_without_e": _share(items, "none", "placebo", rng),
        "blamed_with_oracle_e": _share(items, "oracle", "blamed", rng),
        "blamed_without_e": _share(items, "none", "blamed", rng),
        "own_e_names_a_move": sum(bool(it.own_named) for it in items if "own" in it.answers),
        "own_named_with_own_e": _share(items, "own", "own_named", rng),
        "named_with_direction_e": _share(items, "direction", "named", rng),
        "named_with_box_e": _share(items, "box", "named", rng),
        "named_with_mistake_e": _share(items, "mistake", "named", rng),
        "blamed_with_mistake_e": _share(items, "mistake", "blamed", rng),
        "unparseable": unparseable,
    }
    follow = out["named_with_oracle_e"].get("share", 0.0)
    base = out["named_without_e"].get("share", 0.0)
    out["gate"] = {
        "threshold": gate,
        "follow_rate": follow,
        "without_e": base,
        "passed": bool(items) and follow >= gate and follow > base,
    }
    return out


def write_report(summary: dict[str, Any], out: Path, *, title: str) -> None:
    """``<out>.json`` (the figures), ``<out>.md`` (a table) and ``<out>.png`` (shares per
    condition)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    rows = [
        ("X (the oracle's move), e in context", "named_with_oracle_e"),
        ("X, no e (the cf input)", "named_without_e"),
        ("X, placebo e naming Y", "named_with_placebo_e"),
        ("Y, placebo e naming Y", "placebo_move_with_placebo_e"),
        ("Y, no e", "placebo_move_without_e"),
        ("the blamed move, e in context", "blamed_with_oracle_e"),
        ("the blamed move, no e", "blamed_without_e"),
        ("the move the model's own e names, own e in context", "own_named_with_own_e"),
        ("X, e naming X as a compass direction", "named_with_direction_e"),
        ("X, e naming the box X pushes by its position", "named_with_box_e"),
        ("X, e naming the mistake only", "named_with_mistake_e"),
        ("the blamed move, e naming the mistake only", "blamed_with_mistake_e"),
    ]
    lines = [
        f"# {title}",
        "",
        f"{summary['verdicts']} oracle verdicts that name a move; shares of sampled answers "
        "(95% bootstrap interval over verdicts).",
        "",
        "| chosen move, condition | verdicts | share | interval |",
        "|---|---|---|---|",
    ]
    for label, key in rows:
        r = summary.get(key, {})
        if r.get("items"):
            lo, hi = r["interval"]
            lines.append(
                f"| {label} | {r['items']} | {100 * r['share']:.1f}% | [{100 * lo:.1f}, "
                f"{100 * hi:.1f}] |"
            )
    g = summary["gate"]
    verdict = "PASSED" if g["passed"] else "NOT MET"
    lines += [
        "",
        f"Gate: the oracle's move in >= {100 * g['threshold']:.0f}% of answers with e, and above "
        "its share "
        f"without e: {100 * g['follow_rate']:.1f}% vs {100 * g['without_e']:.1f}%: **{verdict}**.",
        f"Unparseable answers per condition: {summary['unparseable']}.",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    shown = [(label, summary[key]) for label, key in rows[:5] if summary[key].get("items")]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.barh(
        [x[0] for x in shown][::-1],
        [100 * x[1]["share"] for x in shown][::-1],
        xerr=[
            [100 * (x[1]["share"] - x[1]["interval"][0]) for x in shown][::-1],
            [100 * (x[1]["interval"][1] - x[1]["share"]) for x in shown][::-1],
        ],
    )
    ax.axvline(100 * g["threshold"], linestyle="--", color="gray")
    ax.set_xlabel("% of sampled answers")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)


def answer_records(items: list[AuditItem]) -> list[dict[str, Any]]:
    """One record per sampled answer: the verdict's state, the condition, the parsed answer and
    the moves it is scored against (``named`` X, ``blamed``, ``placebo`` Y, ``own_named``)."""
    return [
        {
            "item": i,
            "episode": it.episode_id,
            "task": it.task_id,
            "condition": condition,
            "sample": k,
            "answer": answer,
            "named": it.named,
            "blamed": it.blamed,
            "placebo": it.placebo,
            "own_named": it.own_named,
        }
        for i, it in enumerate(items)
        for condition, answers in it.answers.items()
        for k, answer in enumerate(answers)
    ]


def write_records(items: list[AuditItem], out: Path) -> Path:
    """``<out>_records.jsonl`` (``.gz`` above 2 MB) of :func:`answer_records`."""
    body = "".join(
        json.dumps(r, separators=(",", ":")) + "\n" for r in answer_records(items)
    ).encode()
    path = out.parent / f"{out.name}_records.jsonl"
    if len(body) > 2_000_000:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(body, mtime=0))
    else:
        path.write_bytes(body)
    return path


async def audit_phase(
    ctx: Any,
    *,
    log: Path,
    env_options: dict[str, Any],
    rollout: dict[str, Any],
    samples: int,
    gate: float,
    seed: int,
    out: Path,
) -> dict[str, Any]:
    """The audit as a phase of the paper runner (``experiments/paper/steps.py``): the engine serves
    the audited weights already; actions and sampling come from the environment's explorer defaults
    with ``rollout``."""
    from leafe.actors.config import ExplorerConfig
    from leafe.envs.registry import make_env

    env = make_env(ctx.env, **env_options)
    try:
        env.reset(env.tasks("train")[0])
        valid = env.valid_actions()
        if not valid:
            raise ValueError(
                f"{ctx.env} has no finite action set: the follow audit counts named moves"
            )
        actions = list(valid)
    finally:
        env.close()
    explorer = ExplorerConfig.for_env(ctx.env, dict(rollout))
    items = audit_items(log, ctx.tokenizer, actions, seed=seed)
    await run_audit(
        ctx.engine,
        items,
        samples=samples,
        params=explorer.action_params(),
        response_prefix=explorer.response_prefix,
        actions=actions,
        seed=seed,
        concurrency=ctx.concurrency,
    )
    summary = summarize(items, gate=gate)
    write_report(
        summary, out, title=f"Follow audit ({log.name}, {len(items)} verdicts x {samples} answers)"
    )
    records = write_records(items, out)
    return {
        "gate": summary["gate"],
        "summary": summary,
        "log": str(log),
        "report": str(out.with_suffix(".md")),
        "records": str(records),
    }
