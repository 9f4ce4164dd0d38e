"""Publishing a finished export directory so that no interruption leaves a broken one.

The export is written into a hidden staging directory beside the output,
`.NAME.partial-PID-XXXX`. Only when it is complete and validated is its manifest renamed
to refusion.json (a staging directory without one never loads), and then the directory
takes the output's name:
- no old export: one rename;
- with `--force`: the two directories are exchanged atomically (Linux renameat2
  RENAME_EXCHANGE), so `NAME` is the old export or the new one at every instant; the old
  one, now at the staging name, is deleted last. Where the filesystem cannot exchange, the
  old export is first renamed to `.NAME.old-PID-XXXX`, which is where it is if a crash hits
  between the two renames (an error or a caught signal there puts it back).
SIGTERM and SIGHUP clean up like Ctrl-C. A SIGKILL cannot be caught: the next export to the
same output removes what a dead run left, and restores its output first if a crash took it.
One export at a time writes an output: it holds a lock on `.NAME.lock` beside it (flock, which
the kernel lets go when the process ends), and another is refused while it does.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import MANIFEST_NAME

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


@contextmanager
def exclusive(output: Path) -> Iterator[None]:
    """While this block runs, no other export may write `output` (its parent must exist): a second one is
    refused at once, naming the process that writes it."""
    lock = output.with_name(f".{output.name}.lock")
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RefusionError(f"cannot write to {output.parent} ({e.strerror}); choose a writable --output.") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RefusionError(f"another export (pid {holder}) is writing {output} now; wait for it to end, or "
                                "choose another --output.") from None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # the holder removed this file as it let go: lock the one there now
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        os.unlink(lock)  # under the lock: whoever opened the old file sees it gone and opens afresh
        os.close(fd)


def make_staging(output: Path) -> Path:
    """An empty hidden directory beside `output`, named after it and this process."""
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-{os.getpid()}-", dir=output.parent))
    staging.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700; publish with the permissions mkdir would give
    return staging


def leftovers(output: Path) -> list[Path]:
    """Staging and moved-aside directories of `output` whose process is gone."""
    # the whole name: a staging directory of another output named like `NAME.partial-PID-x` is not one of these
    pattern = re.compile(rf"^\.{re.escape(output.name)}\.(partial|old)-(\d+)-[a-z0-9_]+$")
    found = []
    for entry in output.parent.iterdir() if output.parent.is_dir() else ():
        match = pattern.match(entry.name)
        if match and entry.is_dir() and not entry.is_symlink() and not _alive(int(match[2])):
            found.append(entry)
    return sorted(found)


def clean_leftovers(output: Path, report: Callable[[str], None], complete_marker: str = MANIFEST_NAME) -> None:
    """Remove what killed runs left for `output`. If `output` itself is gone, first put back the
    directory a run was publishing (complete: it holds `complete_marker`, the file written last)
    or the old one it moved aside."""
    left = leftovers(output)
    if not output.exists():
        complete = [p for p in left if (p / complete_marker).is_file()]
        # a finished new export first, then an old one moved aside
        complete.sort(key=lambda p: ".old-" in p.name)
        if complete:
            complete[0].rename(output)
            report(f"restored {output} from {complete[0].name}, left by an interrupted run")
            left.remove(complete[0])
    for path in left:
        shutil.rmtree(path, ignore_errors=True)
        report(f"removed {path.name}, left by an interrupted run")


def publish(staging: Path, output: Path) -> None:
    """Give the finished `staging` directory the name `output`, replacing an old export there."""
    if not output.exists():
        staging.rename(output)
        return
    if _exchange(staging, output):
        shutil.rmtree(staging)  # now the old export
        return
    # the staging name with only its own ".partial-" replaced: `output.name` may contain one too
    old = staging.with_name(f".{output.name}.old-" + staging.name.removeprefix(f".{output.name}.partial-"))
    try:
        output.rename(old)
        staging.rename(output)
    except BaseException:  # an error, Ctrl-C or SIGTERM between the renames: put the old export back
        if old.exists() and not output.exists():
            old.rename(output)
        raise
    shutil.rmtree(old)


@contextmanager
def cleanup_on_signals() -> Iterator[None]:
    """Inside this block SIGTERM and SIGHUP raise SystemExit(128 + signal), so `finally` and
    `except BaseException` clean up as they do for Ctrl-C. Signals a caller ignores stay ignored;
    outside the main thread (where Python cannot set handlers) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directory entries; False where the OS or filesystem cannot."""
    rename = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if rename is None:
        return False
    return rename(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask
