"""The serve tests' gate, loaded by every Python started with this directory on PYTHONPATH and acting only
where REFUSION_TEST_GATE names a gate directory (tests/serve/triton/gate.py sets both for tritonserver, whose
Python-backend stub runs the model; nothing of this ships in the package).

There, every forward of a runner first waits for the test: it reads one byte from the FIFO `release` in the
gate directory ("1": run one forward; "o": run freely from now on; "c": wait again), and the file `events`
gets a line "held" as a forward starts waiting on the closed gate and "cancel" as a request is cancelled. So a test holds a
request in flight exactly as long as it needs, on a machine of any speed.
"""

import os

_GATE = os.environ.get("REFUSION_TEST_GATE")


def _install(directory: str) -> None:
    import select
    import threading

    from refusion.runtime.request import Request
    from refusion.runtime.runners.base import Runner

    fifo = os.open(os.path.join(directory, "release"), os.O_RDWR)  # a reader and a writer: reads block, never EOF
    events = open(os.path.join(directory, "events"), "a", buffering=1)
    lock = threading.Lock()
    state = {"open": True}  # the model loads with the gate open

    def log(line: str) -> None:
        with lock:
            events.write(line + "\n")

    def wait() -> None:
        held = False
        while True:
            if state["open"]:
                if not select.select([fifo], [], [], 0)[0]:
                    return
            elif not held:
                log("held")
                held = True
            byte = os.read(fifo, 1)
            if byte == b"1":
                return
            state["open"] = byte == b"o"

    run_batch, cancel = Runner.run_batch, Request.cancel

    def gated_run_batch(self, graph, rows):
        wait()
        return run_batch(self, graph, rows)

    def logged_cancel(self):
        if not self.cancelled:
            log("cancel")
        cancel(self)

    Runner.run_batch = gated_run_batch
    Request.cancel = logged_cancel


if _GATE:
    _install(_GATE)
