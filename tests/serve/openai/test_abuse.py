"""Raw-HTTP abuse of the OpenAI server: malformed bodies, wrong types, unknown fields, huge and slow bodies,
clients that disconnect (streaming or not), overload. Each gets its 4xx in OpenAI's error shape (never a 500),
the server stays ready, and nothing leaks (the fixture ends every test with no request in flight and no KV
region held). Work in flight is held with tests/gate.py's ForwardGate, never by a sleep."""

from __future__ import annotations

import json
import threading

import openai
import pytest

from refusion.serve.openai.schema import CHAT, FIELDS
from tests.gate import ForwardGate
from tests.serve.openai.helpers import connect, hang_up, live, post, read_event, read_response, request_bytes, wait_idle, wait_until

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
HI = {"model": "refusion", "messages": [{"role": "user", "content": "sort: 3 1 2"}], "max_tokens": 8}


def _error(status: int, body, param: str | None = None) -> str:
    """The message of an OpenAI error answer, after checking its shape."""
    assert 400 <= status < 500, (status, body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]["message"]


def _ready(server) -> None:
    status, _, body = post(server, CHAT_PATH, HI)
    assert status == 200 and body["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize("raw, says", [
    (b"{", "not JSON"), (b"", "not JSON"), (b"[1, 2]", "a JSON list, not an object"), (b"null", "not an object"),
    (b'"hi"', "not an object"), (b"\xff\xfe{}", "not UTF-8"), (b'{"model": "refusion", "temperature": NaN}', "NaN"),
    (b"[" * 60_000 + b"]" * 60_000, "over the limit of 32"), (b'{"model": "refusion", "messages": ' + b"[" * 30_000 +
                                                               b"]" * 30_000 + b"}", "over the limit of 32"),
    (b'{"model": "refusion", "model": "refusion"}', "gives 'model' twice"),
])
def test_malformed_bodies_are_400s(serve, raw, says):
    server = serve()
    for path in (CHAT_PATH, COMPLETIONS_PATH):
        status, _, body = post(server, path, raw)
        assert says in _error(status, body)
    _ready(server)


_WRONG = {"string": 5, "bool": 1, "int": "5", "number": "0.5", "strings": 5, "ints": ["2"], "text": 5, "json": 5}
_WRONG_OBJECTS = {"messages": "hi", "prompt": {"text": "hi"}, "stream_options": 5, "tools": "move",
                  "structured_outputs": "json"}


@pytest.mark.parametrize("field", [f for f in FIELDS], ids=lambda f: f"{f.name}-{f.endpoints[0]}")
def test_every_field_of_the_wrong_type_is_a_400_naming_it(serve, field):
    server = serve()
    endpoint = field.endpoints[0]
    base = HI if endpoint == CHAT else {"model": "refusion", "prompt": "hi", "max_tokens": 4}
    value = _WRONG_OBJECTS[field.name] if field.kind == "object" else _WRONG[field.kind]
    body = {**base, field.name: value, **({"stream": True} if field.name == "stream_options" else {})}
    status, _, answer = post(server, CHAT_PATH if endpoint == CHAT else COMPLETIONS_PATH, body)
    assert field.name in _error(status, answer, field.name)


@pytest.mark.parametrize("body, param, says", [
    ({**HI, "frobnicate": 1}, "frobnicate", "unknown field 'frobnicate'"),
    ({**HI, "prompt": "x"}, "prompt", "a field of /v1/completions"),
    ({**HI, "tools": []}, "tools", "tools must be a non-empty list"),
    ({**HI, "functions": []}, "functions", "functions is not supported by this server (function calling"),
    ({**HI, "n": 0}, "n", "n=0 must be at least 1"),
    ({**HI, "n": 1000}, "n", "asks for 1000 choices (1 prompt(s) x n=1000), more than the"),
    ({**HI, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema", 'Unimplemented keys: ["uniqueItems"]'),
    ({**HI, "response_format": {"type": "xml"}}, "response_format.type", 'response_format.type is "xml"'),
    ({**HI, "guided_json": {"type": "wat"}}, "guided_json", "guided_json is not a guide llguidance can enforce"),
    ({**HI, "guided_regex": "(a"}, "guided_regex", "unclosed group"),
    ({**HI, "guided_choice": ["a"], "guided_regex": "a"}, None, "both ask for structured output"),
    # the probe's J07 and C03: a guide's JSON text nested deep was a 500 (RecursionError); an empty choice, no guide
    ({**HI, "guided_json": "[" * 1000 + "]" * 1000}, "guided_json", "guided_json nests 1000 deep, over the limit of 32"),
    ({**HI, "response_format": '{"a":' * 1500 + "1" + "}" * 1500}, "response_format",
     "response_format nests 1500 deep, over the limit of 32"),
    ({**HI, "guided_choice": []}, "guided_choice", "guided_choice=[] holds no strings; give at least one"),
    ({**HI, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({**HI, "top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs=true"),
    ({**HI, "logprobs": True, "top_logprobs": 65}, "top_logprobs", "exceeds the 64 candidates"),
    ({**HI, "max_tokens": 2147483648}, "messages", "2147483648 in the completion). The prompt is too long for that"),
    ({**HI, "max_tokens": 0}, "max_tokens", "must be a positive integer"),
    ({**HI, "max_completion_tokens": 4}, "max_completion_tokens", "give one of them"),
    ({**HI, "stream_options": {"include_usage": True}}, "stream_options", "only taken with stream=true"),

    ({**HI, "messages": []}, "messages", "non-empty list"),
    ({**HI, "messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "send tools, and their results"),
    ({**HI, "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 5}}]}]}, "messages[0].tool_calls",
     "must be a list of"),
    ({**HI, "messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name", "must be a string"),
    ({**HI, "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls",
     "not supported"),
    ({**HI, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]},
     "messages[0].content[0]", "image_url content is not supported"),
    ({**HI, "messages": [{"role": "user", "content": "x" * 30_000}]}, None, "positions"),  # over the bytes any prompt fits
    ({key: value for key, value in HI.items() if key != "model"}, "model", "model is missing"),
    ({**HI, "mode": "fast"}, "mode", "mode='fast' is not one of"),
])
def test_unknown_unsupported_and_out_of_range_fields_are_400s(serve, body, param, says):
    server = serve()
    status, _, answer = post(server, CHAT_PATH, body)
    assert says in _error(status, answer, param)
    _ready(server)


def test_unknown_paths_and_methods_get_openai_errors(serve):
    server = serve()
    with connect(server) as sock:
        sock.sendall(request_bytes("/v1/embeddings", b"{}"))
        status, _, body = read_response(sock)
    assert "no route POST /v1/embeddings" in _error(status, json.loads(body))
    with connect(server) as sock:
        sock.sendall(request_bytes(CHAT_PATH, b"", method="GET"))
        status, _, body = read_response(sock)
    assert status == 405 and "no route GET" in _error(status, json.loads(body))


def test_huge_bodies_are_413s_and_the_server_stays_ready(serve):
    server = serve(max_body=4096)
    status, _, body = post(server, CHAT_PATH, {**HI, "messages": [{"role": "user", "content": "x" * 8192}]})
    assert "over 4096 bytes" in _error(status, body)
    with connect(server) as sock:  # declares 1 GB, sends none of it: answered without reading
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000000\r\n\r\n")
        status, _, raw = read_response(sock)
    assert "over 4096 bytes" in _error(status, json.loads(raw))
    _ready(server)


def test_a_client_that_stalls_mid_body_gets_a_408_while_others_are_served(serve):
    server = serve(body_timeout_s=0.5)  # the stalled body never comes: its outcome does not depend on speed
    with connect(server) as stalled:
        stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n{\"model\"")
        _ready(server)
        status, _, raw = read_response(stalled)
    assert "did not arrive within 0.5 s" in _error(status, json.loads(raw))
    _ready(server)


def _stream_request(body) -> bytes:
    return request_bytes(CHAT_PATH, json.dumps({**body, "stream": True}).encode())


def test_a_client_gone_mid_stream_cancels_its_request_and_frees_its_kv_within_a_forward(serve, gen):
    server = serve()
    with ForwardGate(gen.runner) as gate:
        sock = connect(server)
        sock.sendall(_stream_request({**HI, "max_tokens": 64, "mode": "ar"}))
        reader = sock.makefile("rb")
        assert reader.readline().startswith(b"HTTP/1.1 200")
        assert json.loads(read_event(reader))["choices"][0]["delta"]["role"] == "assistant"
        gate.wait_held()  # its first forward waits at the gate
        reader.close()
        assert hang_up(server, gen, gate, sock).result().finish_reason == "cancelled"
    wait_idle(server)
    ended = server.metrics.registry.get_sample_value
    assert ended("refusion_requests_total", {"endpoint": "chat", "finish_reason": "cancelled"}) == 1
    _ready(server)


def test_a_non_streaming_client_gone_cancels_its_request(serve, gen):
    server = serve()
    with ForwardGate(gen.runner) as gate:
        sock = connect(server)
        sock.sendall(request_bytes(CHAT_PATH, json.dumps({**HI, "max_tokens": 64, "mode": "ar"}).encode()))
        gate.wait_held()
        hang_up(server, gen, gate, sock)
    wait_idle(server)
    _ready(server)


def test_past_the_queue_limit_requests_get_429_with_retry_after(serve, gen):
    server = serve(max_queue=0)  # 2 running (the Generator's KV regions), none waiting
    with ForwardGate(gen.runner) as gate:
        answers: list = []
        holders = [threading.Thread(target=lambda: answers.append(post(server, CHAT_PATH, HI))) for _ in range(2)]
        for t in holders:
            t.start()
        wait_until(lambda: len(live(server)) == 2, "both requests are admitted")
        status, headers, body = post(server, CHAT_PATH, HI)
        assert "retry later" in _error(status, body) and status == 429
        assert headers["retry-after"] == "1" and body["error"]["type"] == "requests"
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="refusion", prompt="hi", max_tokens=4)
        gate.open()
        for t in holders:
            t.join(60)
    assert [status for status, _, _ in answers] == [200, 200]
    _ready(server)


def test_no_answer_is_a_500_and_health_tells_the_state(serve):
    server = serve()
    status, _, body = post(server, CHAT_PATH, {**HI, "messages": [{"role": "user", "content": "\ud800"}]})
    assert "lone surrogate" in _error(status, body)
    with connect(server) as sock:
        sock.sendall(request_bytes("/health", b"", method="GET"))
        status, _, raw = read_response(sock)
    health = json.loads(raw)
    assert status == 200 and health["status"] == "ready"
    assert (health["requests_in_flight"], health["kv_regions_in_use"]) == (0, 0)
    with connect(server) as sock:
        sock.sendall(request_bytes("/metrics", b"", method="GET"))
        status, _, raw = read_response(sock)
    metrics = raw.decode()
    assert status == 200 and 'refusion_requests_refused_total{status="400"}' in metrics


@pytest.mark.parametrize("drain_timeout_s, finish_reason", [(60.0, "stop"), (0.0, "length")])
def test_a_drain_lets_the_stream_in_flight_finish_or_cancels_it_at_its_deadline(serve, gen, drain_timeout_s,
                                                                                finish_reason):
    server = serve(drain_timeout_s=drain_timeout_s)
    with ForwardGate(gen.runner) as gate:
        sock = connect(server)
        sock.sendall(_stream_request(HI if finish_reason == "stop" else {**HI, "max_tokens": 64, "mode": "ar"}))
        reader = sock.makefile("rb")
        read_event(reader)
        gate.wait_held()
        (request,) = live(server)
        server.drain()
        if drain_timeout_s == 0:
            wait_until(lambda: request.cancelled, "the drain's deadline cancels what runs")
        gate.open()
        events = []
        while (event := read_event(reader)) != "[DONE]":
            events.append(json.loads(event))
        reasons = [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]]
        if finish_reason == "stop":
            assert request.result().finish_reason in ("eos", "length") and len(reasons) == 1
        else:
            assert request.result().finish_reason == "cancelled" and reasons == ["length"]
        sock.close()
    server._thread.join(60)
    assert not server._thread.is_alive()


def test_with_a_key_every_path_but_health_needs_it(serve):
    key = "k" * 24
    server = serve(api_key=key)
    status, headers, body = post(server, CHAT_PATH, HI)
    assert "needs its API key" in _error(status, body) and status == 401 and headers["www-authenticate"] == "Bearer"
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_api_key"
    status, _, body = post(server, CHAT_PATH, HI, {"Authorization": "Bearer " + "x" * 24})
    assert "not this server's" in _error(status, body)
    status, _, body = post(server, CHAT_PATH, HI, {"Authorization": f"Bearer {key}"})
    assert status == 200 and body["choices"][0]["message"]["content"] is not None
    for path, needs_key in (("/health", False), ("/metrics", True), ("/v1/models", True)):
        with connect(server) as sock:
            sock.sendall(request_bytes(path, b"", method="GET"))
            status, _, _ = read_response(sock)
        assert status == (401 if needs_key else 200), path
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong-key-wrong-key", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["refusion"]


def test_the_body_limit_is_the_longest_prompt_that_fits_and_the_rest(serve, gen):
    from refusion.serve.security import body_limit

    server = serve()
    limit = body_limit(gen.max_prompt_bytes)
    status, _, body = post(server, CHAT_PATH, {**HI, "messages": [{"role": "user", "content": "x" * limit}]})
    assert f"over {limit} bytes" in _error(status, body)
    status, _, body = post(server, CHAT_PATH, {**HI, "messages": [{"role": "user", "content": "x" * (gen.max_prompt_bytes + 1)}]})
    assert "bytes of UTF-8" in _error(status, body)  # under the body limit, over the prompt's: the runtime's check
