"""The package layering holds: the core imports only itself, the runtime never imports export/,
engines/, serve/ or tools/, engines/ never imports tools/, and serve/ only the runtime (so there
are no cycles between them)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
# package -> the refusion packages it may import (besides itself)
ALLOWED = {
    "runtime/core": ("refusion.runtime.core",),
    "runtime": ("refusion.runtime",),
    "export": ("refusion.runtime", "refusion.export"),
    "engines": ("refusion.runtime", "refusion.export", "refusion.engines"),
    "serve": ("refusion.runtime", "refusion.serve"),
}


def _imports(file: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("refusion")}


@pytest.mark.parametrize("package", list(ALLOWED))
def test_package_imports_only_what_it_may(package):
    allowed = ALLOWED[package]
    files = sorted((REPO / package).rglob("*.py"))
    assert files
    bad = [f"{f.relative_to(REPO)}: {name}" for f in files for name in sorted(_imports(f))
           if not any(name == a or name.startswith(a + ".") for a in allowed)]
    assert not bad, "imports across the layering:\n" + "\n".join(bad)
