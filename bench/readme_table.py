"""The timing table of ``make run`` and ``make test`` in ``docs/benchmarks.md``, generated from
the records that ``make bench-readme`` writes (``bench/readme_times.sh`` ->
``bench/results/readme_times_<class>_<vendor>.json``; ``_approx`` for an AVX-512 host forced to
AVX2 kernels).

One row per measurement (the set-up, ``make run`` and ``make test`` of each record; a time of 0
means "not measured" and gives no row): what was timed, the time, the CPU (model and ISA class,
from the record's ``host``), the date and the commit. A record without its date, commit or CPU is
refused: a time that does not say where and at what code it was measured compares with nothing.

    python -m bench.readme_table          # print the table, rewrite the block in docs/benchmarks.md
    python -m bench.readme_table --check  # change nothing; exit 1 if the block is stale

The block is the text between ``<!-- readme-times:begin -->`` and ``<!-- readme-times:end -->``;
the text around it is kept. Standard library only: ``bench/readme_times.sh`` runs it with any
Python 3.11.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
PATTERN = "readme_times_*.json"
"""Records by CPU class and vendor; the older ``readme_times.json`` (no ``host``) is not one."""
BEGIN = "<!-- readme-times:begin -->"
END = "<!-- readme-times:end -->"
MEASURES = (
    ("setup_s", "set-up (venv, installs, model conversion)", None),
    ("make_run_s", "`make run` after set-up", "make_run_rc"),
    ("make_test_s", "`make test` after set-up", "make_test_rc"),
)
"""(record key, what the row says was timed, the key of its exit code, if the record has one)."""
HEADER = ("what", "time", "CPU (model, class)", "date", "commit")


class RecordError(ValueError):
    """A timing record that cannot go into the table (it lacks its date, commit or CPU)."""


def cpu_class(host: dict[str, Any], approximation: bool) -> str:
    """The ISA class a record was measured in, from its host's flags (``AVX-512 + AVX512-BF16 +
    AMX``, ``AVX2 only``, ...) or an AVX-512 CPU forced to AVX2 kernels (an approximation)."""
    flags = host.get("flags") or {}
    if approximation or host.get("isa_overrides"):
        return "AVX-512 forced to AVX2 kernels (an approximation of AVX2 only)"
    if flags.get("avx512f"):
        name = "AVX-512 + AVX512-BF16" if flags.get("avx512_bf16") else "AVX-512"
        return name + (" + AMX" if flags.get("amx_bf16") or flags.get("amx_tile") else ", no AMX")
    return "AVX2 only" if flags.get("avx2") else "no AVX2"


def check_record(record: dict[str, Any], name: str) -> None:
    """Raise :class:`RecordError` naming what ``record`` lacks of its date, commit and CPU."""
    host = record.get("host")
    missing = [key for key in ("date", "commit") if not record.get(key)]
    if not isinstance(host, dict) or not host.get("cpu_model"):
        missing.append("cpu (host.cpu_model)")
    if missing:
        raise RecordError(
            f"{name}: the record has no {', '.join(missing)}; every time figure needs its date, "
            "commit and CPU (re-measure it with `make bench-readme`)"
        )


def load_records(paths: Iterable[Path]) -> list[tuple[str, dict[str, Any]]]:
    """``(file name, record)`` for each path, in name order, each checked (:func:`check_record`)."""
    records = []
    for path in sorted(paths, key=lambda p: p.name):
        record = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(record, dict):
            raise RecordError(f"{path.name}: not a JSON object")
        check_record(record, path.name)
        records.append((path.name, record))
    return records


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min ({seconds:.0f} s)"


def rows(record: dict[str, Any], name: str = "record") -> list[tuple[str, ...]]:
    """The table rows of one record: one per measured time (a time of 0 was not measured)."""
    check_record(record, name)
    host = record["host"]
    cpu = f"{host['cpu_model']}, {cpu_class(host, bool(record.get('approximation')))}"
    out = []
    for key, what, rc_key in MEASURES:
        seconds = record.get(key) or 0
        if seconds <= 0:
            continue
        rc = (record.get(rc_key) or 0) if rc_key else 0
        time = _minutes(seconds) + (f", failed (exit {rc})" if rc else "")
        out.append((what, time, cpu, str(record["date"]), str(record["commit"])))
    return out


def render_table(records: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """The markdown table of ``(name, record)`` pairs, as :func:`load_records` gives them."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for name, record in records:
        lines += ["| " + " | ".join(row) + " |" for row in rows(record, name)]
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """``text`` with what lies between :data:`BEGIN` and :data:`END` replaced by ``block``, the
    markers and all around them kept; a missing, repeated or misordered marker is an error."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"expected exactly one {BEGIN} and one {END}")
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    if end < start:
        raise ValueError(f"{END} comes before {BEGIN}")
    return f"{text[:start]}\n{block.strip()}\n{text[end:]}"


def main(argv: list[str] | None = None) -> int:
    """Print the table, then rewrite the block in ``--doc`` (``--check``: is it stale?)."""
    p = argparse.ArgumentParser(
        prog="python -m bench.readme_table",
        description="the make run / make test timing table of docs/benchmarks.md, from the records",
    )
    p.add_argument("--results", type=Path, default=RESULTS, help=f"folder of the {PATTERN} records")
    p.add_argument("--doc", type=Path, default=DOC, help="the markdown file with the markers")
    p.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if the block is stale"
    )
    args = p.parse_args(argv)
    paths = list(args.results.glob(PATTERN))
    if not paths:
        print(f"no {PATTERN} in {args.results}", file=sys.stderr)
        return 2
    try:
        table = render_table(load_records(paths))
    except RecordError as e:
        print(f"bench.readme_table: {e}", file=sys.stderr)
        return 2
    print(table)
    text = args.doc.read_text(encoding="utf-8")
    new = replace_block(text, table)
    if args.check:
        if new != text:
            print(
                f"{args.doc}: the timing table is stale; run python -m bench.readme_table",
                file=sys.stderr,
            )
            return 1
        return 0
    if new != text:
        args.doc.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
