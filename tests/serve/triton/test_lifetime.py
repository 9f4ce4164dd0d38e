"""What outlives `refusion-run serve`, and what it says when part of it dies: SIGKILL of the CLI leaves no
process, directory or shared memory and the next start on the same ports works; a dead stub fails
readiness and stops the server with an error line; a killed tritonserver ends the CLI with one; taken ports,
bad addresses and failed loads are one error line before (or instead of) Triton's report. Each waits for
the state it checks, never for a guessed time."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from refusion.serve.triton import lifetime
from refusion.serve.triton.launcher import free_ports
from refusion.tools.run_cli import cli
from tests.serve.triton.server import MODEL, get, post, start_cli, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _serve_extra():
    pytest.importorskip("pytriton")


def _children(pid: int, name: str) -> list[int]:
    return [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/stat")
            if _field(p, 1) == str(pid) and (p.parent / "comm").read_text().strip() == name]


def _field(stat: Path, index: int) -> str | None:
    try:
        text = stat.read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()[index]


def _alive(pid: int) -> bool:
    return lifetime.start_time(pid) is not None


def _workdirs(pid: int) -> list[Path]:
    return [d for d in Path(tempfile.gettempdir()).glob(f"{lifetime.WORKDIR_PREFIX}*")
            if (d / lifetime.OWNER_FILE).is_file() and (d / lifetime.OWNER_FILE).read_text().split()[0] == str(pid)]


def _processes(cli_pid: int) -> tuple[int, int]:
    (triton,) = _children(cli_pid, "tritonserver")
    (stub,) = lifetime.stubs(triton)
    return triton, stub


def test_sigkill_of_the_cli_leaves_nothing_and_the_next_start_on_its_ports_works(served_export):
    ports = free_ports()
    process = start_cli(served_export, ports, None)
    triton, stub = _processes(process.pid)
    (workdir,) = _workdirs(process.pid)
    process.kill()
    process.wait()
    wait_until(lambda: not _alive(triton) and not _alive(stub), "tritonserver and its stub end with the CLI")
    # What only the next start can remove: the work directory and its shared memory.
    assert workdir.exists()
    again = start_cli(served_export, ports, None)
    try:
        assert not workdir.exists() and not list(lifetime.SHM.glob(f"{workdir.name}-*"))
        status, body = post(f"http://127.0.0.1:{ports[0]}/v2/models/{MODEL}/generate", {"text_input": "hi", "max_tokens": 8,
                                                                                        "mode": "ar"})
        assert status == 200, body
    finally:
        again.send_signal(signal.SIGTERM)
        assert again.wait(timeout=120) == 0
    assert not _workdirs(again.pid)


def test_a_dead_stub_fails_readiness_and_stops_the_server_with_an_error_line(served_export):
    ports = free_ports()
    process = start_cli(served_export, ports, None)
    _, stub = _processes(process.pid)
    os.kill(stub, signal.SIGKILL)  # as the OOM killer would
    wait_until(lambda: get(f"http://127.0.0.1:{ports[0]}/v2/health/ready")[0] in (0, 503),
               "readiness fails once the stub is dead")
    assert process.wait(timeout=120) == 1
    output = process.stdout.read().decode()
    assert f"error: the model's Python-backend stub (pid {stub}) died" in output
    assert output.rstrip().splitlines()[-1].startswith("error: ") and "Traceback" not in output
    assert not _workdirs(process.pid)


def test_a_killed_tritonserver_ends_the_cli_with_an_error_line(served_export):
    process = start_cli(served_export, free_ports(), None)
    triton, stub = _processes(process.pid)
    os.kill(triton, signal.SIGKILL)
    assert process.wait(timeout=120) == 1
    output = process.stdout.read().decode()
    assert output.rstrip().splitlines()[-1] == ("error: tritonserver was killed by SIGKILL while serving; its log "
                                                "above says why, if it could.")
    wait_until(lambda: not _alive(stub), "the stub ends with tritonserver")
    assert not _workdirs(process.pid)


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port", "--metrics-port"])
def test_a_port_another_server_answers_on_is_refused_before_triton_starts(served_export, flag):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    args = dict(zip(("--http-port", "--grpc-port", "--metrics-port"), map(str, free_ports())))
    args[flag] = str(port)
    try:
        result = CliRunner().invoke(cli, ["serve", str(served_export), "--api", "triton", *[x for kv in args.items() for x in kv]])
    finally:
        taken.close()
    assert result.exit_code == 1
    error = _one_error_line(result.output)
    assert error.startswith(f"error: {flag} {port} on 127.0.0.1 is in use") and "another server answers there" in error


@pytest.mark.parametrize("address, message", [
    ("999.1.1.1", "error: --address '999.1.1.1' is not an IP address or a name this host resolves"),
    ("192.0.2.1", "error: --address 192.0.2.1 is not an address of this host"),
])
def test_a_bad_address_is_one_error_line(served_export, address, message):
    http, grpc, metrics = map(str, free_ports())
    result = CliRunner().invoke(cli, ["serve", str(served_export), "--api", "triton", "--address", address, "--api-key", "k" * 20,
                                      "--http-port", http, "--grpc-port", grpc, "--metrics-port", metrics])
    assert result.exit_code == 1 and result.output.splitlines()[-1].startswith(message)


def test_every_interface_without_a_key_is_warned_about(served_export):
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    try:
        result = CliRunner().invoke(cli, ["serve", str(served_export), "--api", "triton", "--address", "0.0.0.0",
                                          "--http-port", str(taken.getsockname()[1])])
    finally:
        taken.close()
    assert result.output.startswith("warning: serving on 0.0.0.0 without an API key")


def _one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert "Traceback" not in output and "failed to load" not in output and "UNAVAILABLE" not in output, output
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], output
    return errors[0]


def _serve_that_fails(export: Path, *args: str) -> str:
    """`refusion-run serve` that must fail at start-up: its output (a server that starts after all is stopped,
    failing the test, instead of serving on)."""
    http, grpc, metrics = map(str, free_ports())
    command = [sys.executable, "-m", "refusion.tools.run_cli", "serve", str(export), "--api", "triton", "--http-port", http,
               "--grpc-port", grpc, "--metrics-port", metrics, *args]
    try:
        done = subprocess.run(command, capture_output=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the server started: {e.output!r}") from None
    assert done.returncode == 1, done
    return (done.stdout + done.stderr).decode()


def test_a_model_that_fails_to_load_is_one_error_line(served_export, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(served_export, broken)
    graph = broken / "infiller.onnx"  # the graph onnxruntime loads (it serves the planner's calls too)
    graph.write_bytes(b"\0" * graph.stat().st_size)  # the size it records: only loading finds the damage
    assert "infiller.onnx" in _one_error_line(_serve_that_fails(broken, "--backend", "ort-cpu"))


def test_a_backend_this_machine_lacks_is_one_error_line(served_export):
    onnxruntime = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this machine has CUDA")
    assert "CUDA" in _one_error_line(_serve_that_fails(served_export, "--backend", "ort-cuda"))


def test_a_start_on_a_cpu_machine_prints_no_gpu_errors(served_export):
    if Path("/dev/nvidiactl").exists():
        pytest.skip("a GPU machine: these lines are real there")
    process = start_cli(served_export, free_ports(), None)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 0
    output = process.stdout.read().decode()
    for noise in ("CudaDriverHelper", "NVML", "DCGM", "pinned memory"):
        assert noise not in output, output


def test_the_next_start_removes_only_what_dead_launchers_left(tmp_path):
    def workdir(name: str, owner: str | None) -> Path:
        d = tmp_path / f"{lifetime.WORKDIR_PREFIX}{name}"
        d.mkdir()
        if owner is not None:
            (d / lifetime.OWNER_FILE).write_text(owner)
        return d

    me = os.getpid()
    dead = workdir("dead", "999999999 12345")
    reused = workdir("reused", f"{me} 1")  # this pid, another start time: a reused pid, its launcher dead
    alive = workdir("alive", f"{me} {lifetime.start_time(me)}")
    starting = workdir("starting", None)
    region = lifetime.SHM / f"{dead.name}-test-region"
    region.write_bytes(b"x")
    try:
        assert sorted(lifetime.remove_stale(tmp_path)) == sorted([dead, reused])
        assert not dead.exists() and not reused.exists() and not region.exists()
        assert alive.exists() and starting.exists()
    finally:
        region.unlink(missing_ok=True)
