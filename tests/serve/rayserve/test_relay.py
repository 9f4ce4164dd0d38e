"""A request relayed whole to a replica's app (relay.py), without Ray: the same answer as the app gives its own
client, a stream's events as they are sent, a client gone cancelling its requests; and the text the router keys on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the OpenAI app needs the serve extra: pip install -e '.[serve]'")

from refusion.runtime.generator import Generator
from refusion.serve.frontend import Frontend
from refusion.serve.openai.exchange import AppConfig
from refusion.serve.openai.metrics import Arrival, ServerMetrics
from refusion.serve.openai.server import served_app
from refusion.serve.rayserve.relay import ROUTE_CHARS, Relayed, prompt_text, run_app
from tests.gate import HANG_GUARD_S, ForwardGate


@pytest.fixture(scope="module")
def gen(tiny_export) -> Iterator[Generator]:
    with Generator.from_dir(tiny_export, backend="ort-cpu", threads=1, max_requests=2, max_batch=2) as g:
        yield g


@pytest.fixture
def served(gen) -> Iterator[tuple[Any, Frontend[Arrival], ServerMetrics]]:
    both = served_app(gen, 4, AppConfig("refusion", 1 << 20, 30.0, None, frozenset({"*"})))
    yield both
    both[1].close(timeout_s=30)


@pytest.fixture
def app(served) -> Any:
    return served[0]


def _relayed(body: dict[str, Any] | bytes, path: str = "/v1/chat/completions") -> Relayed:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Relayed("POST", path, b"", ((b"host", b"localhost"), (b"content-type", b"application/json")), raw,
                   ("127.0.0.1", 1), prompt_text(raw))


async def _answer(app: Any, request: Relayed) -> tuple[int, bytes, list[bytes]]:
    status, parts = 0, []
    async for batch in run_app(app, request):
        for message in batch:
            if message["type"] == "http.response.start":
                status = message["status"]
            else:
                parts.append(message.get("body", b""))
    return status, b"".join(parts), parts


def _chat(prompt: str, **fields: Any) -> dict[str, Any]:
    return {"model": "refusion", "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
            "temperature": 0, **fields}


def test_a_relayed_answer_is_the_apps_own(app, gen) -> None:
    status, body, _ = asyncio.run(_answer(app, _relayed(_chat("sort: 5 2 8 2"))))
    assert status == 200
    expected = gen.generate(messages=[{"role": "user", "content": "sort: 5 2 8 2"}], chat=True, max_tokens=24, temperature=0)
    assert json.loads(body)["choices"][0]["message"]["content"] == expected.text


def test_a_stream_comes_as_its_events(app) -> None:
    status, body, parts = asyncio.run(_answer(app, _relayed(_chat("reverse: robotics", stream=True))))
    events = [line for line in body.decode().split("\n\n") if line]
    assert status == 200 and events[-1] == "data: [DONE]" and len(parts) >= len(events)
    text = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == "scitobor"


def test_the_apps_refusals_come_back_as_they_are(app) -> None:
    status, body, _ = asyncio.run(_answer(app, _relayed(b"{bad")))
    assert status == 400 and "not JSON" in json.loads(body)["error"]["message"]


def test_closing_the_answer_early_cancels_its_request(served, gen) -> None:
    app, frontend, _ = served

    async def leave() -> str:
        with ForwardGate(gen.runner) as gate:
            answer = run_app(app, _relayed(_chat("sort: 9 8 7 6 5 4 3 2 1", max_tokens=200)))
            first = asyncio.ensure_future(anext(answer))
            await asyncio.to_thread(gate.wait_held)  # the request is decoding, held at a forward
            [request] = list(frontend._live)
            first.cancel()  # as Ray cancels a call whose caller went away: the app is told its client left

            def open_once_cancelled() -> None:
                assert request._cancelled.wait(HANG_GUARD_S), "the request was not cancelled"
                gate.open()

            await asyncio.gather(first, asyncio.to_thread(open_once_cancelled), return_exceptions=True)
            return (await asyncio.to_thread(request.result, HANG_GUARD_S)).finish_reason

    assert asyncio.run(leave()) == "cancelled"


def test_the_router_keys_on_the_prompts_text_in_order() -> None:
    system = {"role": "system", "content": "You control a robot."}
    first = prompt_text(json.dumps({"messages": [system, {"role": "user", "content": "move 3"}]}).encode())
    second = prompt_text(json.dumps({"messages": [system, {"role": "user", "content": [
        {"type": "text", "text": "turn 90"}]}]}).encode())
    assert first.startswith("systemYou control a robot.user") and second.endswith("userturn 90")
    assert prompt_text(b'{"prompt": "sort: 1 2"}') == "sort: 1 2"
    assert prompt_text(b'{"prompt": [1, 2, 3]}') == "1,2,3,"
    assert prompt_text(b'{"instructions": "Be brief.", "input": "hi"}') == "Be brief.hi"


def test_what_cannot_be_read_routes_anywhere() -> None:
    assert prompt_text(b"{bad") == "" and prompt_text(b"[1, 2]") == ""
    deep = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert prompt_text(deep) == ""
    long = prompt_text(json.dumps({"prompt": "x" * (3 * ROUTE_CHARS)}).encode())
    assert len(long) == ROUTE_CHARS
