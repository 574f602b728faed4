"""Fixtures of the deploy/ tests: every kustomization, and every overlay with every combination of
optional components stacked on it, rendered once per session with ``kubectl kustomize``."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.manifests import (
    COMPONENT_STACKS,
    DEPLOY,
    KUSTOMIZATIONS,
    OVERLAYS,
    Doc,
    Stacks,
    render,
    render_stack,
)


@pytest.fixture(scope="session")
def kubectl() -> str:
    """Path of kubectl; skips the deploy tests without it."""
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed: cannot render the kustomizations under deploy/")
    return path


@pytest.fixture(scope="session")
def rendered(kubectl: str) -> dict[str, list[Doc]]:
    """``{short name: rendered documents}`` for every entry of ``KUSTOMIZATIONS``."""
    with ThreadPoolExecutor(len(KUSTOMIZATIONS)) as pool:
        futures = {
            name: pool.submit(render, DEPLOY / path, kubectl)
            for name, path in KUSTOMIZATIONS.items()
        }
        return {name: future.result() for name, future in futures.items()}


@pytest.fixture(scope="session")
def stacks(kubectl: str, tmp_path_factory: pytest.TempPathFactory) -> Stacks:
    """``{(overlay, components): documents}`` for every overlay and every ``COMPONENT_STACKS``
    entry."""
    root: Path = tmp_path_factory.mktemp("stacks")
    jobs = [(overlay, combo) for overlay in OVERLAYS for combo in COMPONENT_STACKS]
    with ThreadPoolExecutor(4) as pool:
        futures = {
            (overlay, combo): pool.submit(
                render_stack, overlay, combo, root / f"{overlay}-{'+'.join(combo)}", kubectl
            )
            for overlay, combo in jobs
        }
        return {key: future.result() for key, future in futures.items()}


@pytest.fixture(scope="session")
def full_stacks(stacks: Stacks) -> Stacks:
    """The largest stacks: every optional component, with one sandbox or the other, per overlay."""
    return {key: docs for key, docs in stacks.items() if len(key[1]) == 4}
