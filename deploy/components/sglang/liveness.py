"""SGLang's liveness probe, which never asks a loading server for a generation (the SGLang
container's ``exec`` probe; standard library only, it runs in the lmsysorg/sglang image).

    python3 -I -S liveness.py LOCK_FILE [HEALTH_URL]     # exit 0: alive, 1: not

SGLang's ``/health`` runs a one-token generation; one that lands in a weight load longer than 20 s
marks the server unhealthy, and ``/ready`` then answers 503 until a later ``/health`` succeeds: the
router drops the worker and the pod leaves the Service. The weight-sync sidecar (``leafe weight-sync
--engine-lock LOCK_FILE``, services/weight_sync/lease.py) holds LOCK_FILE exclusively while its
server loads, with the load's deadline in it. So: while the lock is held, the server is alive until
that deadline without being asked; otherwise this probe takes the lock shared (a load waits for it)
and asks ``/health`` (25 s, above SGLang's own 20 s). Without the file (no sidecar yet) it asks
``/health`` as a plain probe would.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
import urllib.error
import urllib.request

HEALTH_TIMEOUT_S = 25.0


def healthy(url: str) -> bool:
    """SGLang's ``/health`` answered 200 in time."""
    try:
        with urllib.request.urlopen(url, timeout=HEALTH_TIMEOUT_S) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def alive(lock_file: str, url: str) -> bool:
    """Alive while a load holds ``lock_file`` (until its deadline), else what ``/health`` says."""
    try:
        fd = os.open(lock_file, os.O_RDONLY)
    except FileNotFoundError:
        return healthy(url)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # the sidecar loads weights into this server
            try:
                deadline = float(os.pread(fd, 64, 0).decode().strip() or 0)
            except ValueError:
                deadline = 0.0
            return time.time() < deadline
        return healthy(url)  # holding the shared lock: a load waits until this check is done
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    url = argv[1] if len(argv) == 2 else "http://127.0.0.1:30000/health"
    return 0 if alive(argv[0], url) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
