"""Fixtures of the deploy/ tests: every kustomization rendered once per session with ``kubectl kustomize``."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.manifests import DEPLOY, KUSTOMIZATIONS, Doc, render


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[Doc]]:
    """``{short name: rendered documents}`` for every entry of ``KUSTOMIZATIONS``; skips without kubectl."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot render the kustomizations under deploy/")
    with ThreadPoolExecutor(len(KUSTOMIZATIONS)) as pool:
        futures = {name: pool.submit(render, DEPLOY / path, kubectl) for name, path in KUSTOMIZATIONS.items()}
        return {name: future.result() for name, future in futures.items()}
