"""Talking to the test server: its HTTP API and its metrics."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

MODEL = "refusion"
LONG = {"max_tokens": 960, "mode": "ar"}  # ~3 s of decoding, no EOS on this model


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
