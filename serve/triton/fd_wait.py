"""Waiting on file descriptors with poll(2), which takes a descriptor of any number: select(2) fails on one of
1024 or more, which a process with a thousand connections open hands out."""

from __future__ import annotations

import select
from collections.abc import Iterable


def readable(fds: Iterable[int], timeout_s: float | None = None) -> list[int]:
    """Those of `fds` readable now (data, end of file or an error), after waiting up to `timeout_s` seconds (None:
    without end) for one of them to be."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)  # a hang-up or an error is reported whatever is asked for
    return [fd for fd, _ in poller.poll(None if timeout_s is None else timeout_s * 1000)]
