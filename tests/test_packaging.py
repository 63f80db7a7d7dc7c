"""The wheel's package list names every package of the source tree (an editable install would hide a gap)."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_directory_is_in_the_package_list():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    dirs = {name: ROOT / path for name, path in setup["package-dir"].items()}
    found = set()
    for top in ("autopar", "autopar.passes", "autopar.cost_model", "autopar.triton_kernels"):
        for init in dirs[top].rglob("__init__.py"):
            rel = init.parent.relative_to(dirs[top])
            found.add(".".join((top, *rel.parts)))
    assert found - listed == set(), "packages missing from pyproject.toml [tool.setuptools] packages"
    assert listed - found == set(), "pyproject.toml lists packages that have no __init__.py"
