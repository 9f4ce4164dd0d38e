"""What a request asks beyond its prompt and its decode settings (DecodeParams): where its answer stops,
what its result carries, its deadline and the structure its answer follows: the `request` rows of
runtime/core/settings.py. `Generator.submit`
takes these and the decode settings as its keywords; a frontend translates its wire format into them."""

from __future__ import annotations

from dataclasses import dataclass, fields

from refusion.runtime.core.settings import DEFAULTS, REQUEST


@dataclass(frozen=True)
class RequestOptions:
    stop: tuple[str, ...] = DEFAULTS["stop"]  # the answer ends before the first of these strings in its settled text
    stop_token_ids: tuple[int, ...] = DEFAULTS["stop_token_ids"]  # ... or at the first of these tokens (EOS ends it)
    logprobs: bool = DEFAULTS["logprobs"]  # the result carries each returned token's log-probability
    top_logprobs: int = DEFAULTS["top_logprobs"]  # ... and this many alternatives to each (at most the candidates)
    timeout_s: float | None = DEFAULTS["timeout_s"]  # the request ends with finish_reason "timeout" at this deadline
    # structured output, one guide at most (runtime/structured/guide.py); JSON ones held as their JSON text
    json_schema: str | None = DEFAULTS["json_schema"]  # the answer is JSON valid under this schema
    regex: str | None = DEFAULTS["regex"]  # ... matches this regular expression whole
    choice: tuple[str, ...] | None = DEFAULTS["choice"]  # ... is one of these strings (given, at least one)
    grammar: str | None = DEFAULTS["grammar"]  # ... follows this grammar (Lark or GBNF)

    def __post_init__(self) -> None:
        for setting in REQUEST:
            object.__setattr__(self, setting.name, setting.check(getattr(self, setting.name)))

    @staticmethod
    def names() -> tuple[str, ...]:
        return tuple(f.name for f in fields(RequestOptions))
