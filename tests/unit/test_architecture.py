"""The architecture as tests: no import cycle inside the project's packages, and each core imports only
what DESIGN.md's layer table allows (``protocol`` <- ``envs`` <- ``actors``; ``protocol`` <- ``learner``;
``services`` on top; ``bench`` and ``tests`` may import anything but are never imported by the product).

Imports are read from the source with ``ast`` (module level and inside functions, ``TYPE_CHECKING``
blocks included), so a cycle hidden behind a function-level import is found too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "envs", "actors", "learner", "services")
ALLOWED = {
    "protocol": {"protocol"},
    "envs": {"protocol", "envs"},
    "actors": {"protocol", "envs", "actors"},
    "learner": {"protocol", "learner"},
    "services": {"protocol", "envs", "actors", "learner", "services"},
}
"""Project packages each package may import (DESIGN.md, "Layout")."""
PROTOCOL_THIRD_PARTY = {"msgspec"}
"""``protocol/`` is pure data: the standard library and msgspec only."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module an import refers to (``a.b.c`` may be a name inside module ``a.b``)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str) -> set[str]:
    """Absolute names imported anywhere in ``module`` (``from x import y`` gives ``x.y`` and ``x``)."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}".strip(".")
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        targets = {_resolve(n) for n in _imports(module)} - {None, module}
        graph[module] = {t for t in targets if t is not None and not module.startswith(f"{t}.")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The checker itself: a two-module cycle and a three-module cycle are reported, a chain is not."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(_cycles(graph)) == [["a", "b"], ["c", "d", "e"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_the_project() -> None:
    """No module imports itself through others, even through function-level imports."""
    assert _cycles(_graph()) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_its_allowed_layers(package: str) -> None:
    """The layer rules of DESIGN.md hold for every module of ``package``."""
    bad = []
    for module in (m for m in MODULES if m.split(".")[0] == package):
        for name in _imports(module):
            top = name.split(".")[0]
            if top in PACKAGES and top not in ALLOWED[package]:
                bad.append(f"{module} imports {name}")
            if top in ("bench", "tests"):
                bad.append(f"{module} imports {name} (product code never imports bench or tests)")
    assert bad == []


def test_protocol_is_pure_data() -> None:
    """``protocol/`` imports the standard library and msgspec only."""
    import sys

    bad = []
    for module in (m for m in MODULES if m.startswith("protocol")):
        for name in _imports(module):
            top = name.split(".")[0]
            if top and top not in sys.stdlib_module_names and top not in PROTOCOL_THIRD_PARTY | {"protocol"}:
                bad.append(f"{module} imports {name}")
    assert bad == []


def test_bench_does_not_import_tests() -> None:
    """Benchmarks build their data with product code (``actors.fakes`` ...), not with test helpers."""
    bad = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tests":
                bad.append(f"{path.name} imports {node.module}")
            if isinstance(node, ast.Import):
                bad += [
                    f"{path.name} imports {a.name}" for a in node.names if a.name.split(".")[0] == "tests"
                ]
    assert bad == []


SERVICE_ROLES = ("actor", "replayer", "learner", "weight_sync", "eval", "admin")
"""``services/`` packages named as deploy/ runs them; each imports only what is below it."""


def _services_level(module: str) -> int:
    """0: what every role shares (the top modules, ``bus``, ``eventlog``, ``inference``); 1: a role;
    2: ``run`` (the supervisor that starts the roles); 3: ``cli`` (imports every verb lazily)."""
    part = module.split(".")[1] if module.count(".") else ""
    if part == "run":
        return 2
    if part == "cli":
        return 3
    return 1 if part in SERVICE_ROLES else 0


def test_services_has_no_role_module_at_its_top_level() -> None:
    """Every deployable role is a package of its own; only what all roles share stays at the top."""
    shared = {"__init__", "cli", "config", "figures", "lifetime", "logsetup", "metrics", "probes", "threads"}
    top = {p.stem for p in (ROOT / "services").glob("*.py")}
    assert top <= shared, sorted(top - shared)
    assert all((ROOT / "services" / role / "__init__.py").is_file() for role in SERVICE_ROLES)


def test_services_never_import_upwards() -> None:
    """Shared modules import no role, a role imports no ``run``: a role can be deployed without the
    supervisor, and the shared infrastructure without any role."""
    bad = []
    for module in (m for m in MODULES if m.startswith("services.")):
        for name in _imports(module):
            target = _resolve(name)
            if (
                target
                and target.startswith("services.")
                and _services_level(target) > _services_level(module)
            ):
                bad.append(f"{module} imports {target}")
    assert bad == []
