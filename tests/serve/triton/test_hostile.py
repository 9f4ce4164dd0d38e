"""The reliability probe's hostile requests against a real server (its cases S1-S3 and S16-S19, issue 19):
each is refused with a status of its kind and a message naming what is wrong, Triton's parser and
its restricted APIs are out of reach, and the server answers the next request as before."""

from __future__ import annotations

import http.client
import ipaddress
import json
import mmap
import os
import resource
import shutil
import socket
import subprocess
import urllib.request

import pytest

from tests.serve.triton.server import MODEL, get, post

pytestmark = pytest.mark.slow
SMALL = {"max_tokens": 8, "mode": "ar"}


def raw(server, method: str, path: str, body: bytes = b"", port: int | None = None,
        headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port or server.ports.http, timeout=120)
    try:
        conn.request(method, path, body if method == "POST" else None,
                     {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def still_serving(server) -> None:
    assert get(f"{server.url}/v2/health/ready")[0] == 200
    status, body = post(f"{server.url}/v2/models/{MODEL}/generate", {"text_input": "hi", **SMALL})
    assert status == 200 and body["finish_reason"] in ("eos", "length"), body


@pytest.mark.parametrize("depth", [30_000, 60_000, 100_000])
def test_deeply_nested_json_is_refused_and_crashes_nothing(server, depth):
    body = b'{"text_input": ' + b"[" * depth + b"]" * depth + b"}"  # the probe's S3: 60,000 killed tritonserver
    status, answer = raw(server, "POST", f"/v2/models/{MODEL}/generate", body)
    error = json.loads(answer)["error"]
    assert (status == 400 and f"nests {depth + 1} deep, over the limit of 32" in error) or \
        (status == 413 and "over this server's limit" in error), answer
    assert server.process.poll() is None
    still_serving(server)


@pytest.mark.parametrize("body, message", [
    (b"{", "the body is not JSON"),
    (b"", "the body is not JSON"),
    (b"[]", "the body is a JSON list, not an object"),
    (b'"x"', "the body is a JSON str, not an object"),
    (b'{"text_input": null}', "text_input is a JSON NoneType"),
    (b'{"text_input": 5}', "text_input is a JSON int"),
    (b'{"text_input": {"a": 1}}', "text_input is a JSON dict"),
    (b'{"text_input": "hi", "max_tokens": "64"}', "max_tokens is a JSON str"),
    (b'{"text_input": "hi", "max_tokens": 64.5}', "max_tokens is a JSON float"),
    (b'{"text_input": "hi", "max_tokens": 1e23}', "max_tokens is a JSON float"),
    (b'{"text_input": "hi", "chat": "yes"}', "chat is a JSON str"),
    (b'{"text_input": "hi", "temperature": NaN}', "the body holds NaN"),
    (b'{"text_input": "hi", "seed": 18446744073709551615}', "seed=18446744073709551615 does not fit TYPE_INT64"),
    (b'{"text_input": "hi", "max_tokens": 2147483648}', "max_tokens=2147483648 does not fit TYPE_INT32"),
    (b'{"text_input": "hi", "stream": true}', '"stream": true needs generate_stream'),
    (b'{"text_input": "hi", "foo": 1}', "'foo' is not an input of this model"),
    (b'{"text_input": "hi", "max_token": 5}', "did you mean 'max_tokens'?"),
    (b'{"text_input": "a", "text_input": "b"}', "the body gives 'text_input' twice"),
    (b'{"text_input": "\\udcff"}', "text_input holds a lone surrogate"),
    (b'{"text_input": "\xff"}', "the body is not UTF-8"),
])
def test_malformed_bodies_get_a_400_naming_what_is_wrong(server, body, message):
    status, answer = raw(server, "POST", f"/v2/models/{MODEL}/generate", body)
    assert status == 400 and message in json.loads(answer)["error"], answer
    assert server.ready()


def test_a_body_longer_than_any_prompt_that_fits_is_refused_unread(server):
    status, answer = raw(server, "POST", f"/v2/models/{MODEL}/generate",
                         json.dumps({"text_input": "x" * (server.max_body + 1)}).encode())
    assert status == 413 and "over this server's limit" in json.loads(answer)["error"]
    still_serving(server)


def test_shared_memory_logging_config_and_repository_are_not_served(server, tmp_path):
    segment = "/refusion-probe-" + str(os.getpid())
    fd = os.open(f"/dev/shm{segment}", os.O_CREAT | os.O_RDWR, 0o600)  # the probe's S2: a segment to register
    try:
        os.ftruncate(fd, 4096)
        region = json.dumps({"key": segment, "offset": 0, "byte_size": 4096}).encode()
        for method, path, body in [("POST", "/v2/systemsharedmemory/region/probe/register", region),
                                   ("GET", "/v2/systemsharedmemory/status", b""),
                                   ("POST", "/v2/logging", b'{"log_verbose_level": 9}'),
                                   ("GET", f"/v2/models/{MODEL}/config", b""),
                                   ("POST", "/v2/repository/index", b"{}"),
                                   ("POST", f"/v2/repository/models/{MODEL}/unload", b"{}"),
                                   ("GET", "/v2/models/stats", b""), ("GET", "/v2/trace/setting", b"")]:
            assert raw(server, method, path, body)[0] == 404, path
        grpc_refuses_shared_memory(server, segment)
        with mmap.mmap(fd, 4096) as memory:
            assert memory[:] == b"\0" * 4096  # nothing was written into it
        # On Triton's own socket (the launcher's view): nothing registered, and no host path in the model config.
        status, _, regions = server.upstream.get(server.upstream.http, "/v2/systemsharedmemory/status", 60)
        assert status == 200 and json.loads(regions) == []
        status, _, config = server.upstream.get(server.upstream.http, f"/v2/models/{MODEL}/config", 60)
        assert status == 200 and not json.loads(config)["parameters"]
        assert str(server.model_dir).encode() not in config and b"/tmp" not in config
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm{segment}")
    still_serving(server)


def grpc_refuses_shared_memory(server, segment: str) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    try:
        with pytest.raises(InferenceServerException, match="UNIMPLEMENTED"):
            client.register_system_shared_memory("probe", segment, 4096)
        with pytest.raises(InferenceServerException, match="UNIMPLEMENTED"):
            client.update_log_settings({"log_verbose_level": 9})
    finally:
        client.close()


def test_the_gateways_bind_loopback_by_default_and_triton_no_tcp_port(server):
    assert server.ports.address == "127.0.0.1"
    listening = _listening_addresses()
    for port in (server.ports.http, server.ports.grpc, server.ports.metrics):
        assert listening.get(port) == {"127.0.0.1"}, (port, listening.get(port))
    assert not _tcp_listeners_of(server.process.pid)


def _tcp_listeners_of(pid: int) -> set[str]:
    """The TCP sockets process `pid` listens on, as /proc/net/tcp's inodes."""
    held = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and f"socket:[{fields[9]}]" in held:
                inodes.add(fields[9])
    return inodes


def test_no_other_local_user_can_reach_triton(server):
    """The probe's S30: the launcher's secret was on tritonserver's command line, which every local user can
    read; user nobody then used Triton's restricted APIs and crashed it with a 60,000-deep body. Triton listens
    on Unix sockets in a directory of mode 0700 now, and its command line holds no secret."""
    command = open(f"/proc/{server.process.pid}/cmdline").read().split("\0")
    assert not [arg for arg in command if "restricted" in arg or "x-refusion" in arg], command
    directory = server.upstream.directory
    assert directory.stat().st_mode & 0o777 == 0o700 and directory.stat().st_uid == os.getuid()
    assert server.upstream.get(server.upstream.http, "/v2/health/ready", 60)[0] == 200  # we reach it
    if os.getuid() != 0:
        pytest.skip("only root can try as another user")
    probe = ("import socket, sys\n"
             "for path in sys.argv[1:]:\n"
             "    try:\n"
             "        socket.socket(socket.AF_UNIX).connect(path)\n"
             "        print('reached', path)\n"
             "    except PermissionError:\n"
             "        pass\n")
    sockets = [str(server.upstream.http), str(server.upstream.metrics), server.upstream.grpc_target[len("unix:"):]]
    python = shutil.which("python3", path="/usr/bin:/bin")  # one that nobody may run (a venv's may be in /root)
    if python is None:
        pytest.skip("no system python3 for user nobody")
    as_nobody = subprocess.run([python, "-I", "-S", "-c", probe, *sockets], user="nobody", capture_output=True,
                               text=True, timeout=60, cwd="/")
    assert as_nobody.returncode == 0 and as_nobody.stdout == "", as_nobody


def _listening_addresses() -> dict[int, set[str]]:
    """Port -> the addresses something listens on (/proc/net/tcp and tcp6; state 0A is LISTEN)."""
    found: dict[int, set[str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":
                address, port = local.split(":")
                found.setdefault(int(port, 16), set()).add(_address(bytes.fromhex(address)))
    return found


def _address(raw: bytes) -> str:
    """/proc/net's address: 32-bit words in host (little-endian) order."""
    address = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 (gRPC's socket) is 127.0.0.1
    return str(mapped or address)


def test_metrics_are_served_without_triton_internals_exposed(server):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=30) as response:
        assert b"refusion_requests_in_flight" in response.read()
    assert raw(server, "GET", "/v2/logging", port=server.ports.metrics)[0] == 404


def test_1100_connections_that_send_a_byte_leave_readiness_and_generate_served(server):
    """The probe's S15: 1,030 connections sending a byte every 10 s (the idle timeout was per read) kept readiness
    and generate at 503 for as long as they were held. Here 1,100 that each sent a byte of a request line, held
    open while both are answered: past the limit the longest waiting are closed to make room."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2600:
        pytest.skip(f"the open-file limit ({hard}) cannot hold 1,100 connections at both ends")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the client ends live in this process too
    attack = []
    try:
        for _ in range(1100):
            attack.append(socket.create_connection(("127.0.0.1", server.ports.http), timeout=60))
            attack[-1].sendall(b"G")
        still_serving(server)
        held = 0
        for sock in attack:
            sock.setblocking(False)
            try:
                held += sock.recv(1) != b""
            except BlockingIOError:
                held += 1  # open, nothing to read: still held
        assert held > 1000
    finally:
        for sock in attack:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
