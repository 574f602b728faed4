"""What ``leafe run`` tells its learner while it runs: a small JSON file (``leafe learner --control
PATH``).

    {"threads": 2, "release_seq": 1234, "flush": false}

- ``threads``: torch threads for the next steps (0 keeps the current count). ``leafe run`` gives the
  learner every free core while the engines idle (the warm start's demonstrations need no engine; a
  phased run trains between rounds) and takes them back when the actors run
  (``services/threads.py``).
- ``release_seq`` (phased runs, ``[explore] schedule = "phased"``): train nothing past this sequence
  of ``LEAFE_SAMPLES``; once every sample up to it is in hand, train them all as batches in
  sample-id order, then push. So a phase trains the same steps on a fast or a slow machine.
  ``null``: train as samples come (continuous runs, and any learner started without the file). A
  phase must hold fewer samples than the consumer's ``max_ack_pending`` (4096 by default): the
  learner holds them all, unacked, until released.
- ``flush`` (continuous runs): train the tail, a partial batch below ``min_batch``, once it waited
  ``max_batch_wait_s`` (set while the run waits for everything to be trained).

The supervisor writes the file atomically (:func:`write_control`); the learner re-reads it when it
changed (:class:`ControlFile`), between steps. One machine only: deploy/ runs learners without it.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import structlog

__all__ = ["ControlFile", "LearnerControl", "apply_threads", "write_control"]

log = structlog.get_logger(__name__)


class LearnerControl(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The file's content."""

    threads: int = 0
    """Torch threads for the next steps; 0 keeps the current count."""
    release_seq: int | None = None
    """Phased: the last ``LEAFE_SAMPLES`` sequence the learner may train (0: nothing yet); ``None``:
    continuous."""
    flush: bool = False
    """Continuous: train a partial batch (even of 1 sample) once it waited ``max_batch_wait_s``,
    whatever ``min_batch`` says: ``leafe run`` sets it while it waits for the learner to train
    every sample (a warm start's end, the drain), so the stream's tail is trained as ``leafe
    train`` trains an epoch's last partial batch, and only then."""


def write_control(path: Path, control: LearnerControl) -> None:
    """Replace ``path`` with ``control`` in one rename (the learner never reads half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(msgspec.json.encode(control))
    os.replace(tmp, path)


class ControlFile:
    """The learner's view of the control file: :meth:`read` returns the last good content."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._error = ""
        self.current = LearnerControl()

    def read(self) -> LearnerControl:
        """The file's content, re-read only when it changed; a missing or unreadable file keeps the
        last good content (logged), so a half-made edit by hand never stops training."""
        if self.path is None:
            return self.current
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                self.current = msgspec.json.decode(self.path.read_bytes(), type=LearnerControl)
                self._stamp = stamp
                log.info("learner.control", **msgspec.to_builtins(self.current))
        except (OSError, msgspec.ValidationError, msgspec.DecodeError) as e:
            error = f"{type(e).__name__}: {e}"
            if error != self._error:  # once per distinct failure: the learner reads it every second
                log.warning("learner.control.unreadable", path=str(self.path), error=error)
            self._stamp, self._error = None, error
        else:
            self._error = ""
        return self.current


def apply_threads(threads: int) -> None:
    """Set torch's intra-op threads of the calling thread to ``threads`` (> 0). torch initialises
    each thread's OpenMP pool once, so this runs in the thread that trains, right before it
    trains."""
    import torch

    if threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
        log.info("learner.threads", threads=threads)
