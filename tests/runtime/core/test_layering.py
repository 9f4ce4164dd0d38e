"""The package layering holds, so there are no cycles between packages: the core imports only itself; the decode
strategies never see a runner; the runtime never imports export/, engines/, serve/ or tools/; engines/ never
imports tools/, and its build TensorRT's loader but not the runner; serve/ only the runtime (its frontend seam
not even a frontend); the PyTorch reference oracle nothing of ours; and nothing installed imports the tests."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import REPO, pyproject

RUNTIME, EXPORT, ENGINES, SERVE, TOOLS = (f"refusion.{p}" for p in ("runtime", "export", "engines", "serve", "tools"))
# package (a folder, with everything under it) or module -> the refusion packages it may import (besides itself)
ALLOWED = {
    "runtime/core": ("refusion.runtime.core",),
    "runtime/decode": ("refusion.runtime.core", "refusion.runtime.decode", "refusion.runtime.params"),
    "runtime/runners": ("refusion.runtime.core", "refusion.runtime.runners", "refusion.runtime.decode",
                        "refusion.runtime.params"),
    "runtime": (RUNTIME,),
    "export": (RUNTIME, EXPORT),
    "engines": (RUNTIME, EXPORT, ENGINES),
    # the build loads TensorRT but runs no engine: its loader, never the runner
    "engines/build.py": ("refusion.runtime.core", "refusion.runtime.runners.trt_loader", EXPORT, ENGINES),
    "serve": (RUNTIME, SERVE),
    "serve/frontend.py": (RUNTIME,),
    "tools": (RUNTIME, EXPORT, ENGINES, SERVE, TOOLS, "refusion.models"),
    "tools/bench/reference.py": (),  # independent of what it checks
}
INSTALLED = ("refusion", "runtime", "export", "engines", "serve", "tools", "models")


def _imports(file: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _files(where: str) -> list[Path]:
    path = REPO / where
    return [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))


@pytest.mark.parametrize("where", list(ALLOWED))
def test_package_imports_only_what_it_may(where):
    allowed = ALLOWED[where]
    files = _files(where)
    assert files
    bad = [f"{f.relative_to(REPO)}: {name}" for f in files for name in sorted(_imports(f))
           if name.startswith("refusion") and not any(name == a or name.startswith(a + ".") for a in allowed)]
    assert not bad, "imports across the layering:\n" + "\n".join(bad)


def test_nothing_installed_imports_the_tests():
    bad = [f"{f.relative_to(REPO)}: {name}" for where in INSTALLED for f in _files(where)
           for name in sorted(_imports(f)) if name == "tests" or name.startswith("tests.")]
    assert not bad, "installed code importing tests/:\n" + "\n".join(bad)


def test_every_package_folder_is_installed_under_its_name():
    """pyproject's package-dir maps each refusion.* package to its folder; a new folder must be listed."""
    setuptools = pyproject()["tool"]["setuptools"]
    mapped = {folder for folder in setuptools["package-dir"].values()}
    assert set(setuptools["packages"]) == set(setuptools["package-dir"])
    folders = {str(p.parent.relative_to(REPO)) for where in INSTALLED for p in (REPO / where).rglob("__init__.py")}
    assert folders == mapped, f"folders not mapped: {sorted(folders - mapped)}; mapped, not folders: {sorted(mapped - folders)}"
