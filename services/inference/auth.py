"""Who may use the CPU inference server: an API key, as SGLang's ``--api-key`` (``Authorization: Bearer``).

With a key configured every route needs it except the probes (``/health``, ``/ready``), exactly as SGLang
leaves only its health routes open; a missing or wrong key is HTTP 401 with an SGLang-shaped body. The key
comes from a file (``--api-key-file``), never from the command line or the environment, so it shows in no
process listing and no environment a sandboxed child could read.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Middleware

__all__ = ["OPEN_ROUTES", "api_key_middleware", "read_api_key", "write_api_key"]

OPEN_ROUTES = frozenset({"/health", "/ready"})
"""Routes answered without the key (probes)."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def read_api_key(path: str) -> str:
    """The key in ``path`` (surrounding whitespace stripped); an empty or unreadable file is an error."""
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ValueError(f"cannot read the API key file {path!r}: {e.strerror}") from None
    if not key:
        raise ValueError(f"the API key file {path!r} is empty")
    return key


def write_api_key(path: Path) -> Path:
    """A fresh random key in ``path`` (mode 0600, its directory 0700); kept if it exists (a resumed run)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.is_file():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return path


def api_key_middleware(key: str) -> Middleware:
    """An aiohttp middleware refusing every request but the probes without ``Authorization: Bearer key``."""
    expected = f"Bearer {key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_ROUTES:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                body = {
                    "error": {"message": "Unauthorized: a valid Authorization: Bearer <api key> is required"}
                }
                return web.json_response(body, status=401)
        return await handler(request)

    return check
