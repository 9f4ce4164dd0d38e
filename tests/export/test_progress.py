"""Progress events (export/progress.py): what the exporter, validation and the TensorRT phase tracker
report, and how the CLIs show them (plain lines off a terminal, bars on one, nothing with --quiet)."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from refusion.engines.build import PhaseTracker
from refusion.export.exporter import export_onnx
from refusion.export.progress import ProgressEvent, line, tick
from refusion.models import EMBEDDED_MODEL
from refusion.tools import cli_common
from refusion.tools.export_cli import cli

REPO = Path(__file__).resolve().parents[2]


class Events(list):
    """A progress callback that takes ticks too (as a bar renderer does)."""

    ticks = True

    def __call__(self, event: ProgressEvent) -> None:
        self.append(event)

    def stage(self, name: str) -> list[ProgressEvent]:
        return [e for e in self if e.stage == name]


def test_an_event_is_its_line():
    event = ProgressEvent("weights 3/4 written", stage="weights", done=30, total=40, unit="B")
    assert event == "weights 3/4 written" and event.startswith("weights") and event.message == "weights 3/4 written"
    assert (event.stage, event.done, event.total, event.unit, event.finished) == ("weights", 30, 40, "B", False)
    assert ProgressEvent("", stage="s", done=2, total=2).finished and not ProgressEvent("text").finished
    plain: list[str] = []
    line(plain.append, "a line", "s", 1, 2)
    tick(plain.append, "s", 1, 2)  # a plain callable gets no ticks
    assert plain == ["a line"] and isinstance(plain[0], ProgressEvent)


@pytest.fixture(scope="module")
def reported(tmp_path_factory) -> tuple[Path, Events]:
    events = Events()
    out = export_onnx(EMBEDDED_MODEL, tmp_path_factory.mktemp("progress") / "onnx", progress=events)
    return out, events


def test_export_reports_weights_by_bytes(reported):
    out, events = reported
    assert all(isinstance(e, ProgressEvent) for e in events)  # structured, also what publish.py reports
    weights = events.stage("weights")
    tensors = json.loads((out / "refusion.json").read_text())["weights"]["tensors"]
    assert len(weights) == len(tensors) == 47  # one event per tensor
    tensor_bytes = sum(t["nbytes"] for t in tensors.values())
    assert {(e.total, e.unit) for e in weights} == {(tensor_bytes, "B")}
    assert [e.done for e in weights] == sorted({e.done for e in weights}) and weights[-1].finished
    lines = [e for e in weights if e]
    assert lines[-1].startswith("weights 47/47 written") and len(lines) == 12  # every 10 %, as before
    assert all(e.done > 0 for e in weights)


def test_validation_reports_its_forwards(reported):
    _, events = reported
    forwards = events.stage("validation")
    report = next(e for e in events if "forwards of" in e)
    per_runner = int(report.split("(float32, ")[1].split(" forwards")[0])
    assert [e.done for e in forwards] == list(range(1, 2 * per_runner + 1))
    assert {(e.total, e.unit) for e in forwards} == {(2 * per_runner, "forward")}
    assert [str(e) for e in forwards if e] == [f"validation: onnxruntime ran {per_runner} forwards",
                                              f"validation: torch ran {per_runner} forwards"]


def test_a_plain_callable_gets_the_lines_only(tmp_path):
    messages: list[str] = []
    export_onnx(EMBEDDED_MODEL, tmp_path / "onnx", validate=False, progress=messages.append)
    assert all(messages) and sum(m.startswith("weights ") for m in messages) == 12


def test_phase_tracker_ticks_every_step_for_bars():
    events = Events()
    tracker = PhaseTracker(events, interval=3600)
    tracker.start("Building engine", None, 2)
    tracker.start("Tactic selection", "Building engine", 3)
    for step in range(3):
        tracker.step("Tactic selection", step)
    tracker.finish("Tactic selection")
    tracker.step("Building engine", 0)
    tracker.finish("Building engine")
    tactics = events.stage("Tactic selection")
    assert [(e.done, e.total, bool(e)) for e in tactics] == [(0, 3, True), (1, 3, False), (2, 3, False),
                                                             (3, 3, False), (3, 3, False)]
    building = events.stage("Building engine")
    assert [(e.done, e.total) for e in building] == [(0, 2), (1, 2), (2, 2)]
    assert building[-1].startswith("Building engine done in") and building[-1].finished


# -- the CLIs' reporter --------------------------------------------------------------------------

class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_reporter_draws_bars_on_a_terminal_and_prints_the_rest(monkeypatch):
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    reporter = cli_common.Reporter()
    assert reporter.ticks
    line(reporter, "checkpoint x: 4 layers")
    line(reporter, "weights 1/4 written", "weights", 100, 400, "B")
    tick(reporter, "weights", 300, 400, "B")
    assert list(reporter._bars) == ["weights"]
    line(reporter, "weights 4/4 written (0 MiB)", "weights", 400, 400, "B")
    assert not reporter._bars
    text = screen.getvalue()
    assert "checkpoint x: 4 layers\n" in text and "weights 4/4 written (0 MiB)\n" in text
    assert "weights 1/4 written" not in text  # the bar stood for it
    assert "weights:" in text and "%|" in text and "B/s" in text  # a bar with its rate
    line(reporter, "validation: onnxruntime ran 2 forwards", "validation", 2, 4, "forward")
    reporter.close()  # a failed command takes its bars down
    assert not reporter._bars


def test_reporter_writes_plain_lines_elsewhere(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    reporter = cli_common.Reporter()
    assert not reporter.ticks
    line(reporter, "weights 1/4 written", "weights", 100, 400, "B")
    tick(reporter, "weights", 300, 400, "B")
    reporter("plain text")
    assert log.getvalue() == "weights 1/4 written\nplain text\n"


def test_quiet_leaves_only_results(reported, tmp_path):
    def invoke(*args):
        return CliRunner().invoke(cli, [str(a) for a in args])

    for loud, quiet in ((invoke("onnx", EMBEDDED_MODEL, "-o", tmp_path / "out", "--no-validate"),
                         invoke("onnx", EMBEDDED_MODEL, "-o", tmp_path / "out", "--no-validate", "--force", "--quiet")),
                        (invoke("check", reported[0]), invoke("check", reported[0], "-q"))):
        assert loud.exit_code == quiet.exit_code == 0, quiet.output
        assert loud.stderr and quiet.stderr == ""
        assert quiet.stdout == loud.stdout


def test_build_takes_quiet():
    assert "--quiet" in CliRunner().invoke(cli, ["build", "--help"]).stdout


# -- a real terminal -------------------------------------------------------------------------------

def run_in_terminal(args: list[str], timeout: float = 120) -> tuple[int, str]:
    """Run `python -m refusion.tools.export_cli ARGS` with stderr and stdout on a 100-column pseudo-terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "refusion.tools.export_cli", *args], stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # a tiny model: threads only contend
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout  # a hang guard: the loop ends when the child closes the terminal
    while time.monotonic() < deadline:
        if select.select([master], [], [], 0.5)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(timeout=10), out.decode(errors="replace")


def test_bars_with_rate_on_a_terminal(tmp_path):
    code, screen = run_in_terminal(["onnx", str(EMBEDDED_MODEL), "-o", str(tmp_path / "out")])
    assert code == 0, screen
    assert "\rweights:" in screen and "B/s]" in screen  # the bytes bar, with its rate
    assert "\rvalidation:" in screen and "forward/s]" in screen
    assert "weights 47/47 written" in screen and "result: PASS" in screen and "done in" in screen
    assert "weights 4/47 written" not in screen  # shown by the bar, not as a line
