"""A gate on the served model's forwards (the hook in gate_hook/sitecustomize.py, which runs in the
Python-backend stub): a test closes it, lets exactly the forwards it wants through, and sees each forward
that waits and each request cancelled, so what it checks does not depend on how fast the machine decodes.

The stub runs an isolated Python (no PYTHONPATH), which finds its venv through the PATH the launcher gives
it: the directory of the serving Python first. So the gate makes a venv of its own over the test's venv
(its site-packages: the hook, and a .pth that adds the test venv's), and the server under test runs from
that Python: `python` for `refusion-run serve` as a process, `in_environment()` for a TritonServer started
in the test's process.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

HOOK = Path(__file__).parent / "gate_hook" / "sitecustomize.py"


class Gate:
    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        os.mkfifo(directory / "release")
        (directory / "events").touch()
        self._fifo = os.open(directory / "release", os.O_RDWR)
        self.python = self._venv(directory / "venv")  # the hook starts with the gate open: the model loads

    @staticmethod
    def _venv(root: Path) -> Path:
        """A venv over this one, with the hook: its python (a link to this one; pyvenv.cfg makes it a venv)."""
        packages = root / Path(sysconfig.get_path("purelib")).relative_to(sys.prefix)
        packages.mkdir(parents=True)
        (root / "pyvenv.cfg").write_text((Path(sys.prefix) / "pyvenv.cfg").read_text())
        (packages / "sitecustomize.py").write_text(HOOK.read_text())
        (packages / "over.pth").write_text(f"import site; site.addsitedir({site.getsitepackages()[0]!r})\n")
        (root / "bin").mkdir()
        python = root / "bin" / "python3"
        python.symlink_to(sys.executable)
        return python

    @property
    def env(self) -> dict[str, str]:
        """What the server's environment needs for the hook to act."""
        return {"REFUSION_TEST_GATE": str(self.directory)}

    @contextmanager
    def in_environment(self) -> Iterator[None]:
        """A TritonServer started in here runs its stub on the gate's venv."""
        with pytest.MonkeyPatch.context() as patch:
            for name, value in self.env.items():
                patch.setenv(name, value)
            patch.setattr(sys, "executable", str(self.python))
            yield

    def open(self) -> None:
        """Forwards run freely (what is waiting runs at once)."""
        os.write(self._fifo, b"o")

    def close(self) -> None:
        """Forwards from the next one on wait to be released."""
        os.write(self._fifo, b"c")

    def release(self, n: int = 1) -> None:
        os.write(self._fifo, b"1" * n)

    def count(self, event: str) -> int:
        return (self.directory / "events").read_text().split().count(event)

    def wait_for(self, event: str, count: int, timeout: float = 120) -> None:
        """Until `event` ("held", "cancel") has happened `count` times in all; `timeout` only fails a test that
        would otherwise hang (nothing here waits for a guessed duration)."""
        deadline = time.monotonic() + timeout
        while self.count(event) < count:
            assert time.monotonic() < deadline, f"{count} {event!r} events expected, {self.count(event)} seen"
            time.sleep(0.01)

    def hold(self) -> int:
        """Close the gate; the count of forwards held so far (each forward that waits adds one, as it starts
        waiting: `wait_for("held", n + 1)` returns once a forward is held; after `release(k)`,
        `wait_for("held", n + 1 + k)` once k more have run and the next is held)."""
        self.close()
        return self.count("held")
