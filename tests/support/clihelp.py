"""Reading the real ``leafe <verb> --help`` for the deploy/ tests: which options a verb has, which
it requires, and which verbs take a subcommand (``leafe tasks submit``)."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass

from tests.support.manifests import ROOT

__all__ = ["VerbHelp", "command_of", "parse_help", "verb_help"]

_SUBCOMMAND_VERBS = frozenset({"tasks", "log", "streams"})


def command_of(verb: str, args: list[str]) -> tuple[str, list[str]]:
    """``("tasks submit", rest)`` for verbs with subcommands, else ``(verb, args)``: what --help to
    read."""
    if verb in _SUBCOMMAND_VERBS and args and not args[0].startswith("-"):
        return f"{verb} {args[0]}", args[1:]
    return verb, args


@dataclass(frozen=True, kw_only=True)
class VerbHelp:
    """What ``leafe <verb> --help`` says: every long option, and which ones the usage line
    requires."""

    verb: str
    options: frozenset[str]
    required: frozenset[str]
    one_of: tuple[frozenset[str], ...]


def _usage_block(text: str) -> str:
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("usage:")), 0)
    block: list[str] = []
    for line in lines[start:]:
        if block and not line.strip():
            break
        block.append(line)
    return " ".join(block)


def _parse_usage(usage: str) -> tuple[frozenset[str], tuple[frozenset[str], ...]]:
    """Required options and required mutually exclusive groups, from argparse's usage line."""
    previous = None
    while previous != usage:  # drop optional parts, innermost brackets first
        previous, usage = usage, re.sub(r"\[[^\[\]]*\]", "", usage)
    groups = tuple(
        frozenset(re.findall(r"--[\w-]+", g)) for g in re.findall(r"\(([^()]*)\)", usage)
    )
    outside = re.sub(r"\([^()]*\)", "", usage)
    return frozenset(re.findall(r"--[\w-]+", outside)), groups


def verb_help(verb: str) -> VerbHelp:
    """Run the real ``leafe <verb> --help`` (``verb`` may be ``"tasks submit"``); fails naming the
    module when the verb cannot start."""
    proc = subprocess.run(
        [sys.executable, "-m", "leafe.services.cli", *verb.split(), "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        from leafe.services.cli import VERBS

        module = VERBS.get(verb.split()[0], ("?",))[0]
        raise AssertionError(
            f"`leafe {verb} --help` exited with {proc.returncode} (is {module} implemented?):\n"
            f"{proc.stderr[-2000:]}"
        )
    return parse_help(verb, proc.stdout)


def parse_help(verb: str, text: str) -> VerbHelp:
    """Options, required options and required exclusive groups from an argparse ``--help`` text."""
    options = frozenset(re.findall(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)", text))
    required, one_of = _parse_usage(_usage_block(text))
    return VerbHelp(verb=verb, options=options, required=required, one_of=one_of)
