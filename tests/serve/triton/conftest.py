"""A real Triton server on loopback, on free ports, over a small random model that is slow enough
(~3 ms a token) for requests to be caught mid-flight; skipped without the serve extra."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from refusion.export.exporter import export_onnx
from refusion.tools.checks.fixtures.checkpoints import TinySpec, make_checkpoint
from tests.serve.triton.server import MODEL

SLOW = TinySpec(num_layers=4, hidden_size=256, num_heads=8, kv_heads=2, head_dim=32, intermediate_size=768, seed=1)


@pytest.fixture(scope="session")
def slow_export(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serve")
    return export_onnx(make_checkpoint(root / "ckpt", SLOW), root / "onnx", validate=False)


@pytest.fixture(scope="module")
def server(slow_export, tmp_path_factory) -> Iterator[object]:
    pytest.importorskip("pytriton", reason="serving needs the serve extra: pip install -e '.[serve]'")
    from refusion.serve.triton.launcher import Ports, TritonServer, free_ports
    from refusion.serve.triton.settings import ServeSettings

    log = open(tmp_path_factory.mktemp("log") / "triton.log", "wb")
    settings = ServeSettings(str(slow_export), backend="ort-cpu", threads=1, max_requests=8, max_batch=8, max_queue=64)
    http, grpc, metrics = free_ports()
    with TritonServer(slow_export, Ports(http, grpc, metrics, "127.0.0.1"), settings, MODEL, drain_timeout_s=5,
                      log=log) as running:
        yield running
    log.close()
