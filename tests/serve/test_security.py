"""The defaults every serving frontend shares (serve/security.py): the key, the address, the body's limits."""

from __future__ import annotations

import json
import random
import threading

import pytest

from refusion.runtime.core import nesting
from refusion.runtime.core.errors import RefusionError
from refusion.serve import security
from refusion.serve.security import (
    API_KEY_ENV,
    DEFAULT_ADDRESS,
    api_key,
    authorized,
    bind_address,
    body_limit,
    exposure_warning,
    host_allowed,
    json_depth,
    read_json_object,
)

KEY = "s3cret-key-of-24-chars!!"
HANG_GUARD_S = 60.0


def test_the_key_comes_from_the_option_else_the_environment(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key(None) is None
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert api_key(None) == KEY
    assert api_key("another-key-of-24-chars!") == "another-key-of-24-chars!"


@pytest.mark.parametrize("key", ["short", "a" * 15, "with a space in it, long", "ünïcode-ünïcode-ünïcode", "tab\there-and-long-enough"])
def test_a_weak_or_odd_key_is_refused_with_how_to_make_one(key):
    with pytest.raises(RefusionError, match="at least 16 printable ASCII characters.*secrets.token_urlsafe"):
        api_key(key)


def test_authorization_needs_the_bearer_scheme_and_the_exact_key():
    assert authorized(None, None) and authorized("anything", None)
    assert authorized(f"Bearer {KEY}", KEY) and authorized(f"bearer {KEY}", KEY)
    for header in (None, "", KEY, f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer ", "Bearer \udcff"):
        assert not authorized(header, KEY), header


def test_the_address_defaults_to_loopback_and_a_bad_one_is_named():
    assert DEFAULT_ADDRESS == "127.0.0.1" and bind_address("localhost") in ("127.0.0.1", "::1")
    assert bind_address("0.0.0.0") == "0.0.0.0"
    for bad in ("999.1.1.1", "no-such-host.invalid", "1.2.3.4.5"):
        with pytest.raises(RefusionError, match=f"--address '{bad}' is not an IP address or a name this host resolves"):
            bind_address(bad)


def test_serving_other_hosts_without_a_key_is_warned_about():
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("::1", None) is None
    assert exposure_warning("0.0.0.0", KEY) is None
    warning = exposure_warning("0.0.0.0", None)
    assert warning is not None and warning.startswith("warning: serving on 0.0.0.0 without an API key")


def test_a_host_header_is_taken_when_it_names_this_server():
    for header in (None, "127.0.0.1", "127.0.0.1:8000", "[::1]:8000", "::1", "LocalHost:1", "a.localhost",
                   "robot.lan", "Robot.LAN.:80"):
        assert host_allowed(header, {"robot.lan"}), header
    for header in ("evil.example", "evil.example:8000", "localhost.evil.example", "robot.lan.evil", "", "[::1"):
        assert not host_allowed(header, {"robot.lan"}), header
    assert host_allowed("evil.example", {"*"})


def test_the_body_limit_fits_the_longest_prompt_escaped():
    prompt = "\x01" * 1000  # JSON's worst case: \u0001, six bytes a byte
    assert len(json.dumps({"text_input": prompt, "max_tokens": 2**31 - 1, "mode": "refusion"})) <= body_limit(1000)


def test_nesting_is_measured_without_recursion():
    assert json_depth(b"{}") == 1 and json_depth(b'{"a": [1, {"b": []}]}') == 4
    assert json_depth(b'{"a": "[[[[{{{{"}') == 1  # brackets in strings do not count
    assert json_depth(b'{"a": "\\"[[["}') == 1
    assert json_depth(b"[" * 1_000_000) == 1_000_000
    assert json_depth(b"") == 0


def test_nesting_is_measured_in_time_linear_in_the_body_whatever_it_holds():
    """The probe's O6 / S31: an unterminated run of escaped quotes made the old pattern scan to the end from
    every quote, 57 s for 124 KB; 4 MB of it would take hours. The hang guard is thousands of times what a
    linear scan takes, and far short of the quadratic one."""
    done = []
    scan = threading.Thread(target=lambda: done.append(json_depth(b'"' + b'\\"' * 2_000_000 + b"[[")), daemon=True)
    scan.start()
    scan.join(HANG_GUARD_S)
    assert done == [0]  # all of it one unterminated string: no bracket counts


def _depth(value) -> int:
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    return 0 if children is None else 1 + max(map(_depth, children), default=0)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, nesting._SCAN_CHUNK])
def test_nesting_agrees_with_the_parser_across_chunk_boundaries(monkeypatch, chunk):
    """Escapes, quotes and brackets in strings, split anywhere between two chunks of the scan."""
    monkeypatch.setattr(nesting, "_SCAN_CHUNK", chunk)  # the scan lives in the runtime: guides use it too
    rng = random.Random(chunk)

    def text() -> str:
        return "".join(rng.choice('ab"\\[]{}\n\u00e9') for _ in range(rng.randrange(6)))

    def value(depth: int = 0):
        roll = rng.random()
        if depth < 6 and roll < 0.3:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        if depth < 6 and roll < 0.6:
            return {text(): value(depth + 1) for _ in range(rng.randrange(4))}
        return text() if roll < 0.9 else rng.randrange(100)

    for _ in range(300):
        v = value()
        body = json.dumps(v, ensure_ascii=rng.random() < 0.5).encode()
        assert json_depth(body) == _depth(v), body


@pytest.mark.parametrize("body, message", [
    (b'{"text_input": ' + b"[" * 60000 + b"]" * 60000 + b"}", "the body nests 60001 deep, over the limit of 32"),
    (b"{", "the body is not JSON"),
    (b"null", "the body is a JSON NoneType, not an object"),
    (b'{"a": 1, "a": 2}', "the body gives 'a' twice"),
    (b'{"a": Infinity}', "the body holds Infinity"),
    (b'{"a": -Infinity}', "the body holds -Infinity"),
    (b'\xff{}', "the body is not UTF-8"),
    ('{"a": [[1]]}'.encode("utf-16"), "the body is not UTF-8"),  # json.loads would read it; the nesting scan cannot
])
def test_a_body_is_read_as_one_json_object_or_refused(body, message):
    with pytest.raises(RefusionError, match=message):
        read_json_object(body)


def test_a_body_within_the_limits_reads_as_it_is():
    assert read_json_object(b'{"text_input": "h\\u00e9", "x": [[1]]}') == {"text_input": "hé", "x": [[1]]}
    assert security.MAX_JSON_DEPTH >= 8  # room for an OpenAI body: messages, content parts, tool schemas
