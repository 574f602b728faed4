"""Damaging ``.leafelog`` files the way a bad disk would, for the event-log tests.

The frame walk here is written from the format's description (``services/eventlog/fileformat.py``),
not with the reader under test, so a test that locates a frame with it does not trust the code it
checks.
"""

from __future__ import annotations

from pathlib import Path

MAGIC_SIZE = 8
PREFIX = 4
CRC = 4

__all__ = ["cut", "flip_bit", "frame_spans", "garble"]


def frame_spans(data: bytes) -> list[tuple[int, int]]:
    """``(offset, end)`` of every frame of an uncompressed v2 file: header, records, trailer."""
    spans, pos = [], MAGIC_SIZE
    while pos < len(data):
        size = int.from_bytes(data[pos : pos + PREFIX], "big")
        end = pos + PREFIX + size + CRC
        spans.append((pos, end))
        pos = end
    assert pos == len(data), f"frames overrun the file ({pos} > {len(data)})"
    return spans


def flip_bit(path: Path, bit: int) -> None:
    """Invert bit ``bit`` (0 = most significant bit of byte 0) of the file in place."""
    data = bytearray(path.read_bytes())
    data[bit // 8] ^= 0x80 >> (bit % 8)
    path.write_bytes(bytes(data))


def cut(path: Path, size: int) -> None:
    """Truncate the file to its first ``size`` bytes."""
    path.write_bytes(path.read_bytes()[:size])


def garble(path: Path, needle: bytes, *, bit: int = 7) -> int:
    """Flip bit ``bit`` of the last byte of the only occurrence of ``needle``; returns that byte's
    offset."""
    data = path.read_bytes()
    at = data.find(needle)
    assert at >= 0 and data.find(needle, at + 1) < 0, f"{needle!r} must occur exactly once"
    where = at + len(needle) - 1
    flip_bit(path, where * 8 + bit)
    return where
