"""``engines_dns``: weight sync finds its servers by resolving a name (a Kubernetes headless
Service of the engine pods) before every round; servers that appear are added, servers that go are
dropped, and a weight group that held a dropped server is disbanded so the next push forms it
anew. The resolver is a stub here (the real one is checked against ``localhost``); no server
needs to answer, since discovery only decides whom to talk to."""

from __future__ import annotations

import asyncio

import pytest

from leafe.services.config import ConfigError, load_config
from leafe.services.weight_sync.service import WeightSync, WeightSyncConfig, resolve_addresses

pytestmark = pytest.mark.anyio


class Resolver:
    """Answers the addresses it is set to (or raises ``OSError`` when ``fail``), counting calls."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.fail = False
        self.asked: list[tuple[str, int]] = []

    def __call__(self, name: str, port: int) -> list[str]:
        self.asked.append((name, port))
        if self.fail:
            raise OSError("Name or service not known")
        return list(self.addresses)


def _sync(resolver: Resolver, **cfg: object) -> WeightSync:
    config = WeightSyncConfig(engines_dns="sglang-engines:30000", **cfg)  # type: ignore[arg-type]
    return WeightSync(config, run_id="r1", resolve=resolver)


async def test_the_servers_follow_the_name_between_rounds() -> None:
    dns = Resolver("10.0.0.5", "10.0.0.6")
    sync = _sync(dns)
    try:
        assert sync.clients == {}
        await sync.sync()  # no version announced yet: discovery still runs
        assert set(sync.clients) == {"http://10.0.0.5:30000", "http://10.0.0.6:30000"}
        assert dns.asked == [("sglang-engines", 30000)]
        sync.served["http://10.0.0.5:30000"] = "v00000003"
        sync.failures["http://10.0.0.5:30000"] = 2
        sync.metrics.served("http://10.0.0.5:30000", "v00000003")
        dns.addresses = ["10.0.0.6", "10.0.0.7"]
        await sync.sync()
        assert set(sync.clients) == {"http://10.0.0.6:30000", "http://10.0.0.7:30000"}
        assert "http://10.0.0.5:30000" not in sync.served | sync.failures
        assert "10.0.0.5" not in "".join(
            s.labels.get("engine", "") for m in sync.metrics.registry.collect() for s in m.samples
        )
        assert len(dns.asked) == 2
    finally:
        await sync.close()


async def test_a_failed_lookup_keeps_the_servers_found_last() -> None:
    dns = Resolver("10.0.0.5")
    sync = _sync(dns)
    try:
        await sync.sync()
        dns.fail = True
        await sync.sync()
        assert list(sync.clients) == ["http://10.0.0.5:30000"]
    finally:
        await sync.close()


async def test_static_servers_stay_and_ipv6_addresses_get_brackets() -> None:
    dns = Resolver("fd00::7")
    sync = _sync(dns, servers=["http://127.0.0.1:30000"])
    try:
        await sync.sync()
        assert list(sync.clients) == ["http://127.0.0.1:30000", "http://[fd00::7]:30000"]
        dns.addresses = []
        await sync.sync()
        assert list(sync.clients) == ["http://127.0.0.1:30000"]
    finally:
        await sync.close()


async def test_a_group_that_lost_a_member_is_disbanded_and_formed_anew() -> None:
    """The sender shares the servers dict; a server that left the name ends the group (so a push
    never waits for a rank that is gone), and the next broadcast's members differ from the
    (empty) group's, which is what makes ``_broadcast`` form a new one."""
    dns = Resolver("10.0.0.5", "10.0.0.6")
    sync = _sync(dns, transport="distributed", master_address="10.0.0.2")
    assert sync.sender is not None
    disbanded: list[tuple[str, ...]] = []

    async def disband() -> None:  # the real one would ask the (unreachable) servers to leave
        disbanded.append(sync.sender.members)  # type: ignore[union-attr]

    sync.sender.disband = disband  # type: ignore[method-assign]
    try:
        await sync.sync()
        assert sync.sender.clients is sync.clients
        dns.addresses = ["10.0.0.5", "10.0.0.6", "10.0.0.7"]
        await sync.sync()  # one more server: no member lost, the members check re-forms later
        assert disbanded == []
        from leafe.services.weight_sync.broadcast import _Formed

        members = ("http://10.0.0.5:30000", "http://10.0.0.6:30000")
        sync.sender._formed = _Formed(name="g", members=members)
        dns.addresses = ["10.0.0.5", "10.0.0.7"]
        await sync.sync()
        assert disbanded == [members]
    finally:
        sync.sender._formed = None
        await asyncio.gather(*(c.close() for c in sync.clients.values()))


async def test_no_server_found_is_not_converged() -> None:
    sync = _sync(Resolver())
    try:
        await sync.sync()
        assert sync.clients == {} and not sync.converged()
    finally:
        await sync.close()


def test_the_real_resolver_finds_localhost() -> None:
    assert "127.0.0.1" in resolve_addresses("localhost", 30000)
    with pytest.raises(OSError):
        resolve_addresses("no-such-engine.invalid", 30000)


@pytest.mark.parametrize(
    "value", ["sglang-engines", "sglang-engines:0", ":30000", "a:b", "x:70000"]
)
def test_a_bad_name_is_refused_with_the_value(value: str) -> None:
    with pytest.raises((ConfigError, ValueError)) as e:
        load_config(WeightSyncConfig, overrides={"engines_dns": value})
    assert "engines_dns" in str(e.value) and value in str(e.value)


def test_neither_servers_nor_a_name_is_refused() -> None:
    with pytest.raises(ValueError, match="engines-dns"):
        WeightSync(WeightSyncConfig(), run_id="r1")
