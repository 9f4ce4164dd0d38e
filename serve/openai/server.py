"""The OpenAI-compatible server: the app (serve/openai/app.py) on uvicorn, over one Generator, in this process.

    with OpenAIServer(gen, port=0) as server:     # a thread of its own (tests, benches); port 0: a free one
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="-").chat.completions.create(...)
    OpenAIServer(gen, port=8000).run()            # in the foreground: refusion-run serve --api openai

The socket is bound at construction, so a taken port fails at once with our message, and a test knows its
port before anything runs. `drain()` (SIGTERM in the CLI) stops taking connections, lets the requests in
flight finish until the drain's deadline, cancels what still runs then (each gets its final response), and
ends the server once every connection has closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import errno
import socket
import threading
import time
from collections.abc import Iterator, Sequence

import uvicorn
from fastapi import FastAPI

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import Generator
from refusion.serve.frontend import Frontend
from refusion.serve.openai.app import create_app
from refusion.serve.openai.connections import ConnectionLimits, guarded_protocol
from refusion.serve.openai.exchange import AppConfig
from refusion.serve.openai.metrics import Arrival, ServerMetrics
from refusion.serve.security import DEFAULT_ADDRESS, bind_address, body_limit, connections_allowed

MAX_CONNECTIONS = 1024  # open at once; one more closes the one that has waited longest on its client
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this
HEADER_TIMEOUT_S = 10.0  # for a request's line and headers, from the connection opening or the previous answer
BODY_TIMEOUT_S = 30.0  # a body that has not arrived this long after its headers is refused (408)
_EXIT_MARGIN_S = 15  # uvicorn's own shutdown timeout beyond the drain's deadline: time for the cancelled to answer
_HANG_GUARD_S = 60.0


class OpenAIServer:
    def __init__(self, gen: Generator, *, model_name: str = "refusion", address: str = DEFAULT_ADDRESS, port: int = 8000,
                 api_key: str | None = None, max_queue: int = 64, drain_timeout_s: float = 30.0,
                 max_body: int | None = None, body_timeout_s: float = BODY_TIMEOUT_S,
                 header_timeout_s: float = HEADER_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
                 allowed_hosts: Sequence[str] = (), verbose: bool = False):
        """`api_key`: clients must send it (serve/security.py's api_key() reads --api-key and the environment);
        `max_body` (bytes of a request body): default, the longest prompt that fits the model, JSON-escaped,
        and the rest (serve/security.py's body_limit); `allowed_hosts`: the Host header's names taken beside IP
        addresses, localhost and `address` ("*": any); the connections' deadlines and bound: connections.py;
        `verbose`: uvicorn's info log and an access line per request on stderr."""
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise RefusionError(f"max_queue={max_queue!r} (--max-queue) must be an integer >= 0.")
        if not drain_timeout_s >= 0:
            raise RefusionError(f"--drain-timeout {drain_timeout_s!r} must be a number of seconds >= 0.")
        if gen.tokenizer is None:
            raise RefusionError(f"{gen.manifest.path} carries no tokenizer files, and the OpenAI API takes text; "
                                "export from a checkpoint that has its tokenizer.")
        self.gen, self.model_name, self.drain_timeout_s = gen, model_name, drain_timeout_s
        limit = max_body if max_body is not None else body_limit(gen.max_prompt_bytes)
        app, self.frontend, self.metrics = served_app(gen, max_queue, AppConfig(
            model_name, limit, body_timeout_s, api_key, frozenset({address, *allowed_hosts})))
        self.socket = _bind(bind_address(address), port)
        self.address, self.port = address, self.socket.getsockname()[1]
        limits = ConnectionLimits(connections_allowed(max_connections), header_timeout_s, body_timeout_s)
        config = uvicorn.Config(app, http=guarded_protocol(limits), loop="asyncio", lifespan="off",
                                log_config=_verbose_logging() if verbose else None,
                                log_level="info" if verbose else "warning", access_log=verbose,
                                timeout_keep_alive=KEEP_ALIVE_S, limit_concurrency=None,
                                timeout_graceful_shutdown=int(drain_timeout_s + _EXIT_MARGIN_S))
        self._server = _Uvicorn(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.address in ("0.0.0.0", "") else "[::1]" if self.address == "::" else self.address
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serve until drained (`drain()`, from a signal handler or another thread)."""
        try:
            self._server.run(sockets=[self.socket])
        finally:
            self.socket.close()

    def start(self) -> OpenAIServer:
        """Serve from a thread of its own; returns once it takes requests."""
        self._thread = threading.Thread(target=self.run, name="refusion-openai-server", daemon=True)
        self._thread.start()
        if not self._server.ready.wait(_HANG_GUARD_S) or self._server.loop is None:
            raise RefusionError("the OpenAI server did not start.")
        return self

    def drain(self) -> None:
        """Refuse new requests from now; cancel what still runs at the drain's deadline; end once every
        connection has closed. Safe from any thread and from a signal handler; the first call wins."""
        if self.frontend.drain_deadline is not None:
            return
        self.frontend.drain(time.time() + self.drain_timeout_s)
        loop = self._server.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already ended
                loop.call_soon_threadsafe(self._deadline_at, self.drain_timeout_s)
        self._server.should_exit = True

    def _deadline_at(self, delay_s: float) -> None:
        assert self._server.loop is not None
        self._server.loop.call_later(delay_s, lambda: self.frontend.cancel_gone(lambda arrival: True))

    def stop(self) -> None:
        """Drain and wait for the server's thread (started with `start`)."""
        self.drain()
        if self._thread is not None:
            self._thread.join(self.drain_timeout_s + 2 * _EXIT_MARGIN_S)

    def __enter__(self) -> OpenAIServer:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def served_app(gen: Generator, max_queue: int, config: AppConfig) -> tuple[FastAPI, Frontend[Arrival], ServerMetrics]:
    """The app over `gen`, behind a request limit of its running requests plus `max_queue`, and its metrics."""
    metrics = ServerMetrics()
    frontend: Frontend[Arrival] = Frontend(gen, max_queue, on_end=metrics.ended)
    metrics.watch(frontend)
    return create_app(frontend, metrics, config), frontend, metrics


class _Uvicorn(uvicorn.Server):
    """uvicorn that says when it takes requests, and leaves signals to its owner: the CLI drains first."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        self.ready.set()


def _verbose_logging() -> dict[str, object]:
    """uvicorn's own log configuration, its access lines on stderr (beside the rest) rather than stdout."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config


def _bind(address: str, port: int) -> socket.socket:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise RefusionError(f"--http-port {port!r} is not a TCP port; give 1-65535 (0: any free one).")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except OSError as e:
        sock.close()
        why = (f"port {port} is in use on {address} (another server?); stop it or give another --http-port"
               if e.errno == errno.EADDRINUSE else f"{address}:{port} cannot be bound ({e.strerror}); give an "
               "address of this host with --address (127.0.0.1: this host only)")
        raise RefusionError(f"{why}.") from None
    except (socket.gaierror, OverflowError, UnicodeError):
        sock.close()
        raise RefusionError(f"--address {address!r} is not an address of this host.") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
