"""`refusion-run serve --replicas N`: the Ray Serve application from the command line, on a local Ray cluster it
starts and stops; bad input is one error line, exit 1, and nothing left running."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                                   reason="--replicas needs the ray extra: pip install -e '.[ray]'")]
openai = pytest.importorskip("openai")

from tests.gate import HANG_GUARD_S  # noqa: E402
from tests.helpers import REPO  # noqa: E402

REFUSION_RUN = Path(sys.executable).parent / "refusion-run"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ray_processes() -> list[str]:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout.splitlines()
    return [line for line in ps if "raylet" in line or "gcs_server" in line]


def _serve(export: Path, *options: str) -> subprocess.Popen[str]:
    return subprocess.Popen([str(REFUSION_RUN), "serve", str(export), "--backend", "ort-cpu", *options],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_replicas_serve_the_openai_client_and_stop_on_sigterm_leaving_nothing_running(tiny_export) -> None:
    port = _free_port()
    server = _serve(tiny_export, "--replicas", "2", "--http-port", str(port))
    try:
        lines = []
        assert server.stdout is not None
        for line in server.stdout:
            lines.append(line)
            if line.startswith("ready:"):
                break
        else:
            raise AssertionError(f"no ready: line:\n{''.join(lines)}")
        assert f"http://127.0.0.1:{port}/v1" in lines[-1] and "2 replica(s)" in lines[-1]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(model="refusion", messages=[{"role": "user", "content": "sort: 3 1 2"}],
                                                max_tokens=8, temperature=0)
        assert answer.choices[0].message.content == "1 2 3"
        server.send_signal(signal.SIGTERM)
        rest = server.communicate(timeout=HANG_GUARD_S)[0]
        assert server.returncode == 0, "".join(lines) + rest
        assert "draining" in rest and rest.rstrip().endswith("stopped") and "Traceback" not in rest
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert _ray_processes() == []


@pytest.mark.parametrize(("options", "says"), [
    (["--replicas", "0"], "error: replicas=0 (--replicas) must be an integer >= 1."),
    (["--replicas", "1", "--ray-address", "127.0.0.1:1"], "error: --ray-address 127.0.0.1:1: nothing answers there"),
    (["--replicas", "2", "--threads", "4096"], "error: --replicas 2 x --threads 4096 needs 8192 CPUs; the cluster has"),
    (["--replicas", "1", "--api", "triton"], "error: --replicas scales the OpenAI server out through Ray Serve"),
])
def test_bad_input_is_one_error_line_and_nothing_left_running(tiny_export, options, says) -> None:
    server = _serve(tiny_export, "--http-port", str(_free_port()), *options)
    output = server.communicate(timeout=HANG_GUARD_S)[0]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert server.returncode == 1 and len(errors) == 1 and errors[0].startswith(says), output
    assert "Traceback" not in output and _ray_processes() == []


def test_the_docs_config_file_deploys_with_serve_run(tiny_export, tmp_path) -> None:
    """docs/serving.md's Serve config file, as written but for its port, from a directory that has the export at
    out/refusion-onnx as the docs' first example leaves it."""
    doc = (REPO / "docs" / "serving.md").read_text()
    config = doc.split("```yaml\n", 1)[1].split("```", 1)[0]  # the page's one YAML block
    port = _free_port()
    (tmp_path / "refusion-serve.yaml").write_text(config.replace("port: 8000", f"port: {port}"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "refusion-onnx").symlink_to(tiny_export)
    server = subprocess.Popen([str(Path(sys.executable).parent / "serve"), "run", "refusion-serve.yaml"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        deadline = time.monotonic() + HANG_GUARD_S * 2
        while not _healthy(port):  # serve run says nothing of its own when the application is up
            assert server.poll() is None and time.monotonic() < deadline, "serve run did not deploy the application"
            time.sleep(0.5)
        answer = client.chat.completions.create(model="refusion", messages=[{"role": "user", "content": "sort: 3 1 2"}],
                                                max_tokens=8, temperature=0)
        assert answer.choices[0].message.content == "1 2 3"
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=HANG_GUARD_S)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert _ray_processes() == []


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return json.load(response)["status"] == "ready"
    except OSError:
        return False
