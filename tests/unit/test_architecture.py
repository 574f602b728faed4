"""The architecture as tests: no import cycle in the product, bench or experiments; each core
imports only what docs/architecture.md's layer table allows (``protocol`` <- ``envs`` <- ``actors``;
``protocol`` <- ``learner``; ``services`` on top); everyone imports the product as ``leafe.*``;
``bench`` and ``experiments`` build on the product and nothing in it imports them back.

Imports are read from the source with ``ast`` (module level and inside functions, ``TYPE_CHECKING``
blocks included), so a cycle hidden behind a function-level import is found too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "envs", "actors", "learner", "services")
"""The product's top-level folders; each installs as ``leafe.<folder>`` (pyproject's
package-dir)."""
HARNESSES = ("bench", "experiments")
"""Folders beside the product, imported by their own names from the repository root."""
ALLOWED = {
    "protocol": {"protocol"},
    "envs": {"protocol", "envs"},
    "actors": {"protocol", "envs", "actors"},
    "learner": {"protocol", "learner"},
    "services": {"protocol", "envs", "actors", "learner", "services"},
}
"""Product packages each product package may import (docs/architecture.md, "Layout")."""
PROTOCOL_THIRD_PARTY = {"msgspec"}
"""``protocol/`` is pure data: the standard library and msgspec only."""


def _module_name(path: Path) -> str:
    """The name a file is imported by: ``leafe.envs.base`` for ``envs/base.py``, ``bench.host`` for
    bench."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in PACKAGES:
        parts.insert(0, "leafe")
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    folders = (*PACKAGES, *HARNESSES)
    return {_module_name(p): p for top in folders for p in sorted((ROOT / top).rglob("*.py"))}


MODULES = _modules()


def _layer(module: str) -> str:
    """``protocol`` for ``leafe.protocol.events``, ``bench`` for ``bench.host``."""
    parts = module.split(".")
    return parts[1] if parts[0] == "leafe" and len(parts) > 1 else parts[0]


def _resolve(name: str) -> str | None:
    """The project module an import refers to (``a.b.c`` may be a name inside module ``a.b``)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports_in(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Absolute names imported anywhere in ``tree`` (``from x import y`` gives ``x.y`` and
    ``x``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}".strip(".")
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _imports(module: str) -> set[str]:
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return _imports_in(tree, module, path.name == "__init__.py")


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
    """The checker itself: a two-module cycle and a three-module cycle are reported, a chain is
    not."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(_cycles(graph)) == [["a", "b"], ["c", "d", "e"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_the_project() -> None:
    """No module imports itself through others, even through function-level imports."""
    assert _cycles(_graph()) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_its_allowed_layers(package: str) -> None:
    """The layer rules of docs/architecture.md hold for every module of ``package``."""
    bad = []
    for module in (m for m in MODULES if m.startswith(f"leafe.{package}")):
        for name in _imports(module):
            target = _resolve(name)
            if target is None:
                continue
            layer = _layer(target)
            if layer in HARNESSES:
                bad.append(
                    f"{module} imports {name} (the product never imports bench or experiments)"
                )
            elif layer not in ALLOWED[package]:
                bad.append(f"{module} imports {name}")
    assert bad == []


def _all_python_files() -> list[Path]:
    return [
        p for top in (*PACKAGES, *HARNESSES, "tests") for p in sorted((ROOT / top).rglob("*.py"))
    ]


def test_nothing_imports_the_product_by_its_folder_name() -> None:
    """Everyone imports ``leafe.envs``, never ``envs``: the folder names are not installed, so a
    bare import works from the repository root and breaks in a user's install."""
    bad = []
    for path in _all_python_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for name in _imports_in(tree, "", False):
            if name.split(".")[0] in PACKAGES:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert bad == []


def test_protocol_is_pure_data() -> None:
    """``protocol/`` imports the standard library and msgspec only."""
    import sys

    bad = []
    for module in (m for m in MODULES if m.startswith("leafe.protocol")):
        for name in _imports(module):
            top = name.split(".")[0]
            allowed = top in sys.stdlib_module_names or top in PROTOCOL_THIRD_PARTY
            if top and not allowed and not name.startswith("leafe.protocol"):
                bad.append(f"{module} imports {name}")
    assert bad == []


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [("bench", {"experiments", "tests"}), ("experiments", set()), ("tests", {"experiments"})],
)
def test_harnesses_depend_on_the_product_never_the_reverse(
    folder: str, forbidden: set[str]
) -> None:
    """bench measures the product with product code (no test helpers, no experiment); experiments
    build on both; the product's tests never need experiments/ (it can be removed and the product
    still tests)."""
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for name in _imports_in(tree, "", False):
            if name.split(".")[0] in forbidden:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert bad == []


SERVICE_ROLES = ("actor", "replayer", "learner", "weight_sync", "eval", "admin")
"""``services/`` packages named as deploy/ runs them; each imports only what is below it."""


def _services_level(module: str) -> int:
    """0: what every role shares (the top modules, ``bus``, ``eventlog``, ``inference``); 1: a role;
    2: ``run`` (the supervisor that starts the roles); 3: ``cli`` (imports every verb lazily)."""
    parts = module.split(".")
    part = parts[2] if len(parts) > 2 else ""
    if part == "run":
        return 2
    if part == "cli":
        return 3
    return 1 if part in SERVICE_ROLES else 0


def test_services_has_no_role_module_at_its_top_level() -> None:
    """Every deployable role is a package of its own; only what all roles share stays at the top."""
    shared = {
        "__init__",
        "cli",
        "config",
        "figures",
        "lifetime",
        "logsetup",
        "metrics",
        "probes",
        "threads",
    }
    top = {p.stem for p in (ROOT / "services").glob("*.py")}
    assert top <= shared, sorted(top - shared)
    assert all((ROOT / "services" / role / "__init__.py").is_file() for role in SERVICE_ROLES)


def test_services_never_import_upwards() -> None:
    """Shared modules import no role, a role imports no ``run``: a role can be deployed without the
    supervisor, and the shared infrastructure without any role."""
    bad = []
    for module in (m for m in MODULES if m.startswith("leafe.services.")):
        for name in _imports(module):
            target = _resolve(name)
            if (
                target
                and target.startswith("leafe.services.")
                and _services_level(target) > _services_level(module)
            ):
                bad.append(f"{module} imports {target}")
    assert bad == []
