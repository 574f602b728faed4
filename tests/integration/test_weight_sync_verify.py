"""Weight sync hashes every file of an export before asking a server to load it: SGLang's
rollback after a failed load re-reads the new path, so a corrupted file must never reach
``/update_weights_from_disk``. The server is a loopback stub answering with recorded SGLang
bodies."""

from __future__ import annotations

from pathlib import Path

import pytest

from leafe.services.weight_sync.service import WeightSync, WeightSyncConfig
from tests.support.weights import scaled_export
from tests.unit.actors.test_client_contract import fixture, replay

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.usefixtures("one_thread")]


def _corrupt(export: Path) -> Path:
    """Flip one byte in the middle of the largest weight file (the manifest still matches its
    sha256)."""
    target = max(
        (p for p in export.iterdir() if p.name != "manifest.json"), key=lambda p: p.stat().st_size
    )
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    return target


async def test_a_corrupted_file_is_never_sent_to_the_server(tiny_dir: Path, tmp_path: Path) -> None:
    """Default settings: the export's manifest matches the announcement but one weight file was
    damaged after export: no /update_weights_from_disk call is made; an intact export is loaded."""
    routes = {
        "/model_info": (200, fixture("model_info.json")),
        "/update_weights_from_disk": (200, fixture("update_weights_ok.json")),
    }
    async with replay(routes) as stub:
        bad = scaled_export(tiny_dir, tmp_path / "v000001", "v000001")
        _corrupt(Path(bad.uri))
        sync = WeightSync(WeightSyncConfig(servers=[stub.url]), run_id="r1")
        try:
            sync.offer(bad)
            assert await sync.sync() == {}
            assert await sync.sync(refresh=True) == {}
            assert "/update_weights_from_disk" not in [p for p, _ in stub.requests]
            good = scaled_export(tiny_dir, tmp_path / "v000002", "v000002")
            sync.offer(good)
            results = await sync.sync()
        finally:
            await sync.close()
    assert [r.version for r in results.values()] == ["v000002"]
    loads = [body for p, body in stub.requests if p == "/update_weights_from_disk"]
    assert [b["model_path"] for b in loads] == [good.uri]
