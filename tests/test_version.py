"""The version is declared once (mlx_dgemma/_version.py): the package metadata, the package,
``--version`` and a trace's header read it."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from mlx_dgemma._version import __version__ as declared
from mlx_dgemma.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_reads_the_version_from_the_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "mlx_dgemma._version.__version__"}


def test_the_version_is_assigned_in_one_module_only():
    assigned = []
    for path in sorted(p for folder in ("mlx_dgemma", "convert", "tui") for p in (ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == "__version__" for t in targets):
                assigned.append(path.relative_to(ROOT).as_posix())
    assert assigned == ["mlx_dgemma/_version.py"]


def test_version_flag_and_package_say_the_declared_version(capsys):
    import mlx_dgemma

    assert mlx_dgemma.__version__ == declared
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"mlx-dgemma {declared}\n"
