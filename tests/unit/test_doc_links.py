"""Every relative link in the top-level documents and ``docs/*.md`` points at a file or folder
that exists, and a link to a heading (``file.md#anchor``) at a heading that exists: a moved or
renamed file fails here, not in a reader's browser."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(
    [
        *(ROOT / name for name in ("README.md", "CONTRIBUTING.md", "CHANGELOG.md")),
        *(ROOT / "docs").glob("*.md"),
    ]
)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
"""A markdown link or image, ``[text](target)`` or ``[text](target "title")``."""
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def _links(text: str) -> list[str]:
    """The targets of the links outside fenced code blocks and inline code."""
    text = FENCE.sub("", text)
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_anchor(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def test_the_documents_exist() -> None:
    missing = [p.name for p in DOCS if not p.is_file()]
    assert missing == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_what_exists(doc: Path) -> None:
    bad = []
    for target in _links(doc.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        if not resolved.exists():
            bad.append(f"{target}: {os.path.relpath(resolved, ROOT)} does not exist")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            bad.append(f"{target}: no heading #{anchor} in {os.path.relpath(resolved, ROOT)}")
    assert bad == [], f"{doc.relative_to(ROOT)}: " + "; ".join(bad)


def test_the_check_finds_a_broken_link(tmp_path: Path) -> None:
    """The scan sees links in text and ignores those in code; a heading's anchor is GitHub's."""
    text = 'See [a](docs/a.md), ![b](b.png "t"), `[c](c.md)`\n```\n[d](d.md)\n```\n'
    assert _links(text) == ["docs/a.md", "b.png"]
    assert _anchor("The main job: `leafe run`") == "the-main-job-leafe-run"
