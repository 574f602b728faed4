"""SGLang's liveness probe, which never asks a loading server for a generation (the SGLang
container's ``exec`` probe; standard library only, it runs in the lmsysorg/sglang image).

    python3 -I -S liveness.py LOCK_FILE [HEALTH_URL [MAX_LOAD_S]]     # exit 0: alive, 1: not

SGLang's ``/health`` runs a one-token generation; one that lands in a weight load longer than 20 s
marks the server unhealthy, and ``/ready`` then answers 503 until a later ``/health`` succeeds: the
router drops the worker and the pod leaves the Service. The weight-sync sidecar (``leafe weight-sync
--engine-lock LOCK_FILE``, services/weight_sync/lease.py) holds LOCK_FILE exclusively while its
server loads, with the load's deadline in it. So: while the lock is held, the server is alive until
that deadline without being asked; otherwise this probe takes the lock shared (a load waits for it)
and asks ``/health`` (25 s, above SGLang's own 20 s). Without the file (no sidecar yet) it asks
``/health`` as a plain probe would.

What the file may hold is bounded: LOCK_FILE is opened without following a symlink and without
blocking, and must be a regular file (a FIFO there once hung the probe; a symlink or FIFO is now a
failure, said on stderr). The deadline is at most :data:`READ_BYTES` of ASCII, a finite number no
later than now + MAX_LOAD_S (the sidecar's load deadline, ``update_timeout_s`` + 60 s), and counts
at most MAX_LOAD_S after the file was written: a deadline in the year 2100, ``inf`` or ``nan`` once
kept a dead engine alive. An unusable deadline under a held lock is said, and ``/health`` decides.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import stat
import sys
import time
import urllib.error
import urllib.request

HEALTH_TIMEOUT_S = 25.0
MAX_LOAD_S = 660.0
"""The sidecar's load deadline by default (weight sync's ``update_timeout_s`` 600 s + 60 s)."""
READ_BYTES = 64
"""The most of the lock file that is read (a deadline is ~15 bytes)."""


def healthy(url: str) -> bool:
    """SGLang's ``/health`` answered 200 in time."""
    try:
        with urllib.request.urlopen(url, timeout=HEALTH_TIMEOUT_S) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _say(message: str) -> None:
    print(f"liveness: {message}", file=sys.stderr)


def lock_deadline(fd: int, max_load_s: float, now: float) -> float | None:
    """Until when a held lock file says the server is loading (epoch seconds), or ``None`` when
    what it holds is no deadline a load of ours writes."""
    st = os.fstat(fd)
    raw = os.pread(fd, READ_BYTES + 1, 0)
    if st.st_size > READ_BYTES or len(raw) > READ_BYTES:
        return None
    try:
        deadline = float(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        return None
    if not math.isfinite(deadline) or deadline > now + max_load_s:
        return None
    return min(deadline, st.st_mtime + max_load_s)


def alive(lock_file: str, url: str, max_load_s: float = MAX_LOAD_S) -> bool:
    """Alive while a load holds ``lock_file`` (until its deadline), else what ``/health`` says."""
    try:
        fd = os.open(lock_file, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return healthy(url)
    except OSError as e:
        what = "is a symlink" if e.errno == errno.ELOOP else f"cannot be opened ({e.strerror})"
        _say(f"{lock_file} {what}, not a lock file: refused")
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            _say(f"{lock_file} is not a regular file (a FIFO, socket or device): refused")
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # the sidecar loads weights into this server
            now = time.time()
            deadline = lock_deadline(fd, max_load_s, now)
            if deadline is None:
                _say(
                    f"{lock_file} is locked but holds no usable deadline (at most {READ_BYTES} "
                    f"bytes, finite, <= now + {max_load_s:.0f} s): asking /health"
                )
                return healthy(url)
            return now < deadline
        return healthy(url)  # holding the shared lock: a load waits until this check is done
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 3:
        print(__doc__, file=sys.stderr)
        return 2
    url = argv[1] if len(argv) >= 2 else "http://127.0.0.1:30000/health"
    try:
        max_load_s = float(argv[2]) if len(argv) == 3 else MAX_LOAD_S
    except ValueError:
        max_load_s = math.nan
    if not 0 < max_load_s < math.inf:
        _say(f"MAX_LOAD_S must be a finite number of seconds > 0, got {argv[2]!r}")
        return 2
    return 0 if alive(argv[0], url, max_load_s) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
