"""OpenAI servers on loopback, free ports, in this process (uvicorn in a thread), over one Generator of the
embedded model that the tests can hold with tests/gate.py's ForwardGate; skipped without the serve extra."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("fastapi", reason="the OpenAI server needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("openai", reason="the tests drive the server with the openai client (dev extra)")

from refusion.runtime.generator import Generator
from refusion.serve.openai.server import OpenAIServer
from tests.serve.openai.helpers import served, wait_idle


@pytest.fixture(scope="module")
def gen(tiny_export) -> Iterator[Generator]:
    with Generator.from_dir(tiny_export, backend="ort-cpu", threads=1, max_requests=2, max_batch=2) as g:
        yield g


@pytest.fixture
def serve(gen) -> Iterator[Callable[..., OpenAIServer]]:
    """Start a server over `gen` (keywords: OpenAIServer's); each ends the test idle, nothing held."""
    servers: list[OpenAIServer] = []

    def start(**options) -> OpenAIServer:
        servers.append(OpenAIServer(gen, port=0, **options).start())
        return servers[-1]

    yield start
    for server in servers:
        wait_idle(server)
        server.stop()


@pytest.fixture(scope="module")
def tool_server(exports) -> Iterator[tuple[Generator, OpenAIServer]]:
    """A server over a random-weight model whose chat template has a tool format (the fixture tokenizer's)."""
    with served(exports["fp32"]) as both:
        yield both


@pytest.fixture(scope="module")
def untooled_server(untooled_export) -> Iterator[OpenAIServer]:
    """A server over the embedded model with a chat template that has no tool format (conftest's untooled_export)."""
    with served(untooled_export) as (_, server):
        yield server
