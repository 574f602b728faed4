"""NATS options (services/bus/connection.py): flags default to the environment, bad combinations are
refused, credentials never reach a log line."""

from __future__ import annotations

import argparse

import pytest

from leafe.services.bus.connection import NatsOptions, add_nats_arguments, nats_options, redact


def _parse(argv: list[str]) -> NatsOptions:
    p = argparse.ArgumentParser()
    add_nats_arguments(p)
    return nats_options(p.parse_args(argv))


def test_flags_default_to_the_environment_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every option reads its LEAFE_NATS_* variable (paths only); a flag overrides it."""
    monkeypatch.setenv("LEAFE_NATS_URL", "nats://a:4222")
    monkeypatch.setenv("LEAFE_NATS_NKEY", "/run/secrets/actor.nk")
    monkeypatch.setenv("LEAFE_NATS_TLS_CA", "/run/secrets/ca.crt")
    opts = _parse([])
    assert (opts.url, opts.nkey, opts.tls_ca) == (
        "nats://a:4222",
        "/run/secrets/actor.nk",
        "/run/secrets/ca.crt",
    )
    assert _parse(["--nats", "nats://b:4222", "--streams-timeout", "5"]).url == "nats://b:4222"
    assert _parse(["--streams-timeout", "5"]).streams_timeout_s == 5.0


def test_incomplete_pairs_two_identities_and_bad_timeouts_are_refused() -> None:
    """A cert without its key, a user without a password file, two identities at once (say an nkey
    from the environment and a creds file from a flag), or a timeout of 0 name the problem."""
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        NatsOptions(url="nats://x", tls_cert="c.pem")
    with pytest.raises(ValueError, match="user and password_file"):
        NatsOptions(url="nats://x", user="actor")
    with pytest.raises(ValueError, match=r"identity given twice \(creds and nkey\)"):
        NatsOptions(url="nats://x", creds="a.creds", nkey="a.nk")
    with pytest.raises(ValueError, match="streams_timeout_s = 0"):
        NatsOptions(streams_timeout_s=0)


def test_stream_replicas_is_not_a_service_flag() -> None:
    """Services never create streams, so they take no replica count (only `leafe streams ensure`
    does)."""
    with pytest.raises(SystemExit):
        _parse(["--stream-replicas", "3"])


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://alice:s3cret@nats-0:4222", "nats://***@nats-0:4222"),
        ("nats://tok3n@nats-0", "nats://***@nats-0"),
        ("nats://n1:4222,tls://u:p@n2:4222", "nats://n1:4222,tls://***@n2:4222"),
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
        ("tls://u:p@ss@n3:4222", "tls://***@n3:4222"),
    ],
)
def test_redact_hides_user_info(url: str, shown: str) -> None:
    """User, password and token never survive redaction; URLs without them are unchanged."""
    assert redact(url) == shown
    assert "s3cret" not in redact(url) and "tok3n" not in redact(url)


@pytest.mark.parametrize(
    "message",
    [
        "Error: nats: cannot reach nats://admin:s3cret@nats-0:4222 (connection refused)",
        "ClientConnectorError: Cannot connect to host ws://admin:s3cret@gw:80 ssl:default",
        "OSError('connect to [nats://a:4222, tls://admin:s3cret@b:4222] failed')",
        "servers nats://admin:s3cret@n1:4222,nats://admin:s3cret@n2:4222 unreachable",
    ],
)
def test_redact_hides_user_info_inside_error_messages(message: str) -> None:
    """An error message quoting a URL (nats-py's and aiohttp's connection errors may) loses the
    URL's user info wherever the URL stands in the text; the rest of the message stays readable."""
    shown = redact(message)
    assert "s3cret" not in shown and "admin" not in shown
    assert "***@" in shown and shown.split("://")[0] == message.split("://")[0]
