"""How ``distributed_env`` leaves the process group: ranks meet before a clean teardown, never after
an error."""

from __future__ import annotations

import pytest

import leafe.learner.distributed as distributed
from leafe.learner.distributed import DistEnv


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    env = DistEnv(
        rank=1,
        world_size=2,
        local_rank=1,
        device=distributed.torch.device("cpu"),
        backend="gloo",
        owns_group=True,
    )
    monkeypatch.setattr(distributed, "init_distributed", lambda backend=None: env)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "barrier", lambda: seen.append("barrier"))
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: seen.append("destroy"))
    return seen


def test_a_clean_exit_waits_for_every_rank_before_destroying(calls: list[str]) -> None:
    with distributed.distributed_env():
        calls.append("work")
    assert calls == ["work", "barrier", "destroy"]


def test_an_error_destroys_without_waiting_for_ranks_that_may_never_come(calls: list[str]) -> None:
    with pytest.raises(RuntimeError), distributed.distributed_env():
        raise RuntimeError("rank failed")
    assert calls == ["destroy"]
