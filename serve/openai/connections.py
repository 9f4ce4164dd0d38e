"""The OpenAI server's connections: uvicorn's h11 protocol with deadlines, and a bound that idle connections
cannot pin. uvicorn alone times out neither a connection that never sends its headers nor one that sends them a
byte at a time, and past its concurrency limit answers 503 to every request, /health included.

- A request's line and headers must arrive within `header_timeout_s` of the connection opening or of the
  previous answer, and its body within `body_timeout_s` of its headers (where the app reads a body it answers
  408 at that deadline; a body no route reads is cut a moment later). Past a deadline the connection is closed.
- At most `max_connections` are open. One more closes the connection that has waited longest on its client
  (no request yet, one not yet whole, or idle between requests); only when every connection is being answered
  is the newcomer refused (503).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from refusion.serve.openai.responses import error_body

_APP_FIRST_S = 1.0  # past the body's deadline, time for the app's own 408 before the connection is cut


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    body_timeout_s: float


def _no_delay(transport: asyncio.Transport) -> None:
    """Segments leave as they are written (TCP_NODELAY). asyncio sets it only on sockets made with proto
    IPPROTO_TCP, and a listening socket made as socket(family, SOCK_STREAM) is proto 0, as are those it accepts:
    an answer written in two parts (uvicorn writes its headers, then its body) then waited for the client's ACK
    of the first, which a client delays up to 40 ms on a connection it keeps open, on every request after its first."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):  # a client already gone needs nothing sent
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol within `limits`: the class to give uvicorn.Config(http=...)."""
    return type("GuardedH11Protocol", (_Guarded,), {"limits": limits})


class _Guarded(H11Protocol):
    limits: ClassVar[ConnectionLimits]

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.waiting_since: float | None = None  # loop time since it has waited on its client; None: answered
        self._phase = ""  # what the client owes: "request" (line and headers), "body", or "" (being answered)
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        _no_delay(transport)
        self._await("request")
        if len(self.connections) > self.limits.max_connections:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        their = self.conn.their_state
        if their is h11.SEND_BODY and self._phase != "body":
            self._arm("body", self.limits.body_timeout_s + _APP_FIRST_S)
        elif their in (h11.DONE, h11.MUST_CLOSE) and self._phase:
            self._disarm()  # the request is whole: answering it is bounded by the request itself
            self._phase, self.waiting_since = "", None

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._await("request")  # the next one (a pipelined request may already be whole: handle_events sees it)
        super().on_response_complete()

    def _await(self, phase: str) -> None:
        self.waiting_since = self.loop.time()
        self._arm(phase, self.limits.header_timeout_s)

    def _arm(self, phase: str, delay_s: float) -> None:
        self._disarm()
        self._phase = phase
        self._deadline = self.loop.call_later(delay_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self._phase and not self.transport.is_closing():
            self.transport.close()

    def _make_room(self) -> None:
        others = [c for c in self.connections if isinstance(c, _Guarded) and c is not self
                  and not c.transport.is_closing()]  # one closed a moment ago counts no more
        if len(others) < self.limits.max_connections:
            return
        waiting = [c for c in others if c.waiting_since is not None]
        if waiting:
            min(waiting, key=lambda c: c.waiting_since or 0.0).transport.close()
            return
        body = json.dumps(error_body(503, "the server holds its limit of open connections, each being answered; "
                                          "retry later.", code="server_unavailable")).encode()
        self.transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                             b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()
