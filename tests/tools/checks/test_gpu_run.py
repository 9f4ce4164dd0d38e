"""On a machine with TensorRT and a GPU: the whole device check (tools/checks/gpu.py). Skipped elsewhere."""

from __future__ import annotations

import sys

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _need_gpu() -> None:
    pytest.importorskip("polygraphy")
    from refusion.runtime.core.errors import RefusionError
    from refusion.runtime.runners.cuda import device_info
    from refusion.runtime.runners.trt_loader import require_tensorrt

    try:
        require_tensorrt()
        device_info()
    except RefusionError as e:
        pytest.skip(f"no TensorRT GPU here: {e}")


def test_gpu_check(tmp_path, monkeypatch):
    _need_gpu()
    from refusion.tools.checks import gpu

    monkeypatch.setattr(sys, "argv", ["gpu", "--workdir", str(tmp_path)])
    assert gpu.main() == 0
