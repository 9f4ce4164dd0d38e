"""The TensorRT-facing modules type-check against tensorrt-stubs (fixed by tools/checks/trt_stubs.py).

Needs the stubs (`pip install --no-deps --target build/tensorrt-stubs tensorrt-stubs==10.13.0.35.1`)
and mypy; skipped without them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from refusion.tools.checks import trt_stubs

REPO = Path(__file__).resolve().parents[2]
MODULES = ["refusion.engines.build", "refusion.runtime.core.engines_manifest", "refusion.runtime.core.profiles",
           "refusion.engines.check", "refusion.engines.onnx_support", "refusion.runtime.runners.tensorrt",
           "refusion.runtime.runners.cuda", "refusion.runtime.runners.kv_pool"]
# The same settings as [tool.mypy] in pyproject.toml, with this test's own paths.
CONFIG = """[mypy]
python_version = 3.10
mypy_path = {stubs}:{src}
follow_imports = silent
check_untyped_defs = True
warn_unused_ignores = True
[mypy-tensorrt,tensorrt.*,tensorrt_bindings,tensorrt_bindings.*]
ignore_errors = True
[mypy-tensorrt_libs,tensorrt_libs.*,polygraphy.*,cuda.*,onnxruntime.*]
ignore_missing_imports = True
"""


def test_tensorrt_facing_modules_type_check(tmp_path):
    if trt_stubs.find_stubs() is None:
        pytest.skip(f"tensorrt-stubs not installed: pip install --no-deps --target {trt_stubs.STUBS_TARGET} "
                    "tensorrt-stubs==10.13.0.35.1")
    pytest.importorskip("mypy")
    stubs = trt_stubs.write_stubs(tmp_path / "stubs")
    src = trt_stubs.write_package_view(REPO, tmp_path / "src")
    config = tmp_path / "mypy.ini"
    config.write_text(CONFIG.format(stubs=stubs, src=src))
    args = [sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir", str(REPO / "build" / "mypy-cache")]
    for module in MODULES:
        args += ["-m", module]
    result = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_stub_fixes():
    fix_signature = trt_stubs.fix_signature
    assert fix_signature("    def f(self, in: list[int], out: list[int]) -> None:") == \
        "    def f(self, in_: list[int], out: list[int]) -> None:"
    assert fix_signature("    def g(self, a: int = None, b: dict[str, int]) -> X:") == \
        "    def g(self, a: int = None, b: dict[str, int] = ...) -> X:"
    assert fix_signature("    def h(self, *, a: int = 1, b: int) -> None:") == "    def h(self, *, a: int = 1, b: int) -> None:"
    assert fix_signature("x = 1") == "x = 1"
