"""A gate on a runner's forwards, for tests that need work in flight (principle 15: no sleeps, no
"long enough" requests). Every `run_batch` call waits at the gate while the hold condition is true,
until the test lets it through; so a request is mid-decode for exactly as long as the test says, on a
machine of any speed.

    with ForwardGate(gen.runner) as gate:            # every forward waits
        victim = gen.submit(...)
        gate.hold_when(lambda: victim.commits)       # forwards pass until the victim has a commit
        gate.wait_held()                             # the scheduler thread is inside a forward, held
        victim.cancel()
    # leaving the block opens the gate, so a failed test never leaves the scheduler stuck
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from refusion.runtime.generator import Generator
from refusion.runtime.runners.base import Runner

HANG_GUARD_S = 60.0  # only guards against a hang: a scheduler that is not held reaches the gate within a round


class ForwardGate:
    def __init__(self, runner: Runner, hold: Callable[[], Any] = lambda: True):
        self.runner = runner
        self.passed = 0  # forward calls that went through and finished
        self._hold = hold
        self._allowed = 0  # calls let through although the hold condition is true
        self._open = False
        self._held = False  # a call waits at the gate now
        self._cond = threading.Condition()
        self._real = runner.run_batch
        runner.run_batch = self._run_batch  # type: ignore[method-assign]

    def _run_batch(self, graph, rows):
        with self._cond:
            while not self._open and self._hold():
                if self._allowed:
                    self._allowed -= 1
                    break
                self._held = True
                self._cond.notify_all()
                self._cond.wait()  # until allow(), open() or a new hold condition
            self._held = False
        try:
            return self._real(graph, rows)
        finally:
            with self._cond:
                self.passed += 1
                self._cond.notify_all()

    def hold_when(self, condition: Callable[[], Any]) -> None:
        """Hold each forward call while `condition()` is true (checked as each call arrives, and again
        by a held call when this changes)."""
        with self._cond:
            self._hold, self._held = condition, False
            self._cond.notify_all()

    def allow(self, n: int = 1) -> None:
        """Let the next `n` calls through whatever the condition; the gate holds the ones after again."""
        with self._cond:
            self._allowed += n
            self._held = False
            self._cond.notify_all()

    def wait_held(self) -> None:
        """Until a forward call waits at the gate (the scheduler thread is stopped inside it); after
        `allow` or `hold_when`, a call that arrived since."""
        with self._cond:
            assert self._cond.wait_for(lambda: self._held, HANG_GUARD_S), "no forward reached the gate"

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def close_generator(self, gen: Generator) -> None:
        """`gen.close()` while a forward is held: the scheduler is marked closed before the gate opens,
        so what is in flight ends "cancelled" at its next step instead of running on to its end."""
        closing = threading.Thread(target=gen.close)
        closing.start()
        with gen.scheduler._lock:  # close() notifies it once it has marked the scheduler closed
            assert gen.scheduler._lock.wait_for(lambda: gen.scheduler._closed, HANG_GUARD_S)
        self.open()
        closing.join(HANG_GUARD_S)
        assert not closing.is_alive(), "Generator.close() hung"

    def __enter__(self) -> ForwardGate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.open()
        self.runner.run_batch = self._real  # type: ignore[method-assign]
