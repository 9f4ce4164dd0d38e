"""What a request asks beyond its prompt and its decode settings (DecodeParams): where its answer stops,
what its result carries, and its deadline. `Generator.submit` takes these and the decode settings as its
keywords; a frontend translates its wire format into them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from numbers import Integral
from typing import Any

from refusion.runtime.core.errors import RefusionError


@dataclass(frozen=True)
class RequestOptions:
    stop: tuple[str, ...] = ()  # the answer ends before the first of these strings in its settled text
    stop_token_ids: tuple[int, ...] = ()  # ... or at the first of these tokens (EOS ends it anyway)
    logprobs: bool = False  # the result carries each returned token's log-probability
    top_logprobs: int = 0  # ... and this many alternatives to each (at most the export's candidates)
    timeout_s: float | None = None  # the request ends with finish_reason "timeout" at this deadline

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _strings(self.stop))
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        if not isinstance(self.logprobs, bool):
            raise RefusionError(f"logprobs={self.logprobs!r} must be True or False.")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, Integral) or self.top_logprobs < 0:
            raise RefusionError(f"top_logprobs={self.top_logprobs!r} must be an integer >= 0 (alternatives reported "
                                "beside each token).")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
            raise RefusionError(f"timeout_s={t!r} must be a positive number of seconds (or None).")

    @staticmethod
    def names() -> tuple[str, ...]:
        return tuple(f.name for f in fields(RequestOptions))


def _strings(stop: Any) -> tuple[str, ...]:
    """A string or strings, each non-empty."""
    values = (stop,) if isinstance(stop, str) else stop
    if not isinstance(values, Iterable) or isinstance(values, (bytes, dict)):
        raise RefusionError(f"stop={stop!r} must be a string or a list of strings, e.g. stop=['\\n\\n', 'User:'].")
    values = tuple(values)
    bad = [s for s in values if not isinstance(s, str) or not s]
    if bad:
        raise RefusionError(f"stop={stop!r} holds {bad[0]!r}; each stop sequence must be a non-empty string.")
    return values


def _token_ids(ids: Any) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise RefusionError(f"stop_token_ids={ids!r} must be a list of token ids, e.g. stop_token_ids=[2].")
    values = tuple(ids)
    bad = [t for t in values if isinstance(t, bool) or not isinstance(t, Integral) or t < 0]
    if bad:
        raise RefusionError(f"stop_token_ids={ids!r} holds {bad[0]!r}; token ids are non-negative integers.")
    return tuple(int(t) for t in values)
