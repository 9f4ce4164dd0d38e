"""Interrupted exports: SIGTERM/SIGHUP clean up, SIGKILL leaves only what never loads and the next
run removes it, and `--force` keeps an export at the output at every instant (export/publish.py).

The killed exports run `refusion-export onnx` in child processes forked from one driver process
(below), which imports torch and the exporter once, so a dozen kills cost seconds, not a torch
import each. Each child patches one function to touch a marker file and sleep when reached; the
test waits for the marker (never on a bare sleep), sends the signal and gets the exit status.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from refusion.export import publish as publish_module
from refusion.export.exporter import export_onnx
from refusion.export.publish import clean_leftovers, cleanup_on_signals
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import MANIFEST_NAME, PENDING_NAME, ExportManifest

pytestmark = pytest.mark.slow  # exports killed by signals, in child processes
ROOT = Path(__file__).resolve().parents[2]
INTERRUPTED = ", left by an interrupted run"

# Forks one child per request (a JSON line on stdin) and answers {"pid": N}, then {"status": S}
# once the child is gone (S: exit code, or -signal). The child sends its stdout/stderr to
# request["log"], patches the function named by request["stage"] to touch request["marker"] and
# sleep when reached, and runs refusion-export with request["argv"].
DRIVER = r'''
import json, os, pathlib, signal, sys, time, traceback

for sig in (signal.SIGTERM, signal.SIGHUP):  # a nohup'd pytest must not hand down an ignored SIGHUP
    signal.signal(sig, signal.SIG_DFL)

import torch  # noqa: F401 - the children use it; imported once here
import refusion.export.exporter as exporter
import refusion.export.publish as publish
import refusion.export.validate as validate
import refusion.tools.export_cli as export_cli
from refusion.export.checkpoint import Checkpoint
from refusion.export.weights_file import WeightsWriter


def patch(stage, marker, output):
    def pause():
        marker.touch()
        # short sleeps: a signal that lands on another thread (torch's pool) still runs the
        # Python handler within 10 ms; the 120 s in all only guard against a hang (the test signals it)
        for _ in range(12000):
            time.sleep(0.01)
        os._exit(99)  # never signalled

    if stage == "load":
        open_ = Checkpoint.open
        def opening(*args, **kwargs):
            pause()
            return open_(*args, **kwargs)
        Checkpoint.open = staticmethod(opening)
    elif stage == "weights":
        add = WeightsWriter.add
        def adding(self, name, tensor):
            init = add(self, name, tensor)
            if len(self.initializers) == 3:
                self._file.flush()
                pause()
            return init
        WeightsWriter.add = adding
    elif stage == "validate":
        def validating(*args, **kwargs):
            pause()
        validate.validate_export = validating
    elif stage in ("before-publish", "after-publish"):
        publish_ = exporter.publish
        def publishing(staging, out):
            if stage == "before-publish":
                pause()
            publish_(staging, out)
            pause()
        exporter.publish = publishing
    elif stage == "after-exchange":
        exchange = publish._exchange
        def exchanging(a, b):
            done = exchange(a, b)
            if done:
                pause()
            return done
        publish._exchange = exchanging
    elif stage == "between-renames":  # a filesystem without RENAME_EXCHANGE
        publish._exchange = lambda a, b: False
        rename = pathlib.Path.rename
        def renaming(self, target):
            moved = rename(self, target)
            if self == output:  # the old export was just moved aside; the new one is not in place yet
                pause()
            return moved
        pathlib.Path.rename = renaming
    else:
        raise ValueError(stage)


for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            patch(request["stage"], pathlib.Path(request["marker"]), pathlib.Path(request["output"]))
            sys.argv = ["refusion-export", *request["argv"]]
            export_cli.main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    print(json.dumps({"status": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}), flush=True)
'''


class Driver:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.log = workdir / "driver.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=ROOT, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, text=True)
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.runs = 0

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.answers.put(json.loads(line))
        self.answers.put(None)

    def answer(self, key: str, timeout: float) -> int:
        try:
            answer = self.answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no {key} from the driver in {timeout} s") from None
        assert answer is not None, f"the driver died: {self.log.read_text()}"
        return answer[key]

    def start(self, stage: str, output: Path, *args: object) -> Child:
        self.runs += 1
        run = self.workdir / f"run{self.runs}"
        request = {"stage": stage, "output": str(output), "argv": ["onnx", *map(str, args), "--output", str(output)],
                   "marker": str(run) + ".marker", "log": str(run) + ".log"}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return Child(self, self.answer("pid", 120), Path(request["marker"]), Path(request["log"]))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


class Child:
    """One forked `refusion-export onnx`; use it as a context manager so that a failed test never
    leaves it sleeping (the driver waits for each child before the next)."""

    def __init__(self, driver: Driver, pid: int, marker: Path, log: Path):
        self.driver, self.pid, self.marker, self.log = driver, pid, marker, log
        self.status: int | None = None

    def wait_marker(self, each=lambda: None, timeout: float = 60) -> None:
        """Until the child is at its stage (the marker exists): a condition, polled; `timeout` only guards
        against a hang."""
        deadline = time.monotonic() + timeout
        while not self.marker.exists():
            each()
            if not self.driver.answers.empty():  # it ended without reaching the stage
                self.status = self.driver.answer("status", 1)
                raise AssertionError(f"exited {self.status} before the stage:\n{self.log.read_text()}")
            assert time.monotonic() < deadline, f"stage not reached in {timeout} s:\n{self.log.read_text()}"
            time.sleep(0.005)
        each()

    def kill(self, sig: int) -> int:
        os.kill(self.pid, sig)
        self.status = self.driver.answer("status", 30)
        return self.status

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc) -> None:
        if self.status is None:
            os.kill(self.pid, signal.SIGKILL)
            self.status = self.driver.answer("status", 60)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    driver = Driver(tmp_path_factory.mktemp("driver"))
    yield driver
    driver.close()


@pytest.fixture(scope="module")
def ckpt(store) -> Path:
    return store.checkpoint("gqa2")


def aside(out: Path) -> list[Path]:
    """Everything an export to `out` puts beside it: staging and moved-aside directories."""
    prefixes = (f".{out.name}.partial-", f".{out.name}.old-")
    return sorted(p for p in out.parent.iterdir() if p.name.startswith(prefixes))


def loads(path: Path) -> str:
    """The dtype of the complete, intact export at `path` (sizes and sha256 checked)."""
    return ExportManifest.load(path, verify=True).dtype


def rerun(ckpt: Path, out: Path, **kwargs) -> list[str]:
    """The next export to `out`, in process; returns what it reported about leftovers."""
    messages: list[str] = []
    export_onnx(ckpt, out, validate=False, progress=messages.append, **kwargs)
    assert loads(out) == "float32"
    assert aside(out) == [], "the re-run left something beside the output"
    return [m for m in messages if m.endswith(INTERRUPTED)]


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# -- 1. signals at each stage of a fresh export --------------------------------------------------

# what a SIGKILL at each stage leaves, and why it never loads
LEFT_BY_SIGKILL = {"load": None, "weights": "refusion.json is missing", "validate": "is an unfinished export"}


@pytest.mark.parametrize("stage, sig", [
    ("load", signal.SIGTERM), ("load", signal.SIGKILL),
    ("weights", signal.SIGTERM), ("weights", signal.SIGHUP), ("weights", signal.SIGKILL),
    ("validate", signal.SIGTERM), ("validate", signal.SIGKILL),
], ids=lambda v: v.name if isinstance(v, signal.Signals) else v)
def test_killed_export_publishes_nothing_and_the_next_run_cleans_up(driver, ckpt, tmp_path, stage, sig):
    out = tmp_path / "out"
    with driver.start(stage, out, ckpt) as child:
        child.wait_marker()
        staged = aside(out)
        assert len(staged) == (0 if stage == "load" else 1), staged  # the staging dir is made after loading
        status = child.kill(sig)
    log = child.log.read_text()
    assert not out.exists()
    with pytest.raises(RefusionError, match="is not a directory"):
        ExportManifest.load(out)
    left = aside(out)
    if sig == signal.SIGKILL:
        assert status == -signal.SIGKILL
        if LEFT_BY_SIGKILL[stage] is None:
            assert left == []
        else:
            assert [p.name for p in left] == [p.name for p in staged]
            assert left[0].name.startswith(f".out.partial-{child.pid}-")
            assert (left[0] / PENDING_NAME).is_file() == (stage == "validate")
            with pytest.raises(RefusionError, match=LEFT_BY_SIGKILL[stage]):
                ExportManifest.load(left[0])
    else:
        # caught (128 + signal) once the export has something to clean up; before that the
        # default action may end it (-signal); a shell sees 128 + signal either way
        assert status == 128 + sig or (stage == "load" and status == -sig), (status, log)
        assert left == [], "a caught signal left the staging directory"
        assert "Traceback" not in log, log
    assert rerun(ckpt, out) == [f"removed {p.name}{INTERRUPTED}" for p in left]


# -- 2. --force over an existing export --------------------------------------------------------

@pytest.mark.parametrize("stage", ["before-publish", "after-exchange", "after-publish"])
def test_force_killed_around_publish_keeps_an_export_at_the_output(driver, ckpt, tmp_path, stage):
    out = export_onnx(ckpt, tmp_path / "out", dtype="fp16", validate=False)  # the old export
    at_out = "float16" if stage == "before-publish" else "float32"

    def is_export() -> None:
        assert (out / MANIFEST_NAME).is_file(), f"{out} is not a complete export at this instant"

    with driver.start(stage, out, ckpt, "--force", "--no-validate") as child:
        child.wait_marker(each=is_export)
        assert loads(out) == at_out
        assert child.kill(signal.SIGKILL) == -signal.SIGKILL
    assert loads(out) == at_out
    left = aside(out)
    if stage == "after-publish":
        assert left == []
    else:
        # the new export before publish, or the old one after the exchange, at the staging name
        assert [p.name[:len(f".out.partial-{child.pid}-")] for p in left] == [f".out.partial-{child.pid}-"]
        assert loads(left[0]) == ("float32" if stage == "before-publish" else "float16")
    assert rerun(ckpt, out, force=True) == [f"removed {p.name}{INTERRUPTED}" for p in left]


@pytest.mark.parametrize("name, sig", [("out", signal.SIGKILL), ("out", signal.SIGTERM),
                                       ("out.partial-1", signal.SIGKILL)], ids=["kill", "term", "kill-odd-name"])
def test_force_without_exchange_interrupted_between_the_renames(driver, ckpt, tmp_path, monkeypatch, name, sig):
    out = export_onnx(ckpt, tmp_path / name, dtype="fp16", validate=False)
    with driver.start("between-renames", out, ckpt, "--force", "--no-validate") as child:
        child.wait_marker()
        # the one instant without an output: the old export aside, the new one complete in staging
        assert not out.exists()
        old, new = (f".{name}.old-{child.pid}-", f".{name}.partial-{child.pid}-")
        left = aside(out)
        assert [p.name[:len(prefix)] for p, prefix in zip(left, (old, new))] == [old, new], left
        assert [loads(p) for p in left] == ["float16", "float32"]
        status = child.kill(sig)
    if sig == signal.SIGTERM:
        assert status == 143
        assert loads(out) == "float16", "a caught SIGTERM did not put the old export back"
        assert aside(out) == []
        return
    assert status == -signal.SIGKILL
    assert aside(out) == left
    with pytest.raises(RefusionError, match="is not a directory"):
        ExportManifest.load(out)
    monkeypatch.setattr(publish_module, "_exchange", lambda a, b: False)
    # the complete new export is put back first (then replaced by this run's), the old one removed
    assert rerun(ckpt, out, force=True) == [f"restored {out} from {left[1].name}{INTERRUPTED}",
                                            f"removed {left[0].name}{INTERRUPTED}"]


@pytest.mark.parametrize("failure", ["oserror-in-second-rename", "ctrl-c-after-first-rename"])
def test_force_without_exchange_failing_between_the_renames_puts_the_old_export_back(ckpt, tmp_path, monkeypatch,
                                                                                      failure):
    out = export_onnx(ckpt, tmp_path / "out", dtype="fp16", validate=False)
    rename = Path.rename

    def renaming(self: Path, target) -> Path:
        if failure == "oserror-in-second-rename" and Path(target) == out and ".partial-" in self.name:
            raise OSError(errno.EIO, "simulated I/O error", str(target))
        moved = rename(self, target)
        if failure == "ctrl-c-after-first-rename" and self == out:
            raise KeyboardInterrupt
        return moved

    monkeypatch.setattr(publish_module, "_exchange", lambda a, b: False)
    monkeypatch.setattr(Path, "rename", renaming)
    with pytest.raises(OSError if failure.startswith("oserror") else KeyboardInterrupt):
        export_onnx(ckpt, out, force=True, validate=False)
    monkeypatch.undo()
    # in this (live) process nothing would ever restore a moved-aside export: it must be back now
    assert loads(out) == "float16"
    assert aside(out) == []


def test_next_run_restores_the_old_export_a_crash_left_aside(ckpt, tmp_path):
    src = export_onnx(ckpt, tmp_path / "src", dtype="fp16", validate=False)
    out, pid = tmp_path / "out", dead_pid()
    old = Path(shutil.copytree(src, tmp_path / f".out.old-{pid}-abcd1234"))
    unfinished = Path(shutil.copytree(src, tmp_path / f".out.partial-{pid}-efgh5678"))
    (unfinished / MANIFEST_NAME).rename(unfinished / PENDING_NAME)
    messages: list[str] = []
    clean_leftovers(out, messages.append)
    assert messages == [f"restored {out} from {old.name}{INTERRUPTED}", f"removed {unfinished.name}{INTERRUPTED}"]
    assert loads(out) == "float16"
    assert aside(out) == []


def test_leftovers_of_live_processes_are_kept(ckpt, tmp_path):
    src = export_onnx(ckpt, tmp_path / "src", dtype="fp16", validate=False)
    out = tmp_path / "out"
    mine = tmp_path / f".out.partial-{os.getpid()}-abcd1234"  # this process: alive
    mine.mkdir()
    dead = tmp_path / f".out.partial-{dead_pid()}-efgh5678"
    dead.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        # complete, and the output is missing: still not taken while its process lives
        theirs = Path(shutil.copytree(src, tmp_path / f".out.old-{sleeper.pid}-ijkl9012"))
        messages: list[str] = []
        export_onnx(ckpt, out, validate=False, progress=messages.append)
        assert [m for m in messages if m.endswith(INTERRUPTED)] == [f"removed {dead.name}{INTERRUPTED}"]
        assert aside(out) == sorted([mine, theirs])
        assert loads(theirs) == "float16"
    finally:
        sleeper.kill()
        sleeper.wait()
    messages = []
    export_onnx(ckpt, out, validate=False, force=True, progress=messages.append)
    assert [m for m in messages if m.endswith(INTERRUPTED)] == [f"removed {theirs.name}{INTERRUPTED}"]
    assert aside(out) == [mine]
    assert loads(out) == "float32"


def test_leftovers_of_another_output_are_not_taken(ckpt, tmp_path):
    """`.out.partial-PID-...` is the staging name of `out`, but `out.partial-PID-x` is a legal output
    name too: its staging directory (of a live run) is not a leftover of `out`."""
    other = tmp_path / f".out.partial-{dead_pid()}-x.partial-{os.getpid()}-abcd1234"
    other.mkdir()
    messages: list[str] = []
    export_onnx(ckpt, tmp_path / "out", validate=False, progress=messages.append)
    assert [m for m in messages if m.endswith(INTERRUPTED)] == []
    assert other.is_dir()


# -- 3. signal handlers ------------------------------------------------------------------------

def _caller_handler(signum, frame) -> None:
    raise AssertionError("the caller's handler ran during the export")


@pytest.fixture
def restore_handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("term, hup", [(signal.SIG_DFL, signal.SIG_DFL), (_caller_handler, signal.SIG_IGN)],
                         ids=["defaults", "own-term-ignored-hup"])
@pytest.mark.parametrize("outcome", ["ok", "ctrl-c"])
def test_signal_handlers_are_restored(ckpt, tmp_path, restore_handlers, term, hup, outcome):
    signal.signal(signal.SIGTERM, term)
    signal.signal(signal.SIGHUP, hup)
    during = {}

    def progress(message: str) -> None:
        if message.startswith("weights") and not during:
            during.update(term=signal.getsignal(signal.SIGTERM), hup=signal.getsignal(signal.SIGHUP))
            if during["hup"] is signal.SIG_IGN:
                os.kill(os.getpid(), signal.SIGHUP)  # the caller ignores it: the export carries on
            if outcome == "ctrl-c":
                raise KeyboardInterrupt

    out = tmp_path / "out"
    if outcome == "ok":
        export_onnx(ckpt, out, validate=False, progress=progress)
        assert loads(out) == "float32"
    else:
        with pytest.raises(KeyboardInterrupt):
            export_onnx(ckpt, out, validate=False, progress=progress)
        assert not out.exists()
    assert aside(out) == []
    assert callable(during["term"]) and during["term"] is not term, "no SIGTERM handler during the export"
    if hup is signal.SIG_IGN:
        assert during["hup"] is signal.SIG_IGN, "the caller's SIG_IGN for SIGHUP was overridden"
    else:
        assert callable(during["hup"]), "no SIGHUP handler during the export"
    assert signal.getsignal(signal.SIGTERM) is term
    assert signal.getsignal(signal.SIGHUP) is hup


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_signal_to_this_process_cleans_up_and_restores_handlers(ckpt, tmp_path, restore_handlers, sig):
    signal.signal(sig, _caller_handler)

    def progress(message: str) -> None:
        if message.startswith("weights 25/25"):
            handler = signal.getsignal(sig)
            assert callable(handler) and handler is not _caller_handler, "no handler of the exporter's"
            os.kill(os.getpid(), sig)
            # the handler runs in the main thread, whichever thread got the signal, within a short sleep
            # (a long one would not wake); the 10 s in all only guard against a hang
            for _ in range(1000):
                time.sleep(0.01)
            raise AssertionError(f"{sig.name} did not interrupt the export")

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        export_onnx(ckpt, out, validate=False, progress=progress)
    assert info.value.code == 128 + sig
    assert not out.exists() and aside(out) == []
    assert signal.getsignal(sig) is _caller_handler


def test_export_in_a_worker_thread_leaves_handlers_alone(ckpt, tmp_path):
    before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP))
    seen, failed = [], []

    def work() -> None:
        try:
            export_onnx(ckpt, tmp_path / "out", validate=False,
                        progress=lambda m: seen.append((signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP))))
            with cleanup_on_signals():
                seen.append((signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)))
        except BaseException as e:  # noqa: BLE001 - reported below
            failed.append(e)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(60)
    assert not worker.is_alive() and not failed, failed
    assert seen and set(seen) == {before}
    assert loads(tmp_path / "out") == "float32"
