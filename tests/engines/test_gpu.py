"""On a machine with TensorRT and a GPU: the whole device check (tools/gpu_check.py). Skipped elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def _need_gpu() -> None:
    pytest.importorskip("polygraphy")
    from refusion.runtime.core.errors import RefusionError
    from refusion.runtime.runners.cuda import device_info
    from refusion.runtime.runners.tensorrt import require_tensorrt

    try:
        require_tensorrt()
        device_info()
    except RefusionError as e:
        pytest.skip(f"no TensorRT GPU here: {e}")


def test_gpu_check(tmp_path, monkeypatch):
    _need_gpu()
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(sys, "argv", ["gpu_check", "--workdir", str(tmp_path)])
    assert gpu_check.main() == 0
