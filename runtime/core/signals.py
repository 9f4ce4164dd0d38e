"""Asynchronous signals (Ctrl-C's SIGINT, SIGTERM, ...) kept off the runtime's own threads.

Python runs signal handlers in the main thread, but the kernel delivers a process's signal to any thread that
does not block it. One that lands on a worker thread (the scheduler, onnxruntime's or the GPU driver's pool)
sets Python's flag without interrupting the main thread where it waits in a system call: readline's select in
`refusion-run chat` then sat on a Ctrl-C until the next key. Threads started inside `main_thread_signals()`
inherit a mask that blocks them, so those signals reach the main thread.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

# Raised by the faulting thread itself (or abort()): never blocked, so a crash still reports where it happened.
_SYNCHRONOUS = {getattr(signal, name) for name in ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTRAP",
                                                    "SIGSYS") if hasattr(signal, name)}


@contextmanager
def main_thread_signals() -> Iterator[None]:
    """Threads started within block every asynchronous signal (the caller's mask is restored on leaving)."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no per-thread masks, nothing to do
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - _SYNCHRONOUS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
