"""Which actor id ``leafe actor`` publishes as: the one its NATS credentials are pinned to, checked
as a subject token, never one that the server would refuse on every event."""

from __future__ import annotations

import pytest

from leafe.protocol.subjects import InvalidRunId
from leafe.services.actor.main import default_actor_id, resolve_actor_id
from leafe.services.bus import NatsOptions

URL = "nats://127.0.0.1:4222"


def test_the_credentials_actor_id_is_the_one_published_as() -> None:
    """Seed file ``actor.<id>.nk`` (or user ``actor.<id>``) gives the id; ``--actor-id`` may repeat
    it, and one that differs is refused naming both (the server would refuse each of its events)."""
    pinned = NatsOptions(url=URL, nkey="/keys/actor.r1-actor-0.nk")
    assert resolve_actor_id(pinned, None) == "r1-actor-0"
    assert resolve_actor_id(pinned, "r1-actor-0") == "r1-actor-0"
    with pytest.raises(ValueError, match=r"'r1-actor-1' differs .* pinned to \('r1-actor-0'\)"):
        resolve_actor_id(pinned, "r1-actor-1")
    user = NatsOptions(url=URL, user="actor.a7", password_file="/p")
    assert resolve_actor_id(user, None) == "a7"


@pytest.mark.parametrize("bad", ["a.b", "a*", ">", "legacy", "-x", "x" * 65])
def test_an_actor_id_that_cannot_be_a_subject_token_is_refused(bad: str) -> None:
    """Without pinned credentials ``--actor-id`` is used as given, if it can be the events' last
    token."""
    with pytest.raises(InvalidRunId, match="invalid actor id"):
        resolve_actor_id(NatsOptions(url=URL), bad)
    with pytest.raises(InvalidRunId, match="invalid actor id"):
        resolve_actor_id(NatsOptions(url=URL, nkey=f"/keys/actor.{bad}.nk"), None)


def test_the_default_id_is_a_valid_token() -> None:
    """``<host>-<pid>`` with the host's dots and odd characters left out."""
    assert resolve_actor_id(NatsOptions(url=URL), None) == default_actor_id()
