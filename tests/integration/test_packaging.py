"""The install: one top-level name, ``leafe``, and everything the product needs inside it.

The wheel is built from this checkout and installed with ``--no-deps`` into a fresh virtual
environment; the dependencies come from the development environment through a path file added after
the install, so that what the wheel itself put into site-packages can be listed first. Every module
is then imported from the installed copy (not from this checkout), which finds a package missing
from pyproject's list or a file missing from the package data.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("protocol", "envs", "actors", "learner", "services")

pytestmark = pytest.mark.integration


def test_pyproject_lists_every_package_of_the_product() -> None:
    """Each folder with an ``__init__.py`` under the product's folders is in pyproject's package
    list, under its installed name (``envs/sokoban`` -> ``leafe.envs.sokoban``), and nothing else
    is."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {
        "leafe." + ".".join(init.parent.relative_to(ROOT).parts)
        for top in PRODUCT
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert set(config["packages"]) == on_disk
    assert config["package-dir"] == {f"leafe.{top}": top for top in PRODUCT}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str]]:
    """A fresh venv with the wheel installed: its python, and the names the wheel added to
    site-packages."""
    base = tmp_path_factory.mktemp("wheel")
    dist = base / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = dist.glob("leafe-*.whl")
    env_dir = base / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    before = set(os.listdir(site))
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
        check=True,
        timeout=300,
    )
    added = set(os.listdir(site)) - before
    (site / "zz_dev_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, added


def test_the_wheel_adds_only_leafe_to_site_packages(installed: tuple[Path, set[str]]) -> None:
    """``pip install leafe`` takes one global name (plus its metadata), none of the generic folder
    names."""
    _, added = installed
    names = {n for n in added if not n.endswith(".dist-info") and n != "__pycache__"}
    assert names == {"leafe"}
    assert {n for n in added if n.endswith(".dist-info")} == {"leafe-0.1.0.dist-info"}


def test_leafe_help_and_every_module_import_from_the_install(
    installed: tuple[Path, set[str]],
) -> None:
    """The ``leafe`` command works there, and every module of the wheel imports from the installed
    copy."""
    python, _ = installed
    bindir = python.parent
    help_ = subprocess.run(
        [str(bindir / "leafe"), "--help"], capture_output=True, text=True, cwd="/", timeout=60
    )
    assert help_.returncode == 0, help_.stderr
    assert "usage: leafe <verb>" in help_.stdout and "replay" in help_.stdout
    script = (
        "import importlib, pkgutil, leafe, sys\n"
        "names = sorted(m.name for m in pkgutil.walk_packages(leafe.__path__, 'leafe.'))\n"
        "for name in names:\n"
        "    if not name.endswith('.__main__'):\n"
        "        importlib.import_module(name)\n"
        "roots = {sys.modules[n].__file__.split('/leafe/')[0] for n in names if not "
        "n.endswith('.__main__')}\n"
        "print(len(names), *roots)\n"
    )
    env = {**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [str(python), "-c", script], capture_output=True, text=True, cwd="/", env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    count, *roots = out.stdout.split()
    assert int(count) > 150
    assert roots == [
        str(
            Path(python).parent.parent
            / "lib"
            / f"python{sys.version_info.major}.{sys.version_info.minor}"
            / "site-packages"
        )
    ]
    assert (
        Path(roots[0]) / "leafe" / "services" / "inference" / "csrc" / "decode_attention.c"
    ).is_file()
