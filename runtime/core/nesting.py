"""How deep JSON nests, measured without recursion, so that nothing deeper than MAX_JSON_DEPTH reaches a parser
or json.dumps, which recurse (a RecursionError, not a refusal): a server's request body and a guide given as JSON
text (json_depth, on the bytes before they are parsed), a guide given as a dict (value_depth). The servers'
reader (serve/security.py) and the guides' settings (runtime/core/settings.py) hold both to the same bound."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

MAX_JSON_DEPTH = 32  # a request is a flat object; OpenAI's messages with content parts and tool schemas stay below

_ESCAPE = re.compile(rb"\\.", re.DOTALL)  # a backslash and the byte it escapes: matched or not in O(1) at each byte
_SCAN_CHUNK = 1 << 18  # bytes scanned per step; other threads get the GIL between steps
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1
_QUOTE = ord('"')


def json_depth(body: bytes) -> int:
    """How deep `body`'s arrays and objects nest, without parsing it: no recursion (any depth is safe) and time
    linear in its length whatever it holds (no pattern that backtracks), in chunks that let other threads run.
    Escapes are dropped first; then a quote opens or closes a string, and brackets count outside strings."""
    depth = peak = 0
    in_string = escaping = False  # carried from one chunk to the next
    for start in range(0, len(body), _SCAN_CHUNK):
        chunk = body[start + escaping:start + _SCAN_CHUNK]
        plain = _ESCAPE.sub(b"", chunk)
        escaping = plain.endswith(b"\\")  # only a chunk's last byte can be a backslash left unpaired
        codes = np.frombuffer(plain[:-1] if escaping else plain, dtype=np.uint8)
        if not len(codes):
            continue
        inside = np.bitwise_xor.accumulate((codes == _QUOTE).view(np.uint8)) ^ in_string
        in_string = bool(inside[-1])
        levels = depth + np.cumsum(np.where(inside, 0, _DEPTH_STEP[codes]), dtype=np.int64)
        peak, depth = max(peak, int(levels.max())), int(levels[-1])
    return peak


def value_depth(value: Any) -> int:
    """How deep a Python value's dicts, lists and tuples (what json.dumps writes as objects and arrays) nest, as
    json_depth counts its JSON text ({} is 1, a scalar 0), without recursion. A value that holds itself is counted
    to where it first does, and left for json.dumps to refuse (a circular reference)."""
    peak = 0
    path: list[int] = []  # the ids of the containers from `value` down to the one being read
    on_path: set[int] = set()
    stack = [iter((value,))]  # per level, what is left to read of it
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            if path:
                on_path.discard(path.pop())
            continue
        if isinstance(item, dict):
            children = iter(item.values())
        elif isinstance(item, (list, tuple)):
            children = iter(item)
        else:
            continue
        if id(item) in on_path:
            return max(peak, len(path) + 1)
        path.append(id(item))
        on_path.add(id(item))
        stack.append(children)
        peak = max(peak, len(path))
    return peak


_END = object()
