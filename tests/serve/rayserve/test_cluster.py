"""The Ray Serve application on a local Ray cluster of this machine (`refusion-run serve --replicas 2`, a process
of its own: Ray's gRPC threads in this one would break the tests that fork after it): 2 replicas of the embedded
model, each one CPU, behind the ingress. Concurrent requests get the answers the Generator gives alone; requests
sharing a system prompt go to one replica and hit its prefix cache; a replica's process killed under load costs
its requests a retryable 503 (never a hang) and is replaced."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                                   reason="the Ray Serve application needs the ray extra")]
httpx = pytest.importorskip("httpx")

from refusion.runtime.generator import Generator  # noqa: E402
from tests.gate import HANG_GUARD_S  # noqa: E402

REPLICA = "x-refusion-replica"  # ingress.REPLICA_HEADER (importing it would import Ray here)
REFUSION_RUN = Path(sys.executable).parent / "refusion-run"
SYSTEMS = [f"You are assistant number {i}. Answer the task exactly, in the form it was taught, nothing else. "
           for i in range(4)]  # each over the router's 64-character block, and the prefix cache's 16 tokens


def _prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["robotics", "diffusion", "planner", "infill", "gripper", "slot", "kernel", "engine"]
    return [f"sort: {' '.join(str(rng.randrange(10)) for _ in range(rng.randrange(3, 8)))}" if i % 2 else
            f"reverse: {rng.choice(words)}" for i in range(n)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _until(condition: Callable[[], Any], what: str, timeout_s: float = 120.0) -> Any:
    """Poll `condition` until it returns something true: the cluster's state changes in other processes."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.2)
    return value


@pytest.fixture(scope="module")
def url(tiny_export) -> Iterator[str]:
    # 200 requests at once: each replica holds 2 running + 110 queued (few running: a replica killed under load
    # has many requests on it for long enough to be seen)
    port = _free_port()
    server = subprocess.Popen([str(REFUSION_RUN), "serve", str(tiny_export), "--replicas", "2", "--backend", "ort-cpu",
                               "--max-requests", "2", "--max-queue", "110", "--http-port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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
        yield f"http://127.0.0.1:{port}"
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=HANG_GUARD_S)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()


@pytest.fixture(scope="module")
def alone(tiny_export) -> Iterator[Callable[..., str]]:
    """The answer the Generator gives a chat request alone, in this process."""
    with Generator.from_dir(tiny_export, backend="ort-cpu", threads=1) as gen:
        def answer(messages: list[dict[str, str]], max_tokens: int = 24, **settings: Any) -> str:
            return gen.generate(messages=messages, chat=True, max_tokens=max_tokens, temperature=0, **settings).text
        yield answer


def _chat(messages: list[dict[str, str]], max_tokens: int = 24, **fields: Any) -> dict[str, Any]:
    return {"model": "refusion", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **fields}


def _client(url: str, connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S * 2, limits=httpx.Limits(max_connections=connections))


async def _send_all(url: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async with _client(url, len(bodies)) as client:
        return await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for body in bodies))


def test_200_concurrent_requests_get_the_answers_the_generator_gives_alone(url, alone) -> None:
    conversations = [[{"role": "user", "content": prompt}] for prompt in _prompts(200)]
    replies = asyncio.run(_send_all(url, [_chat(c) for c in conversations]))
    assert [r.status_code for r in replies] == [200] * 200, {r.status_code: r.text for r in replies}
    got = [r.json()["choices"][0]["message"]["content"] for r in replies]
    assert got == [alone(c) for c in conversations]
    assert {r.headers[REPLICA] for r in replies} and len({r.headers[REPLICA] for r in replies}) == 2  # both worked


def test_requests_sharing_a_system_prompt_go_to_the_replica_holding_it(url, alone) -> None:
    client = httpx.Client(base_url=url, timeout=HANG_GUARD_S)
    taken: dict[int, set[str]] = {i: set() for i in range(len(SYSTEMS))}
    for round_ in range(3):
        for i, system in enumerate(SYSTEMS):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": _prompts(3, i)[round_]}]
            reply = client.post("/v1/chat/completions", json=_chat(messages))
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == alone(messages)
            taken[i].add(reply.headers[REPLICA])
            if round_:  # the system prompt's KV came from that replica's prefix cache
                assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert all(len(replicas) == 1 for replicas in taken.values()), taken


def test_health_and_metrics_gather_every_replica_and_the_ingress_checks_as_one_server_does(url) -> None:
    client = httpx.Client(base_url=url, timeout=HANG_GUARD_S)
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ready"
    assert [r["status"] for r in health.json()["replicas"]] == ["ready", "ready"]
    metrics = client.get("/metrics").text
    replicas = {r["id"] for r in health.json()["replicas"]}
    assert all(f'replica="{replica}"' in metrics for replica in replicas) and "refusion_requests_total{" in metrics
    rebound = client.post("/v1/chat/completions", json=_chat([{"role": "user", "content": "hi"}]),
                          headers={"Host": "evil.example"})
    assert rebound.status_code == 400 and rebound.json()["error"]["code"] == "invalid_host"
    huge = client.post("/v1/chat/completions", content=b'{"x": "' + b"a" * 10_000_000 + b'"}',
                       headers={"Content-Type": "application/json"})
    assert huge.status_code == 413
    assert 'refusion_requests_refused_total{replica="ingress",status="413"} 1.0' in client.get("/metrics").text


def test_a_replica_killed_under_load_costs_only_retryable_errors_and_is_replaced(url, alone) -> None:
    client = httpx.Client(base_url=url, timeout=HANG_GUARD_S)
    replicas = client.get("/health").json()["replicas"]
    before, victim = {r["id"] for r in replicas}, replicas[0]["pid"]
    conversations = [[{"role": "user", "content": prompt}] for prompt in _prompts(200, seed=1)]
    # 100 forwards a request (AR under a regex of 100 digits): the victim holds requests for seconds
    digits = "[0-9]{100}"
    bodies = [_chat(c, max_tokens=100, stream=bool(i % 2), mode="ar", guided_regex=digits)
              for i, c in enumerate(conversations)]

    async def load_and_kill() -> list[httpx.Response]:
        # Killed once 10 of the 200 are answered, in the middle of the load: the router balances the two replicas
        # (within 4 requests), so the victim is busy. (Waiting for /health to show a busy replica raced its answers:
        # under load /health took about a second, in which a replica answered 25-50 short requests.)
        async with _client(url, len(bodies)) as load:
            sending = [asyncio.ensure_future(load.post("/v1/chat/completions", json=body)) for body in bodies]
            pending: set[asyncio.Future[httpx.Response]] = set(sending)
            while len(sending) - len(pending) < 10:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            os.kill(victim, signal.SIGKILL)  # the replica's process, as a crash or the OOM killer ends it
            return list(await asyncio.gather(*sending))

    replies = asyncio.run(load_and_kill())
    lost = 0
    for reply, conversation in zip(replies, conversations):
        if reply.status_code == 503:
            assert reply.headers["Retry-After"] and reply.json()["error"]["code"] == "server_unavailable"
            lost += 1
            continue
        assert reply.status_code == 200, reply.text
        if reply.headers["content-type"].startswith("text/event-stream"):
            events = [json.loads(e[6:]) for e in reply.text.split("\n\n") if e and e != "data: [DONE]"]
            if "error" in events[-1]:  # the replica died mid-stream: the stream says so, retryably
                assert events[-1]["error"]["code"] == "server_unavailable"
                lost += 1
                continue
            assert reply.text.endswith("data: [DONE]\n\n")
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
        else:
            text = reply.json()["choices"][0]["message"]["content"]
        assert text == alone(conversation, 100, mode="ar", regex=digits)
    assert lost >= 1  # the victim held requests when it died

    def replaced() -> bool:
        health = client.get("/health").json()
        ids = {r["id"] for r in health["replicas"] if r["status"] == "ready"}
        return health["status"] == "ready" and len(ids) == 2 and ids != before

    _until(replaced, "the killed replica replaced")
    messages = [{"role": "user", "content": "reverse: gripper"}]
    after = [client.post("/v1/chat/completions", json=_chat(messages)) for _ in range(4)]
    assert all(r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == alone(messages) for r in after)
