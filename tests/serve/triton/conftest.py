"""A real Triton server on loopback, on free ports, over a small random model that is slow enough
(~3 ms a token) for requests to be caught mid-flight; skipped without the serve extra."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from refusion.export.exporter import export_onnx
from tests.fixtures.checkpoints import TinySpec, make_checkpoint

MODEL = "refusion"
SLOW = TinySpec(num_layers=4, hidden_size=256, num_heads=8, kv_heads=2, head_dim=32, intermediate_size=768, seed=1)
LONG = {"max_tokens": 960, "mode": "ar"}  # ~3 s of decoding, no EOS on this model


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


def post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(server, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not among the server's metrics")


def wait_idle(server, timeout: float = 10) -> float:
    """Seconds until no request is in flight and no KV region is held (fails after `timeout`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if metric(server, "refusion_requests_in_flight") == 0 and metric(server, "refusion_kv_slots_in_use") == 0:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"requests or KV regions still held after {timeout} s")
