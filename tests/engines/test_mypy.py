"""The modules pyproject's [tool.mypy] lists type-check, the TensorRT-facing ones against tensorrt-stubs
(fixed by tools/checks/trt_stubs.py), with that configuration as it stands (mypy reads it from pyproject).

Needs the stubs (`pip install --no-deps --target build/tensorrt-stubs tensorrt-stubs==10.13.0.35.1`)
and mypy; skipped without them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from refusion.tools.checks import trt_stubs
from tests.helpers import REPO, pyproject


def test_the_configured_modules_type_check(tmp_path):
    if trt_stubs.find_stubs() is None:
        pytest.skip(f"tensorrt-stubs not installed: pip install --no-deps --target {trt_stubs.STUBS_TARGET} "
                    "tensorrt-stubs==10.13.0.35.1")
    pytest.importorskip("mypy")
    # mypy_path is relative to where mypy runs: lay the stubs and the package view out there, in tmp_path
    stubs, src = (Path(p) for p in pyproject()["tool"]["mypy"]["mypy_path"].split(":"))
    trt_stubs.write_stubs(tmp_path / stubs)
    trt_stubs.write_package_view(REPO, tmp_path / src)
    args = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
            "--cache-dir", str(REPO / "build" / "mypy-cache")]
    result = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"in {len(pyproject()['tool']['mypy']['modules'])} source files" in result.stdout


def test_stub_fixes():
    fix_signature = trt_stubs.fix_signature
    assert fix_signature("    def f(self, in: list[int], out: list[int]) -> None:") == \
        "    def f(self, in_: list[int], out: list[int]) -> None:"
    assert fix_signature("    def g(self, a: int = None, b: dict[str, int]) -> X:") == \
        "    def g(self, a: int = None, b: dict[str, int] = ...) -> X:"
    assert fix_signature("    def h(self, *, a: int = 1, b: int) -> None:") == "    def h(self, *, a: int = 1, b: int) -> None:"
    assert fix_signature("x = 1") == "x = 1"
