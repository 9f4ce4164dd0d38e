"""The one exception type of refusion-trt.

Every user-facing failure raises RefusionError with a message that says what failed,
the offending value, what was expected, and what to do about it. The CLIs turn it into
a one-line error and a non-zero exit; nothing else is caught.
"""


class RefusionError(Exception):
    """A failure the user can act on; the message says how."""
