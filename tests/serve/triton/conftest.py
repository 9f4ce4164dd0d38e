"""A real Triton server on loopback, on free ports, over a small random model (no early EOS) whose forwards
the test's gate holds (tests/serve/triton/gate.py): a request stays in flight exactly as long as a test
needs, however fast the machine decodes. Skipped without the serve extra."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from refusion.export.exporter import export_onnx
from refusion.tools.checks.fixtures.checkpoints import TinySpec, make_checkpoint
from tests.serve.triton.gate import Gate
from tests.serve.triton.server import MODEL

RANDOM = TinySpec(seed=1)


@pytest.fixture(scope="session")
def served_export(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serve")
    return export_onnx(make_checkpoint(root / "ckpt", RANDOM), root / "onnx", validate=False)


@pytest.fixture(scope="module")
def gate(tmp_path_factory) -> Gate:
    return Gate(tmp_path_factory.mktemp("gate"))


@pytest.fixture(scope="module")
def server(served_export, gate, tmp_path_factory) -> Iterator[object]:
    pytest.importorskip("pytriton", reason="serving needs the serve extra: pip install -e '.[serve]'")
    from refusion.serve.triton.launcher import Ports, TritonServer, free_ports
    from refusion.serve.triton.settings import ServeSettings

    log = open(tmp_path_factory.mktemp("log") / "triton.log", "wb")
    settings = ServeSettings(str(served_export), backend="ort-cpu", threads=1, max_requests=8, max_batch=8,
                             max_queue=64)
    http, grpc, metrics = free_ports()
    running = TritonServer(served_export, Ports(http, grpc, metrics), settings, MODEL, drain_timeout_s=5, log=log)
    with gate.in_environment():
        running.start()
    yield running
    gate.open()
    running.stop()
    log.close()
