"""The ``leafe`` command: one verb per service or tool, each implemented by a module's
``main(argv)``.

Verbs import their module lazily, so ``leafe --help`` is instant and torch is only loaded by the
verbs that need it. Each verb module owns its own argparse parser (``leafe <verb> --help``).
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["VERBS", "main"]

VERBS: dict[str, tuple[str, str]] = {
    "run": ("leafe.services.run.main", "run the whole pipeline on one machine (the main job)"),
    "actor": (
        "leafe.services.actor.main",
        "actor service: pull tasks, explore/roll out, publish events",
    ),
    "replayer": (
        "leafe.services.replayer.main",
        "replayer service: events -> samples, continuously",
    ),
    "learner": (
        "leafe.services.learner.main",
        "learner service: samples -> FSDP training -> weight pushes",
    ),
    "weight-sync": (
        "leafe.services.weight_sync.main",
        "follow WeightsPublished and reload every inference server",
    ),
    "inference": (
        "leafe.services.inference.main",
        "CPU inference server with SGLang's native HTTP API",
    ),
    "tasks": ("leafe.services.admin.tasks", "submit task assignments to a run's work queue"),
    "streams": (
        "leafe.services.admin.streams",
        "create, update or check the JetStream streams (NATS admin)",
    ),
    "replay": (
        "leafe.services.replayer.replay",
        "rebuild a dataset from an event log (stream or exported file)",
    ),
    "train": ("leafe.services.learner.train", "train offline on rebuilt dataset shards"),
    "eval": ("leafe.services.eval.main", "Pass@k evaluation of one or more models/weight versions"),
    "log": ("leafe.services.eventlog.cli", "export, import or inspect an event log"),
    "nats": (
        "leafe.services.admin.nats",
        "run an embedded nats-server with JetStream (for local use)",
    ),
}


def _usage() -> str:
    width = max(len(v) for v in VERBS)
    lines = [
        "usage: leafe <verb> [options]   (leafe <verb> --help for a verb's options)",
        "",
        "verbs:",
    ]
    lines += [f"  {verb:<{width}}  {help_}" for verb, (_, help_) in VERBS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``leafe <verb> ...`` to the verb module's ``main(argv)``; returns the exit code."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    verb, rest = args[0], args[1:]
    if verb not in VERBS:
        print(f"leafe: unknown verb {verb!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(VERBS[verb][0])
    code = module.main(rest)
    return int(code or 0)


if __name__ == "__main__":
    raise SystemExit(main())
