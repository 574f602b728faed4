"""Names that keep tests apart on the shared nats-server."""

from __future__ import annotations

import hashlib

__all__ = ["run_id_for"]


def run_id_for(node_id: str, pid: int) -> str:
    """A valid run id unique to one test (parametrized cases included): a readable stem of the
    test's name plus a hash of its full node id, so tests sharing the server never see each other's
    messages."""
    name = node_id.rpartition("::")[2]
    stem = "".join(c if c.isalnum() else "-" for c in name)[:32].strip("-")
    digest = hashlib.sha256(node_id.encode()).hexdigest()[:10]
    return f"t{pid % 10000}-{stem}-{digest}"
