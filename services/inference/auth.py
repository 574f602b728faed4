"""Who may use the CPU inference server: an API key, as SGLang's ``--api-key`` (``Authorization:
Bearer``), and an admin key for the routes that steer the server itself, as SGLang's
``--admin-api-key``.

With a key configured every route needs it except the probes (``/health``, ``/ready``), exactly as
SGLang leaves only its health routes open; a missing or wrong key is HTTP 401 with an SGLang-shaped
body. The admin routes (:func:`is_admin_route`) need the admin key instead, and never accept the API
key, which every actor holds:

- the weight routes (``/update_weights_from_disk``, ``/update_weight_version`` and any later
  ``/update_weights_*`` or weight-group route) and ``/flush_cache``: with the actors' key,
  ``/update_weight_version`` once aborted every other client's generations (3 of 3 cut after 2-4
  tokens) and relabelled the served version, and ``/update_weights_from_disk`` loaded any checked
  export past the store's reload lease. A server with an API key but no admin key refuses them
  (403); one with no key at all (a local test server) serves them to whoever reaches it, as SGLang
  does;
- ``/get_weights_by_name`` (the served weights themselves: an operator's check, no actor's);
- ``/set_threads`` (every actor's key could once stall generation with it): refused (403) on any
  server without an admin key.

This is SGLang 0.5.23's ``--admin-api-key`` rule for the same routes, except that SGLang with only
``--api-key`` lets that key reload weights. Keys come from files (``--api-key-file``,
``--admin-key-file``), never from the command line or the environment, so they show in no process
listing and no environment a sandboxed child could read.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Middleware

__all__ = [
    "ADMIN_ROUTES",
    "OPEN_ROUTES",
    "is_admin_route",
    "key_middleware",
    "read_api_key",
    "write_api_key",
]

OPEN_ROUTES = frozenset({"/health", "/ready"})
"""Routes answered without the key (probes)."""
ADMIN_ROUTES = frozenset(
    {
        "/set_threads",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/flush_cache",
        "/get_weights_by_name",
    }
)
"""Routes that need the admin key (the API key, which every actor holds, is not enough)."""
ADMIN_PREFIXES = (
    "/update_weight",
    "/init_weights_",
    "/destroy_weights_",
    "/release_memory_occupation",
    "/resume_memory_occupation",
)
"""Route prefixes that are admin routes too: SGLang's other weight updates (from tensors, from a
distributed group) and its memory release, should the CPU server ever serve them."""
KEYED_ONLY = frozenset({"/set_threads"})
"""Admin routes refused even by a server with no key at all."""


def is_admin_route(path: str) -> bool:
    """Whether ``path`` needs the admin key (:data:`ADMIN_ROUTES`, :data:`ADMIN_PREFIXES`)."""
    return path in ADMIN_ROUTES or path.startswith(ADMIN_PREFIXES)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def read_api_key(path: str) -> str:
    """The key in ``path`` (surrounding whitespace stripped); an empty or unreadable file is an
    error."""
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ValueError(f"cannot read the API key file {path!r}: {e.strerror}") from None
    if not key:
        raise ValueError(f"the API key file {path!r} is empty")
    return key


def write_api_key(path: Path) -> Path:
    """A fresh random key in ``path`` (mode 0600, its directory 0700); kept if it exists (a resumed
    run)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.is_file():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return path


def _refused(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def key_middleware(api_key: str, admin_key: str) -> Middleware:
    """An aiohttp middleware: admin routes (:func:`is_admin_route`) need ``Authorization: Bearer
    admin_key`` (403 without an admin key, unless the server has no key at all and the route is not
    :data:`KEYED_ONLY`), every other route but the probes ``Bearer api_key`` (none needed when
    ``api_key`` is empty)."""
    expected = f"Bearer {api_key}".encode()
    admin = f"Bearer {admin_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        if is_admin_route(request.path) and (admin_key or api_key or request.path in KEYED_ONLY):
            if not admin_key:
                return _refused(
                    403,
                    f"{request.path} needs the server's admin key; none is configured "
                    "(the API key never suffices)",
                )
            if not hmac.compare_digest(given, admin):
                return _refused(
                    401, "Unauthorized: a valid Authorization: Bearer <admin key> is required"
                )
        elif (
            api_key and request.path not in OPEN_ROUTES and not hmac.compare_digest(given, expected)
        ):
            return _refused(
                401, "Unauthorized: a valid Authorization: Bearer <api key> is required"
            )
        return await handler(request)

    return check
