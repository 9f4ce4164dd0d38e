"""Triton serving end to end: a real tritonserver behind the gateways, HTTP generate and generate_stream,
gRPC streaming, concurrency, malformed requests, client disconnects, timeouts, overload and SIGTERM. Every
request that must be in flight is held there by the gate (tests/serve/triton/gate.py), not by slowness."""

from __future__ import annotations

import http.client
import json
import queue
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from refusion.runtime.generator import Generator
from refusion.serve.triton.client import stream_events
from refusion.serve.triton.gateway import UnixHTTPConnection
from refusion.serve.triton.launcher import free_ports
from tests.serve.triton.gate import Gate
from tests.serve.triton.server import LONG, MODEL, get, metric, post, start_cli, wait_idle, wait_until

pytestmark = pytest.mark.slow
SHORT = {"max_tokens": 32, "slot_size": 4, "serial_num_blocks": 2}
PROMPTS = ["sort: 3 1 2", "hello", "count to five", "a b c", "1 2 3"]


@pytest.fixture(scope="module")
def alone(served_export):
    """What Generator.generate gives each prompt at the same settings: the oracle."""
    with Generator.from_dir(served_export, backend="ort-cpu", threads=1) as gen:
        def run(prompt: str, **settings) -> tuple[list[int], str]:
            result = gen.generate(prompt, **settings)
            return result.token_ids, result.text
        yield run


def sse(server, body: dict) -> list[dict]:
    """The events of one HTTP generate_stream request."""
    return list(stream_events(server.url, MODEL, body, timeout_s=60))


def test_http_generate_returns_the_generators_tokens(server, alone):
    for prompt in PROMPTS[:3]:
        status, body = post(f"{server.url}/v2/models/{MODEL}/generate", {"text_input": prompt, **SHORT})
        assert status == 200, body
        ids, text = alone(prompt, **SHORT)
        assert body["token_ids"] == ids and body["text_output"] == text
        assert body["finish_reason"] in ("eos", "length")
    status, body = post(f"{server.url}/v2/models/{MODEL}/generate",
                        {"text_input": "hello", "max_tokens": 24, "mode": "ar", "chat": True})
    with Generator.from_dir(server.model_dir, backend="ort-cpu", threads=1) as gen:
        assert body["token_ids"] == gen.generate("hello", max_tokens=24, mode="ar", chat=True).token_ids


def test_http_stop_words_log_probs_and_cached_prompt_tokens(server, alone):
    prompt = "The quick brown fox jumps over the lazy dog, and then "  # more than one block of the prefix cache
    ids, text = alone(prompt, **SHORT)
    url = f"{server.url}/v2/models/{MODEL}/generate"
    first = post(url, {"text_input": prompt, **SHORT, "return_log_probs": True})[1]
    assert first["token_ids"] == ids and len(first["output_log_probs"]) == len(ids)
    again = post(url, {"text_input": prompt, **SHORT})[1]
    assert again["token_ids"] == ids and again["cached_prompt_tokens"] >= 16
    assert len(text) >= 4, f"the stop check needs an answer of 4 characters or more; this model gave {text!r}"
    stop = text[2:4]
    cut = post(url, {"text_input": prompt, **SHORT, "stop_words": [stop, "never in it"]})[1]
    assert cut["finish_reason"] == "stop" and cut["text_output"] == text[: text.index(stop)]


@pytest.mark.parametrize("path, body", [
    ("generate", {"text_input": "hi", "max_tokens": 1, "mode": "ar"}),  # one token: Triton writes a number
    ("generate", {"text_input": "hi", "max_tokens": 8, "mode": "ar", "return_log_probs": True,
                  "stop_words": ["never in it", "nor this"]}),
    ("generate", {"text_input": "héllo ✓", **SHORT}),
    ("generate_stream", {"text_input": "count to five", "stream": True, **SHORT}),
])
def test_the_gateway_answers_byte_for_byte_as_tritons_own_endpoint_would(server, path, body):
    """Clients see no difference: the same request to Triton's own socket gets the same bytes. (The prompts are
    shorter than a prefix-cache block: neither answer reuses the other's KV.)"""
    def answer(conn: http.client.HTTPConnection) -> tuple[int, bytes]:
        try:
            conn.request("POST", f"/v2/models/{MODEL}/{path}", json.dumps(body))
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    direct = answer(UnixHTTPConnection(server.upstream.http, 120))
    assert direct[0] == 200, direct
    assert answer(http.client.HTTPConnection("127.0.0.1", server.ports.http, timeout=120)) == direct

def test_http_generate_stream_sends_pieces_then_a_final_response(server, alone):
    events = sse(server, {"text_input": "count to five", "stream": True, **SHORT})
    ids, text = alone("count to five", **SHORT)
    *pieces, final = events
    assert pieces and all("finish_reason" not in e for e in pieces)
    assert "".join(e["text_output"] for e in pieces) == text
    assert final["token_ids"] == ids and final["finish_reason"] in ("eos", "length") and final["text_output"] == ""


def grpc_stream(server, prompt: str, settings: dict, cancel_after: int | None = None) -> list:
    """One gRPC streaming request with tritonclient; with `cancel_after`, the stream is cancelled
    after that many responses, as a client that goes away."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    tensors = {"text_input": np.array([prompt.encode()], dtype=np.object_), "stream": np.array([True])}
    kinds = {"max_tokens": np.int32, "slot_size": np.int32, "serial_num_blocks": np.int32}
    tensors.update({k: np.array([v], dtype=kinds[k]) if k in kinds else np.array([v.encode()], dtype=np.object_)
                    for k, v in settings.items()})
    inputs = []
    for name, array in tensors.items():
        datatype = {"O": "BYTES", "b": "BOOL"}.get(array.dtype.kind, "INT32")
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client.async_stream_infer(MODEL, inputs)
    got = []
    try:
        while True:
            result, error = responses.get(timeout=60)
            assert error is None, error
            got.append(result)
            if cancel_after is not None and len(got) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return got
            if result.as_numpy("finish_reason") is not None:
                return got
    finally:
        client.close()


def test_grpc_streaming_returns_the_generators_tokens(server, alone):
    got = grpc_stream(server, "sort: 3 1 2", SHORT)
    ids, text = alone("sort: 3 1 2", **SHORT)
    assert "".join(r.as_numpy("text_output")[0].decode() for r in got) == text
    assert got[-1].as_numpy("token_ids").tolist() == ids


def test_32_concurrent_clients_all_complete_with_their_tokens(server, alone):
    jobs = [(PROMPTS[i % len(PROMPTS)], {**SHORT, "mode": "ar" if i % 3 == 0 else "refusion"}) for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda job: post(f"{server.url}/v2/models/{MODEL}/generate",
                                                 {"text_input": job[0], **job[1]}), jobs))
    assert [status for status, _ in answers] == [200] * 32
    for (prompt, settings), (_, body) in zip(jobs, answers):
        assert body["token_ids"] == alone(prompt, **settings)[0]
    wait_idle(server)


@pytest.mark.parametrize("body, named", [
    ({"max_tokens": 8}, "text_input"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "hi", "max_tokens": 100000}, "max_tokens"),
    ({"text_input": "x " * 2000, "max_tokens": 8, "mode": "ar"}, "prompt"),
    ({"text_input": "hi", "slot_threshold": 1.5}, "slot_threshold"),
    ({"text_input": "hi", "token_threshold": -0.1}, "token_threshold"),
    ({"text_input": "hi", "mode": "beam"}, "mode"),
    ({"text_input": "hi", "timeout_s": 0}, "timeout_s"),
])
def test_malformed_requests_get_a_4xx_naming_the_field_and_the_server_stays_ready(server, body, named):
    status, answer = post(f"{server.url}/v2/models/{MODEL}/generate", body)
    assert 400 <= status < 500 and named in answer["error"], answer
    assert server.ready()


def test_a_wrong_dtype_is_refused_naming_the_tensor(server):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
    tokens = grpcclient.InferInput("max_tokens", [1], "FP32")
    tokens.set_data_from_numpy(np.array([8.0], dtype=np.float32))
    errors: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: errors.put(error))
    try:
        with pytest.raises(InferenceServerException, match="max_tokens"):
            client.async_stream_infer(MODEL, [text, tokens])
            error = errors.get(timeout=30)
            if error is not None:
                raise error
    finally:
        client.stop_stream()
        client.close()
    assert server.ready()


def _held(gate: Gate, start, released: int = 0):
    """Start a request (`start()`) with the gate closed, let `released` forwards through, and return once the
    next one is held: the request is in flight and stays there until the gate opens."""
    held = gate.hold()
    result = start()
    gate.release(released)
    gate.wait_for("held", held + 1 + released)
    return result


def _raw_post(server, path: str, body: dict) -> socket.socket:
    """A request sent on a raw socket, its answer left unread."""
    sock = socket.create_connection(("127.0.0.1", server.ports.http))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_a_client_that_disconnects_mid_stream_is_cancelled_and_its_kv_freed(server, gate):
    wait_idle(server)
    cancelled = gate.count("cancel")
    # HTTP: read the first event (two forwards let through: the prompt's and a token's), then hang up.
    conn = http.client.HTTPConnection("127.0.0.1", server.ports.http, timeout=60)
    _held(gate, lambda: conn.request("POST", f"/v2/models/{MODEL}/generate_stream",
                                     json.dumps({"text_input": "hello", "stream": True, **LONG})), released=2)
    assert conn.getresponse().readline().startswith(b"data: ")
    wait_until(lambda: metric(server, "refusion_kv_slots_in_use") == 1, "the streaming request holds a KV region")
    conn.close()
    gate.wait_for("cancel", cancelled + 1)  # cancelled while its forward was still held: not decoded to the end
    gate.open()
    wait_idle(server)
    # gRPC: cancel the stream after the first response.
    held = gate.hold()
    with ThreadPoolExecutor(1) as pool:
        got = pool.submit(grpc_stream, server, "hello", LONG, cancel_after=1)
        gate.release(2)
        gate.wait_for("held", held + 3)
        gate.wait_for("cancel", cancelled + 2)
        gate.open()
        assert len(got.result(timeout=60)) == 1
    wait_idle(server)


def test_a_client_that_disconnects_from_generate_is_cancelled_too(server, gate):
    wait_idle(server)
    cancelled = gate.count("cancel")
    sock = _held(gate, lambda: _raw_post(server, f"/v2/models/{MODEL}/generate", {"text_input": "hello", **LONG}))
    sock.close()  # before any answer: generate sends nothing until the end
    gate.wait_for("cancel", cancelled + 1)
    gate.open()
    wait_idle(server)


def test_timeout_s_ends_a_request_with_what_had_settled(server, gate):
    timeout_s = 0.5
    with ThreadPoolExecutor(1) as pool:
        pending = _held(gate, lambda: pool.submit(post, f"{server.url}/v2/models/{MODEL}/generate",
                                                  {"text_input": "hello", "timeout_s": timeout_s, **LONG}), released=3)
        passed = time.monotonic() + timeout_s  # the deadline (set when the request was submitted) is behind us then
        wait_until(lambda: time.monotonic() > passed, "the deadline passes")
        gate.open()
        status, body = pending.result(timeout=60)
    assert status == 200 and body["finish_reason"] == "timeout"
    assert 0 < len(body["token_ids"]) < LONG["max_tokens"]


@pytest.fixture
def cli_gate(tmp_path) -> Gate:
    pytest.importorskip("pytriton")
    return Gate(tmp_path / "gate")


def test_overload_past_the_queue_limit_is_refused_at_once_with_429(served_export, cli_gate):
    ports = free_ports()
    process = start_cli(served_export, ports, cli_gate, "--max-requests", "1", "--max-batch", "1",
                        "--max-queue", "1")
    server = SimpleNamespace(url=f"http://127.0.0.1:{ports[0]}", ports=SimpleNamespace(metrics=ports[2]))
    url = f"{server.url}/v2/models/{MODEL}/generate"
    try:
        with ThreadPoolExecutor(2) as pool:
            running = _held(cli_gate, lambda: pool.submit(post, url, {"text_input": "hello", **LONG}))
            queued = pool.submit(post, url, {"text_input": "hello", **LONG})
            wait_until(lambda: metric(server, "refusion_requests_in_flight") == 2, "the second request is queued")
            # 1 running + 1 queued: more are refused while both are held, so they did not wait for them.
            for _ in range(2):
                status, body = post(url, {"text_input": "hello", **LONG})
                assert status == 429 and "limit" in body["error"] and "--max-queue" in body["error"], body
            # A gRPC stream's error carries only a message: its kind is the message's first word.
            assert _grpc_error(ports[1], "hello").startswith("RESOURCE_EXHAUSTED: the server holds 2 requests")
            cli_gate.open()
            assert [f.result(timeout=60)[0] for f in (running, queued)] == [200, 200]
    finally:
        cli_gate.open()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def _grpc_error(port: int, prompt: str) -> str:
    """The error message a one-request gRPC stream gets (the request must be refused)."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put(error))
    try:
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
        client.async_stream_infer(MODEL, [text])
        error = responses.get(timeout=60)
        assert error is not None, "the request was not refused"
        return error.message()
    finally:
        client.stop_stream()
        client.close()


def test_sigterm_drains_in_flight_requests_and_exits_0_with_idle_connections_open(served_export, cli_gate):
    ports = free_ports()
    process = start_cli(served_export, ports, cli_gate, "--drain-timeout", "300")
    base = f"http://127.0.0.1:{ports[0]}"
    idle = http.client.HTTPConnection("127.0.0.1", ports[0], timeout=60)  # a kept-alive connection, left idle
    idle.request("GET", "/v2/health/ready")
    assert idle.getresponse().read() == b""
    with ThreadPoolExecutor(1) as pool:
        pending = _held(cli_gate, lambda: pool.submit(post, f"{base}/v2/models/{MODEL}/generate",
                                                      {"text_input": "hello", **LONG}))
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: get(f"{base}/v2/health/ready")[0] == 503, "readiness fails once draining")
        status, body = post(f"{base}/v2/models/{MODEL}/generate", {"text_input": "hi", "max_tokens": 8})
        assert status == 503 and "shutting down" in body["error"]
        cli_gate.open()  # the request in flight finishes inside the drain
        status, body = pending.result(timeout=60)
    assert status == 200 and body["finish_reason"] in ("length", "eos")
    assert process.wait(timeout=120) == 0
    output = process.stdout.read().decode()
    assert "SIGTERM: draining" in output and "stopped (tritonserver exit code 0)" in output
    assert "error" not in output.lower()


def test_past_the_drain_timeout_requests_are_cancelled_with_a_final_response(served_export, cli_gate):
    ports = free_ports()
    process = start_cli(served_export, ports, cli_gate, "--drain-timeout", "1")
    server = SimpleNamespace(url=f"http://127.0.0.1:{ports[0]}")
    with ThreadPoolExecutor(1) as pool:
        # Three forwards through: what they settle is streamed before the drain.
        pending = _held(cli_gate, lambda: pool.submit(sse, server, {"text_input": "hello", "stream": True, **LONG}),
                        released=3)
        process.send_signal(signal.SIGTERM)
        cli_gate.wait_for("cancel", 1)  # the drain's deadline passed with the request still held
        cli_gate.open()
        events = pending.result(timeout=60)
    assert process.wait(timeout=60) == 0
    final = events[-1]
    assert final["finish_reason"] == "cancelled" and 0 < len(final["token_ids"]) < LONG["max_tokens"]
    assert "".join(e["text_output"] for e in events[:-1])  # what had settled was streamed before


def test_the_docs_grpc_example_runs(server, capsys):
    doc = (Path(__file__).resolve().parents[3] / "docs" / "serving.md").read_text()
    code = next(block.split("```")[0] for block in doc.split("```python\n")[1:] if "tritonclient.grpc" in block)
    assert '"localhost:8011"' in code and "np.array([64]" in code
    # This server's model records slot_size 32 and 4 blocks: 64 tokens do not divide; 128 do.
    code = code.replace('"localhost:8011"', f'"127.0.0.1:{server.ports.grpc}"')
    code = code.replace("np.array([64]", "np.array([128]")
    exec(compile(code, "docs/serving.md", "exec"), {})  # noqa: S102 - the docs' example, as a reader runs it
    assert "finish_reason: " in capsys.readouterr().out
    wait_idle(server)


def test_the_client_command_prints_the_answer_streamed_or_whole(server, alone):
    from click.testing import CliRunner

    from refusion.tools.run_cli import cli

    ids, text = alone("count to five", **SHORT)
    args = ["client", "count to five", "--url", server.url, "--api", "triton", "--max-tokens", "32", "--slot-size",
            "4", "--serial-num-blocks", "2"]
    for extra in ([], ["--stream"]):
        result = CliRunner().invoke(cli, args + extra)
        assert result.exit_code == 0 and result.stdout == text + "\n", result.output
    answer = json.loads(CliRunner().invoke(cli, args + ["--json"]).stdout)
    assert answer["token_ids"] == ids and answer["text"] == text
    refused = CliRunner().invoke(cli, args + ["--slot-threshold", "1.5"])
    assert refused.exit_code == 1 and refused.output.startswith(
        "error: the server refused the request (400): slot_threshold=1.5 is outside [0, 1]")
    nobody = CliRunner().invoke(cli, ["client", "hi", "--url", f"http://127.0.0.1:{free_ports(1)[0]}"])
    assert nobody.exit_code == 1 and "no server answered at 127.0.0.1:" in nobody.output
    other = CliRunner().invoke(cli, ["client", "hi", "--url", server.url])  # the OpenAI API, the default
    assert other.exit_code == 1 and "serves the other API: add --api triton" in other.output, other.output
