"""Every docs/*.md or results/ path the code and docs cite exists in the project."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CITED = re.compile(r"\b((?:docs|results)/[\w./-]*\w)")


def test_cited_docs_exist():
    sources = [p for d in ("runtime", "export", "engines", "tools", "tests", "docs") for p in (REPO / d).rglob("*")
               if p.suffix in (".py", ".md")] + [REPO / "README.md"]
    missing = sorted({f"{src.relative_to(REPO)}: {cite}" for src in sources for cite in CITED.findall(src.read_text())
                      if not (REPO / cite).exists()})
    assert not missing, "cited but not in the project:\n" + "\n".join(missing)
