"""``bench/readme_table.py``: the timing table of ``docs/benchmarks.md`` is rendered from the
``make bench-readme`` records (one row per measured time, with its CPU, date and commit), replaces
only the block between its markers, refuses a record that does not say where and when it was
measured, and the committed block is what the committed records give."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from bench.readme_table import (
    BEGIN,
    END,
    RecordError,
    load_records,
    main,
    render_table,
    replace_block,
)

ROOT = Path(__file__).resolve().parents[3]


def _record(**overrides: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "date": "2026-12-04",
        "commit": "abc1234",
        "setup_s": 81,
        "make_run_s": 503,
        "make_test_s": 945,
        "make_run_rc": 0,
        "make_test_rc": 0,
        "approximation": False,
        "host": {
            "cpu_model": "AMD EPYC",
            "flags": {"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_bf16": False},
            "isa_overrides": {},
        },
    }
    record.update(overrides)
    return record


def _write(tmp_path: Path, name: str, record: dict[str, Any]) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(record), encoding="utf-8")
    return path


def test_a_table_from_two_records(tmp_path: Path) -> None:
    """Each measured time is a row with its CPU and class, date and commit; a time of 0 (not
    measured) gives no row, and a forced-AVX2 record says it is an approximation."""
    forced = _record(
        date="2026-12-03",
        commit="def5678",
        make_test_s=0,
        approximation=True,
        host={**_record()["host"], "isa_overrides": {"ATEN_CPU_CAPABILITY": "avx2"}},
    )
    paths = [
        _write(tmp_path, "readme_times_avx512_amd.json", _record()),
        _write(tmp_path, "readme_times_avx2_amd_approx.json", forced),
    ]
    lines = render_table(load_records(paths)).splitlines()
    assert lines[0] == "| what | time | CPU (model, class) | date | commit |"
    assert lines[1] == "|---|---|---|---|---|"
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert len(rows) == 5  # 2 of the forced record (no make test), 3 of the other
    approx = "AMD EPYC, AVX-512 forced to AVX2 kernels (an approximation of AVX2 only)"
    assert rows[1] == [
        "`make run` after set-up",
        "8.4 min (503 s)",
        approx,
        "2026-12-03",
        "def5678",
    ]
    native = "AMD EPYC, AVX-512 + AVX512-BF16, no AMX"
    assert rows[4] == [
        "`make test` after set-up",
        "15.8 min (945 s)",
        native,
        "2026-12-04",
        "abc1234",
    ]
    assert rows[2][0].startswith("set-up") and rows[2][1] == "1.4 min (81 s)"


def test_a_failed_command_says_so(tmp_path: Path) -> None:
    path = _write(tmp_path, "readme_times_avx512_amd.json", _record(make_test_rc=2))
    assert "15.8 min (945 s), failed (exit 2)" in render_table(load_records([path]))


def test_the_block_is_replaced_and_the_text_around_it_kept() -> None:
    text = f"# Benchmarks\n\nbefore the table\n{BEGIN}\n| old | table |\n{END}\nafter the table\n"
    new = replace_block(text, "| new | table |")
    assert (
        new
        == f"# Benchmarks\n\nbefore the table\n{BEGIN}\n| new | table |\n{END}\nafter the table\n"
    )
    assert replace_block(new, "| new | table |") == new  # rerunning changes nothing
    with pytest.raises(ValueError, match="exactly one"):
        replace_block("no markers here", "| t |")
    with pytest.raises(ValueError, match="before"):
        replace_block(f"{END}\n{BEGIN}", "| t |")


@pytest.mark.parametrize(
    ("drop", "missing"),
    [("date", "date"), ("commit", "commit"), ("host", "cpu (host.cpu_model)")],
)
def test_a_record_without_date_commit_or_cpu_is_refused(
    tmp_path: Path, drop: str, missing: str
) -> None:
    record = _record()
    del record[drop]
    path = _write(tmp_path, "readme_times_avx512_amd.json", record)
    expected = rf"readme_times_avx512_amd\.json: .*no {re.escape(missing)}"
    with pytest.raises(RecordError, match=expected):
        load_records([path])


def test_main_refuses_such_a_record_and_leaves_the_doc_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = _record()
    record["host"] = {"flags": {}}
    _write(tmp_path, "readme_times_avx2_amd.json", record)
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"x\n{BEGIN}\nold\n{END}\ny\n", encoding="utf-8")
    assert main(["--results", str(tmp_path), "--doc", str(doc)]) == 2
    assert "no cpu (host.cpu_model)" in capsys.readouterr().err
    assert doc.read_text(encoding="utf-8") == f"x\n{BEGIN}\nold\n{END}\ny\n"


def test_the_committed_block_is_what_the_committed_records_give() -> None:
    """``docs/benchmarks.md``'s table was generated from ``bench/results/readme_times_*.json``
    (``python -m bench.readme_table`` rewrites it after a new record)."""
    args = [
        "--results",
        str(ROOT / "bench" / "results"),
        "--doc",
        str(ROOT / "docs" / "benchmarks.md"),
    ]
    assert main([*args, "--check"]) == 0
