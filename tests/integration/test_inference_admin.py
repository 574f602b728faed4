"""The CPU inference server's admin surface (services/inference/): weights load only from under the
weights root and only with a matching sha256 manifest, an API key guards every route but the probes,
and every refusal is an SGLang-shaped 4xx with the old weights kept, never a 500."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import torch

from leafe.actors.client import SGLangClient
from leafe.actors.engine import EngineError, SamplingParams
from leafe.learner.model_io import export_weights, load_model, tiny_model_dir
from leafe.services.inference.config import InferenceConfig
from leafe.services.inference.local import ServerThread, start_in_thread

pytestmark = [pytest.mark.anyio, pytest.mark.integration]
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)
IDS = [1, 400, 500, 600]


def _export(out: Path, version: str = "v1") -> Path:
    model = load_model(tiny_model_dir())
    gen = torch.Generator().manual_seed(3)
    state = {
        k: v if "norm" in k else v + 0.5 * torch.randn(v.shape, generator=gen)
        for k, v in model.state_dict().items()
    }
    export_weights(state, out, config_dir=tiny_model_dir(), version=version)
    return out


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "weights").mkdir()
    return tmp_path / "weights"


@pytest.fixture
def server(root: Path) -> Iterator[ServerThread]:
    handle = start_in_thread(
        InferenceConfig(model="tiny", port=0, threads=1, weights_root=str(root))
    )
    try:
        yield handle
    finally:
        handle.stop()


async def _refused(url: str, path: Path, *, expect: str) -> None:
    """The update is a 400 whose message contains ``expect``; the server keeps its version and
    outputs."""
    async with SGLangClient(url) as client:
        [before] = await client.generate(IDS, GREEDY)
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"{url}/update_weights_from_disk",
                json={"model_path": str(path), "weight_version": "evil"},
            ) as r,
        ):
            body = await r.json()
            assert r.status == 400, body
        assert body["success"] is False and expect in body["message"], body
        [after] = await client.generate(IDS, GREEDY)
    assert after.output_ids == before.output_ids and after.weight_version == "default"


async def test_exports_outside_the_root_are_refused(
    server: ServerThread, root: Path, tmp_path: Path
) -> None:
    """A whole export elsewhere, a ``..`` path out of the root and a symlink in the root pointing
    out are all refused; the same export inside the root loads."""
    outside = _export(tmp_path / "elsewhere")
    await _refused(server.url, outside, expect="outside the weights root")
    await _refused(server.url, root / ".." / "elsewhere", expect="outside the weights root")
    (root / "link").symlink_to(outside)
    await _refused(server.url, root / "link", expect="outside the weights root")
    inside = _export(root / "v1")
    async with SGLangClient(server.url) as client:
        [ok] = await client.update_weights_from_disk(str(inside), "v1")
    assert ok.success, ok.message


async def test_a_server_without_a_root_loads_nothing() -> None:
    """No ``weights_root``: every update is refused, saying how to allow one."""
    handle = start_in_thread(InferenceConfig(model="tiny", port=0, threads=1))
    try:
        await _refused(handle.url, Path("/tmp"), expect="--weights-root")
    finally:
        handle.stop()


@pytest.mark.parametrize(
    ("damage", "expect"),
    [
        ("no_manifest", "has no manifest.json"),
        ("bad_json", "not a JSON manifest"),
        ("not_a_table", "non-empty 'files' table"),
        ("escaping_name", "is not a plain name"),
        ("unlisted_file", "does not list"),
    ],
)
async def test_a_missing_or_malformed_manifest_is_a_400(
    server: ServerThread, root: Path, damage: str, expect: str
) -> None:
    """Every way a manifest can be missing or wrong is a 400 naming it (formerly: loaded unverified,
    or a 500 with plain text)."""
    export = _export(root / "v1")
    manifest = export / "manifest.json"
    if damage == "no_manifest":
        manifest.unlink()
    elif damage == "bad_json":
        manifest.write_text("{not json")
    elif damage == "not_a_table":
        manifest.write_text(json.dumps({"files": ["model.safetensors"]}))
    elif damage == "escaping_name":
        table = json.loads(manifest.read_text())
        table["files"]["../../etc/passwd"] = "0" * 64
        manifest.write_text(json.dumps(table))
    else:
        (export / "extra.safetensors").write_bytes((export / "model.safetensors").read_bytes())
    await _refused(server.url, export, expect=expect)


async def test_the_api_key_guards_every_route_but_the_probes(root: Path, tmp_path: Path) -> None:
    """With key files: no or a wrong key is 401 on generate, weight updates (the admin key's) and
    model info; the probes answer without it; the client sends it from ``api_key_file`` or
    ``$LEAFE_ENGINE_API_KEY_FILE``."""
    key = tmp_path / "api-key"
    key.write_text("s3cret-key\n")
    admin = tmp_path / "admin-key"
    admin.write_text("adm1n-key\n")
    wrong = tmp_path / "wrong-key"
    wrong.write_text("guess\n")
    config = InferenceConfig(
        model="tiny", port=0, threads=1, weights_root=str(root), api_key_file=str(key),
        admin_key_file=str(admin),
    )  # fmt: skip
    handle = start_in_thread(config)
    try:
        async with aiohttp.ClientSession() as s:
            for method, route in [
                ("POST", "/generate"),
                ("POST", "/update_weights_from_disk"),
                ("GET", "/model_info"),
                ("GET", "/get_server_info"),
            ]:
                async with s.request(method, f"{handle.url}{route}", json={}) as r:
                    assert r.status == 401, route
                    assert "Unauthorized" in (await r.json())["error"]["message"]
            for route in ("/health", "/ready"):
                async with s.get(f"{handle.url}{route}") as r:
                    assert r.status == 200, route
        async with SGLangClient(handle.url, api_key_file=str(wrong), retries=0) as client:
            with pytest.raises(EngineError, match=r"401|Unauthorized"):
                await client.generate(IDS, GREEDY)
        async with SGLangClient(handle.url, api_key_file=str(key)) as client:
            [c] = await client.generate(IDS, GREEDY)
            assert c.output_ids
        os.environ["LEAFE_ENGINE_API_KEY_FILE"] = str(key)
        try:
            async with SGLangClient(handle.url) as client:
                assert await client.weight_version() == "default"
        finally:
            del os.environ["LEAFE_ENGINE_API_KEY_FILE"]
    finally:
        handle.stop()
