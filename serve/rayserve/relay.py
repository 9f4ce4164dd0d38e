"""An HTTP request carried whole from the ingress to a replica, and run there through the replica's ASGI app as if
its client had sent it: the ingress and the replicas share no socket, only Ray's calls, so a request crosses as
one object and its answer comes back as the ASGI messages the app sends (a stream's events as they are sent).

The app is the single-process server's (serve/openai/app.py): the same routes, limits, errors and metrics. A
client that goes away (the ingress cancels the call) is an `http.disconnect`, as when a connection closes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

ROUTE_CHARS = 4096  # the most of a prompt's text the router keys on: enough to tell conversations apart
_LEAVE_S = 10.0  # for an app whose client went away to end its requests before it is cancelled outright


@dataclass(frozen=True)
class Relayed:
    """A request as the ingress read it: its line, headers and body; `prompt`, the text its prompt starts with
    (what the router keys on: prefix_owners.py)."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None
    prompt: str = ""


async def run_app(app: ASGIApp, request: Relayed) -> AsyncIterator[list[Message]]:
    """The ASGI messages `app` sends in answer to `request`, in order, each time those sent since the last (one
    Ray item a batch: under load a stream's events come several at once). Closing the iterator early (the call
    cancelled: its client went away) tells the app its client disconnected and waits for it to end its
    requests."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
             "query_string": request.query, "root_path": "", "headers": list(request.headers),
             "client": request.client, "server": None}
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.put_nowait(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        ended = False
        while not ended:
            batch = [await sent.get()]
            while not sent.empty():
                batch.append(sent.get_nowait())
            ended = batch[-1] is None
            messages = [message for message in batch if message is not None]
            if messages:
                yield messages
        task.result()  # the app answers its own errors; what escapes it is a bug, raised to the ingress
    finally:
        if not task.done():
            gone.set()
            await asyncio.wait({task}, timeout=_LEAVE_S)
            task.cancel()


def prompt_text(body: bytes) -> str:
    """The text a request's prompt starts with, for routing: the Responses API's instructions, then the messages'
    (or input's) contents in order, or the completion's prompt; at most ROUTE_CHARS of it. A body that is no JSON
    object gives "" (routed anywhere; its replica refuses it)."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return ""
    if not isinstance(request, dict):
        return ""
    text: list[str] = []
    for name in ("instructions", "messages", "input", "prompt"):
        _collect(request.get(name), text)
        if sum(map(len, text)) >= ROUTE_CHARS:
            break
    return "".join(text)[:ROUTE_CHARS]


def _collect(value: Any, into: list[str], depth: int = 0) -> None:
    """The text in a prompt's value, in order: a string, token ids, messages' roles and contents, a content's
    parts' text (four levels down at most: a list of messages, a message, its parts, a part)."""
    if isinstance(value, str):
        into.append(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        into.append(f"{value},")
    elif depth < 4 and isinstance(value, list):
        for item in value[:ROUTE_CHARS]:
            _collect(item, into, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for name in ("role", "content", "text"):
            _collect(value.get(name), into, depth + 1)
