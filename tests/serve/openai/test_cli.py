"""`refusion-run serve --api openai` as a user runs it: a child process on a free loopback port that prints
`ready:`, answers the openai client, and on SIGTERM with an idle keep-alive connection open drains and exits 0."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner

from refusion.tools.run_cli import cli
from tests.serve.openai.helpers import HANG_GUARD_S

REFUSION_RUN = Path(sys.executable).parent / "refusion-run"


def test_tritons_ports_are_refused_with_the_openai_api(tiny_export):
    result = CliRunner().invoke(cli, ["serve", str(tiny_export), "--grpc-port", "9001"])
    assert result.exit_code != 0 and "--grpc-port is Triton's" in result.output


def test_every_interface_without_a_key_is_warned_about_and_a_taken_port_is_one_error_line(tiny_export):
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    try:
        result = CliRunner().invoke(cli, ["serve", str(tiny_export), "--address", "0.0.0.0", "--backend", "ort-cpu",
                                          "--http-port", str(taken.getsockname()[1])])
    finally:
        taken.close()
    assert result.output.startswith("warning: serving on 0.0.0.0 without an API key")
    assert result.exit_code == 1 and result.output.splitlines()[-1].startswith("error: port ")
    assert "is in use" in result.output.splitlines()[-1]


@pytest.mark.slow
def test_serve_answers_the_openai_client_and_drains_on_sigterm_with_exit_0(tiny_export):
    server = subprocess.Popen([str(REFUSION_RUN), "serve", str(tiny_export), "--http-port", "0", "--backend", "ort-cpu",
                               "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = []
        assert server.stdout is not None
        for line in server.stdout:
            lines.append(line)
            if line.startswith("ready:"):
                break
        else:
            raise AssertionError(f"no ready: line:\n{''.join(lines)}")
        url = re.search(r"(http://127\.0\.0\.1:\d+)/v1", lines[-1]).group(1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(model="refusion", messages=[{"role": "user", "content": "sort: 3 1 2"}],
                                                max_tokens=8)
        assert answer.choices[0].finish_reason in ("stop", "length")
        host, port = url.removeprefix("http://").split(":")
        idle = socket.create_connection((host, int(port)))  # a keep-alive connection, idle between requests
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert idle.recv(4096).startswith(b"HTTP/1.1 200")
        server.send_signal(signal.SIGTERM)
        rest = server.communicate(timeout=HANG_GUARD_S)[0]
        idle.close()
        assert server.returncode == 0, "".join(lines) + rest
        assert "SIGTERM: draining" in rest and "stopped" in rest and "Traceback" not in rest
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
