"""The test suite's own helpers: run ids that keep tests apart on the shared nats-server."""

from __future__ import annotations

from protocol.subjects import validate_run_id
from tests.support.naming import run_id_for


def test_parametrized_tests_with_long_names_get_distinct_valid_run_ids() -> None:
    """Two cases of one parametrized test whose names share their first 40 characters still get
    different run ids (the old fixture truncated the name and made them share streams), each valid."""
    base = "tests/integration/test_replayer.py::test_a_rather_long_test_name_about_replaying_events"
    ids = {run_id_for(f"{base}[{case}]", 1234) for case in ("leafe", "grpo", "rft")}
    assert len(ids) == 3
    assert all(validate_run_id(i) == i for i in ids)
    assert run_id_for(f"{base}[leafe]", 1234) == run_id_for(f"{base}[leafe]", 1234)
