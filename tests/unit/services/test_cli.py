"""The ``leafe`` command: every verb answers ``--help`` without loading torch (so it is instant),
and an unknown verb is a usage error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from leafe.services.cli import VERBS, main

ROOT = Path(__file__).resolve().parents[3]
_PROBE = """
import contextlib, io, sys
from leafe.services.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main([{verb!r}, "--help"])
    except SystemExit as e:
        assert e.code == 0, e.code
print("torch" in sys.modules, "transformers" in sys.modules)
"""


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_help_of_every_verb_loads_no_torch(verb: str) -> None:
    """``leafe <verb> --help`` exits 0 and never imports torch or transformers (heavy imports wait
    until the flags were read)."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(verb=verb)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"], out.stdout


def test_unknown_verb_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown verb exits 2 and lists the verbs."""
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown verb 'frobnicate'" in err and all(v in err for v in VERBS)
