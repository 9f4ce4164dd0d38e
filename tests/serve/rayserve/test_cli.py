"""`refusion-run serve --replicas N`: the Ray Serve application from the command line, on a local Ray cluster it
starts and stops; bad input is one error line, exit 1, and nothing left running."""

from __future__ import annotations

import asyncio
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
httpx = pytest.importorskip("httpx")

from refusion.runtime.generator import Generator  # noqa: E402
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


def test_replicas_serve_the_openai_client_and_drain_on_sigterm_leaving_nothing_running(tiny_export) -> None:
    port = _free_port()  # one request running a replica: the load takes seconds, the drain with them
    server = _serve(tiny_export, "--replicas", "2", "--max-requests", "1", "--max-queue", "300", "--http-port", str(port))
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
        replies, refused = asyncio.run(_load_and_stop(server, f"http://127.0.0.1:{port}"))
        # every request in flight at the signal is answered whole; one sent while draining is refused, retryably
        assert [r.status_code for r in replies] == [200] * len(replies)
        with Generator.from_dir(tiny_export, backend="ort-cpu", threads=1) as gen:
            assert [_text(r) for r in replies] == [gen.generate(messages=[{"role": "user", "content": p}], chat=True,
                                                                regex=_ASK["guided_regex"], max_tokens=100,
                                                                temperature=0, mode="ar").text for p in _PROMPTS]
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_unavailable", refused.text
        rest = server.communicate(timeout=HANG_GUARD_S)[0]
        assert server.returncode == 0, "".join(lines) + rest
        assert "draining" in rest and rest.rstrip().endswith("stopped") and "Traceback" not in rest
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert _ray_processes() == []


def _text(reply: httpx.Response) -> str:
    """A chat answer's text, streamed (whole: ended by [DONE], no error event) or not."""
    if not reply.headers["content-type"].startswith("text/event-stream"):
        return reply.json()["choices"][0]["message"]["content"]
    assert reply.text.endswith("data: [DONE]\n\n") and '"error"' not in reply.text, reply.text
    events = [json.loads(e[6:]) for e in reply.text.split("\n\n") if e and e != "data: [DONE]"]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))


_PROMPTS = [f"sort: {i % 10} {i % 7} {i % 3}" for i in range(100)]
_ASK = {"max_tokens": 100, "temperature": 0, "mode": "ar", "guided_regex": "[0-9]{100}"}  # 100 forwards a request


async def _load_and_stop(server: subprocess.Popen[str], url: str) -> tuple[list[httpx.Response], httpx.Response]:
    """A request of _ASK for each of _PROMPTS (every other streamed); SIGTERM once 10 are answered; once /health
    says the server drains (the others still running: 100 forwards each, one request at a time a replica; about
    0.2 s after the signal against 10 s of load here), one request more. The replies to the load and to that one."""
    bodies = [{"model": "refusion", "messages": [{"role": "user", "content": p}], "stream": bool(i % 2), **_ASK}
              for i, p in enumerate(_PROMPTS)]
    async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S,
                                 limits=httpx.Limits(max_connections=len(bodies) + 2)) as client:
        sending = [asyncio.ensure_future(client.post("/v1/chat/completions", json=body)) for body in bodies]
        pending: set[asyncio.Future[httpx.Response]] = set(sending)
        while len(sending) - len(pending) < 10:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        server.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + HANG_GUARD_S
        while (await client.get("/health")).json()["status"] != "draining":
            assert time.monotonic() < deadline and not all(task.done() for task in sending), "no drain seen"
        late = await client.post("/v1/chat/completions", json=bodies[0])
        assert not all(task.done() for task in sending), "the load ended before the drain could refuse a request"
        return list(await asyncio.gather(*sending)), late


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
