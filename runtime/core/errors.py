"""The one exception type of refusion-trt.

Every user-facing failure raises RefusionError with a message that says what failed,
the offending value, what was expected, and what to do about it. The CLIs turn it into
a one-line error and a non-zero exit; nothing else is caught.
"""


class RefusionError(Exception):
    """A failure the user can act on; the message says how."""


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
