"""The OpenAI server's two checks before a request's body is read, as ASGI middleware: its Host header (against
DNS rebinding) and its API key. The single-process server (app.py) and the Ray Serve ingress (serve/rayserve/)
wrap their apps in the same two."""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from refusion.serve.openai.responses import error_body
from refusion.serve.security import authorized, host_allowed


class KeyCheck:
    """ASGI middleware: a request without the key gets 401 before its body is read (/health needs none, for
    load balancers); the key is compared in constant time (serve/security.py)."""

    def __init__(self, app: ASGIApp, key: str, refused: Callable[[], None]):
        self.app, self.key, self.refused = app, key, refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        if authorized(header, self.key):
            return await self.app(scope, receive, send)
        self.refused()
        message = ("this server needs its API key: send Authorization: Bearer KEY (the openai client: "
                   "api_key=KEY)." if not header else "the API key given is not this server's.")
        response = JSONResponse(error_body(401, message, code="invalid_api_key"), 401, {"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class HostCheck:
    """ASGI middleware: a request whose Host header names no host of this server gets 400 before anything else
    (serve/security.py host_allowed), so that a page that rebinds its own name to this address reads nothing."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str], refused: Callable[[], None]):
        self.app, self.allowed, self.refused = app, allowed, refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = dict(scope["headers"]).get(b"host") if scope["type"] == "http" else None
        if host is None or host_allowed(host.decode("latin-1"), self.allowed):
            return await self.app(scope, receive, send)
        self.refused()
        message = (f"the Host header {host.decode('latin-1')[:100]!r} names no host of this server, which takes IP "
                   "addresses, localhost and the names its --address and --allowed-host give (a web page reaches "
                   "a local server under a name of its own; the server refuses it).")
        await JSONResponse(error_body(400, message, code="invalid_host"), 400)(scope, receive, send)
