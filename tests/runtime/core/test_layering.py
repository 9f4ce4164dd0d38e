"""The package layering holds, so there are no cycles between packages: the core imports only itself; the decode
strategies never see a runner, and know of structured output only its grammar interface, which needs nothing of
theirs; the runtime never imports export/, engines/, serve/ or tools/; engines/ never imports tools/, and its build
TensorRT's loader but not the runner; serve/ only the runtime (its frontend seam not even a frontend); the PyTorch
reference oracle nothing of ours; only serve/rayserve imports Ray; nothing installed imports the tests; and no
module imports itself back through others (an import circle), not even for typing."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import REPO, pyproject

RUNTIME, EXPORT, ENGINES, SERVE, TOOLS = (f"refusion.{p}" for p in ("runtime", "export", "engines", "serve", "tools"))
# package (a folder, with everything under it) or module -> the refusion packages it may import (besides itself)
ALLOWED = {
    "runtime/core": ("refusion.runtime.core",),
    "runtime/decode": ("refusion.runtime.core", "refusion.runtime.decode", "refusion.runtime.params",
                       "refusion.runtime.structured"),
    "runtime/structured": ("refusion.runtime.core", "refusion.runtime.structured", "refusion.runtime.options"),
    # a runner takes rows (of a Forward: its type alone), never the strategies' table or the params (issue 43:
    # the scheduler cuts, the Generator asks the strategies what a request needs)
    "runtime/runners": ("refusion.runtime.core", "refusion.runtime.runners", "refusion.runtime.decode.steps"),
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


RAY_USERS = ("serve/rayserve", "tools/bench/measure/scale_out.py")  # the ray extra's: nothing else imports Ray


def test_only_the_ray_serve_application_imports_ray():
    users = {f for where in RAY_USERS for f in _files(where)}
    bad = [f"{f.relative_to(REPO)}: {name}" for where in INSTALLED for f in _files(where) if f not in users
           for name in sorted(_imports(f)) if name == "ray" or name.startswith("ray.")]
    assert not bad, "Ray imported outside serve/rayserve (the ray extra):\n" + "\n".join(bad)


def test_every_package_folder_is_installed_under_its_name():
    """pyproject's package-dir maps each refusion.* package to its folder; a new folder must be listed."""
    setuptools = pyproject()["tool"]["setuptools"]
    mapped = {folder for folder in setuptools["package-dir"].values()}
    assert set(setuptools["packages"]) == set(setuptools["package-dir"])
    folders = {str(p.parent.relative_to(REPO)) for where in INSTALLED for p in (REPO / where).rglob("__init__.py")}
    assert folders == mapped, f"folders not mapped: {sorted(folders - mapped)}; mapped, not folders: {sorted(mapped - folders)}"


def _product_modules() -> dict[str, Path]:
    modules = {}
    for where in ("runtime", "export", "engines", "serve", "tools"):
        for file in (REPO / where).rglob("*.py"):
            name = "refusion." + ".".join(file.relative_to(REPO).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = file
    return modules


def _module_imports(file: Path, modules: dict[str, Path]) -> set[str]:
    """The product modules `file` imports anywhere (functions and TYPE_CHECKING blocks included); `from package
    import module` imports that module."""
    found = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & set(modules)


def _circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {stack.pop()}
            while v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.add(frozenset(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_in_product_code():
    modules = _product_modules()
    circles = _circles({name: _module_imports(file, modules) - {name} for name, file in modules.items()})
    found = sorted(sorted(c) for c in circles)
    assert not found, f"import circles: {found}; break them (a leaf module both sides import, or a seam one side owns)"


def test_the_circle_finder_finds_a_circle_and_only_it():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == {frozenset("abc")}
