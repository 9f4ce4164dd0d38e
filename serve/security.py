"""Who may call a server and how much of a request it reads: the defaults every serving frontend shares
(refusion-run serve's gateways in front of Triton, and an OpenAI-compatible frontend over the same seam).
docs/serving.md ("Security and limits") says why each is what it is.

- The bind address defaults to loopback; binding another interface without an API key earns a warning.
- The API key comes from --api-key or REFUSION_API_KEY and is compared in constant time.
- A request body is at most `body_limit(max_prompt_bytes)` bytes and JSON at most MAX_JSON_DEPTH deep, checked
  before any parser recurses into it (runtime/core/nesting.py's scan, which bounds a guide given as JSON text the
  same way); prompts are bounded in bytes by the runtime (Generator.max_prompt_bytes).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import resource
import socket
from collections.abc import Collection
from typing import Any

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.nesting import MAX_JSON_DEPTH, json_depth

DEFAULT_ADDRESS = "127.0.0.1"  # this host only; --address 0.0.0.0 serves every interface
API_KEY_ENV = "REFUSION_API_KEY"
MIN_KEY_LENGTH = 16
JSON_ESCAPE_BYTES = 6  # JSON may spend 6 bytes (\u00e9) on one byte of text
BODY_OVERHEAD = 64 << 10  # the request's other fields beside its prompt
FILES_RESERVED = 256  # open files a server keeps beside its connections: the model's, its threads', its logs'


def api_key(option: str | None) -> str | None:
    """The key clients must send (`Authorization: Bearer KEY`): --api-key, else $REFUSION_API_KEY, else none."""
    key = option if option is not None else os.environ.get(API_KEY_ENV)
    if key is None:
        return None
    source = "--api-key" if option is not None else f"${API_KEY_ENV}"
    if len(key) < MIN_KEY_LENGTH or not key.isascii() or not key.isprintable() or " " in key:
        raise RefusionError(f"{source} must be at least {MIN_KEY_LENGTH} printable ASCII characters without spaces; "
                            "make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'.")
    return key


def authorized(header: str | None, key: str | None) -> bool:
    """Whether an Authorization header carries `key` (always, when the server has none); constant time."""
    if key is None:
        return True
    scheme, _, given = (header or "").partition(" ")
    # compare_digest takes as long for a wrong key of any prefix: the key cannot be guessed byte by byte.
    return hmac.compare_digest(given.strip().encode(errors="replace"), key.encode()) and scheme.lower() == "bearer"


def bind_address(address: str, flag: str = "--address") -> str:
    """`address` (an IP or a host name) as the numeric IP to bind, or a RefusionError saying why it cannot be."""
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise RefusionError(f"{flag} {address!r} is not an IP address or a name this host resolves; "
                            f"give an address of this host (127.0.0.1 for it alone, 0.0.0.0 for every interface).") \
            from None
    return str(infos[0][4][0])


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def exposure_warning(address: str, key: str | None) -> str | None:
    """A warning for a server reachable from other hosts that anyone there may call."""
    if key is not None or is_loopback(address):
        return None
    return (f"warning: serving on {address} without an API key: any host that reaches it may use the model; "
            f"give --api-key (or ${API_KEY_ENV}), or --address {DEFAULT_ADDRESS}.")


def host_allowed(header: str | None, allowed: Collection[str]) -> bool:
    """Whether a request's Host header names this server: an IP address, localhost (or a name under .localhost),
    or one of `allowed` ("*": any). A web page reaches a server on loopback or a private network through DNS
    rebinding only under a name of its own, which this refuses. A request without one is no browser's."""
    if header is None or "*" in allowed:
        return True
    host = header.strip().lower()
    if host.startswith("["):  # [IPv6]:port
        host, closed, _ = host[1:].partition("]")
        if not closed:
            return False
    elif host.count(":") == 1:  # name:port
        host = host.split(":")[0]
    host = host.rstrip(".")
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return host == "localhost" or host.endswith(".localhost") or host in {name.lower().rstrip(".") for name in allowed}


def connections_allowed(wanted: int) -> int:
    """`wanted` open connections, or as many as this process's open-file limit leaves room for beside
    FILES_RESERVED; the soft limit is raised to the hard one first (as Go's runtime does), since the usual soft
    1024 would make accept() fail before a server could close an idle connection to make room."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        soft = hard if hard != resource.RLIM_INFINITY else max(soft, wanted + FILES_RESERVED)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return wanted if soft == resource.RLIM_INFINITY else max(1, min(wanted, soft - FILES_RESERVED))


def body_limit(max_prompt_bytes: int) -> int:
    """The largest request body worth reading: the longest prompt that could fit, JSON-escaped, and the rest."""
    return max_prompt_bytes * JSON_ESCAPE_BYTES + BODY_OVERHEAD


def read_json_object(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """A request body as a JSON object: UTF-8 only (json would take a BOM-led body as UTF-16, which the nesting
    scan does not read), nesting, duplicate keys and NaN / Infinity refused, each named."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RefusionError(f"the body is not UTF-8 ({e.reason} at byte {e.start}).") from None
    depth = json_depth(body)
    if depth > max_depth:
        raise RefusionError(f"the body nests {depth} deep, over the limit of {max_depth}; send a flat JSON object.")
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise RefusionError(f"the body is not JSON ({e.msg} at line {e.lineno} column {e.colno}).") from None
    if not isinstance(value, dict):
        raise RefusionError(f"the body is a JSON {type(value).__name__}, not an object; send "
                            '{"text_input": "...", ...}.')
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise RefusionError(f"the body gives {key!r} twice; give each field once.")
        seen[key] = value
    return seen


def _no_constant(name: str) -> Any:
    raise RefusionError(f"the body holds {name}, which is not JSON; send a finite number.")
