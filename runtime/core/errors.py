"""The one exception type of refusion-trt.

Every user-facing failure raises RefusionError with a message that says what failed,
the offending value, what was expected, and what to do about it. The CLIs turn it into
a one-line error and a non-zero exit; nothing else is caught.
"""

from __future__ import annotations

from types import TracebackType


class RefusionError(Exception):
    """A failure the user can act on; the message says how. `field`: the request's field it refuses, by the
    runtime's name (a setting's row, a guide's field, `tools[0].function.name`), where it refuses one: a frontend
    names it to its client from here (OpenAI's `param`), never by reading the message."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def refusing(field: str) -> _Refusing:
    """A `with` block in which a RefusionError raised refuses `field`, unless it names a field of its own."""
    return _Refusing(field)


class _Refusing:
    """refusing's context manager: a class, not a generator's, since every setting a request carries is checked in
    one (a generator's context manager costs about a microsecond more, ~20 times a request)."""

    __slots__ = ("field",)

    def __init__(self, field: str):
        self.field = field

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        if isinstance(error, RefusionError):
            error.field = error.field or self.field


class ContextLengthError(RefusionError):
    """A prompt and the answer it asks for exceed the model's positions (OpenAI's `context_length_exceeded`):
    the numbers ride with it, so a frontend recognises it by its type, not by reading its message.
    `context`: the model's positions; `prompt`: the prompt's tokens; `completion`: the positions the answer
    asked for (max_tokens, or the canvas; at least 1); `room`: the positions the prompt leaves (0 when none)."""

    def __init__(self, message: str, *, context: int, prompt: int, completion: int):
        super().__init__(message)
        self.context, self.prompt, self.completion = context, prompt, completion

    @property
    def room(self) -> int:
        return max(0, self.context - self.prompt)
