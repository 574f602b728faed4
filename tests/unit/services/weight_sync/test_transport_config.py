"""``WeightSyncConfig``'s transport settings are checked before anything starts, each error naming
the field and the bad value; the disk transport stays the default."""

from __future__ import annotations

import pytest

from leafe.services.config import ConfigError, load_config
from leafe.services.weight_sync.service import WeightSync, WeightSyncConfig


def test_disk_is_the_default_and_builds_no_sender() -> None:
    """Nothing configured: disk, and no weight group is ever formed."""
    sync = WeightSync(WeightSyncConfig(servers=["http://127.0.0.1:1"]), run_id="r1")
    assert sync.cfg.transport == "disk" and sync.sender is None


def test_distributed_builds_a_sender_with_the_settings() -> None:
    cfg = WeightSyncConfig(
        servers=["http://127.0.0.1:1"], transport="distributed", rendezvous_port=29600
    )
    sync = WeightSync(cfg, run_id="r1")
    assert sync.sender is not None
    assert (sync.sender.port, sync.sender.backend, sync.sender.members) == (29600, "gloo", ())


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("transport", "nfs", "transport"),
        ("rendezvous_port", 70000, "rendezvous_port"),
        ("broadcast_attempts", 0, "broadcast_attempts"),
        ("broadcast_timeout_s", 0.0, "broadcast_timeout_s"),
        ("group_backend", "mpi", "group_backend"),
        ("bucket_mb", 0, "bucket_mb"),
    ],
)
def test_a_bad_transport_setting_is_refused_by_name(field: str, value: object, words: str) -> None:
    with pytest.raises((ConfigError, ValueError)) as e:
        load_config(WeightSyncConfig, overrides={field: value})
    assert words in str(e.value) and str(value) in str(e.value)
