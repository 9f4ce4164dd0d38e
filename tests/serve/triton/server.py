"""Talking to the test servers: their HTTP API and metrics, and `refusion-run serve` as a process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.serve.triton.gate import Gate

MODEL = "refusion"
LONG = {"max_tokens": 960, "mode": "ar"}  # far more forwards than a test lets through the gate


def post(url: str, body: dict, timeout: float = 60, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    """(status, body); status 0 for a connection cut before an answer (a draining server may cut one)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError) as e:
        return 0, str(e).encode()


def metric(server, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not among the server's metrics")


def wait_until(condition, what: str, timeout: float = 120) -> None:
    """Poll `condition` until it holds; `timeout` only fails a test that would otherwise hang."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(0.02)


def wait_idle(server) -> None:
    """Until no request is in flight and no KV region is held."""
    wait_until(lambda: metric(server, "refusion_requests_in_flight") == 0
               and metric(server, "refusion_kv_slots_in_use") == 0, "requests or KV regions still held")


def start_cli(export: Path, ports: list[int], gate: Gate | None, *args: str,
              env: dict | None = None) -> subprocess.Popen:
    """`refusion-run serve` as a process (its output on its stdout pipe), once it prints `ready:`."""
    http_port, grpc_port, metrics_port = ports
    process = subprocess.Popen(
        [str(gate.python) if gate else sys.executable, "-m", "refusion.tools.run_cli", "serve", str(export),
         "--api", "triton", "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), "--backend", "ort-cpu",
         "--threads", "1", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(gate.env if gate else {}), **(env or {})})
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith(b"ready:"):
            return process
    raise AssertionError(f"the server did not start (exit code {process.wait()}): {b''.join(lines).decode()}")
