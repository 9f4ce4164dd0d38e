"""Processes and files that must not outlive `refusion-run serve`: tritonserver dies with the launcher
(PR_SET_PDEATHSIG), the Python-backend stubs are found and watched, and what a killed launcher left (its work
directory, its shared-memory regions) is removed by the next start.

A work directory is `refusion-triton-XXXX` in the temp dir, holding `owner`: the launcher's pid and the start
time the kernel gives that pid, so a pid reused by another process does not pass for the launcher.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

WORKDIR_PREFIX = "refusion-triton-"
OWNER_FILE = "owner"
SHM = Path("/dev/shm")
_STUB_NAME = "triton_python_b"  # the kernel keeps 15 characters of triton_python_backend_stub


def exec_with_parent(command: list[str]) -> list[str]:
    """`command`, run so that it is SIGKILLed when this process (the thread that starts it, the kernel's rule)
    ends: a bare Python (-S: no site) sets PR_SET_PDEATHSIG, which survives exec, then becomes `command`. Not
    Popen's preexec_fn: that forks the whole process, and gRPC's fork handlers abort the child."""
    return [sys.executable, "-S", "-c", _PDEATHSIG_EXEC, str(os.getpid()), *command]


# The parent may be gone before prctl ran: then exit rather than live on as an orphan.
_PDEATHSIG_EXEC = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0); "
                   "os.getppid() == int(sys.argv[1]) or os._exit(1); os.execv(sys.argv[2], sys.argv[2:])")


def guard_stubs(stub_pids: list[int]) -> tuple[subprocess.Popen[bytes], int]:
    """A process that SIGKILLs the stubs if this process ends without standing it down (a SIGKILL of the
    launcher: pdeathsig ends tritonserver then, and its stubs, re-parented, would live on), and the pipe end
    that stands it down (write a byte, close it). Not a thread of the stub: a stub thread inside a call to a
    tritonserver that dies never returns from it, and a thread of its own did not end the stub either (2 starts
    in 8: the GIL held in that call, we believe, not proven)."""
    read, write = os.pipe()
    try:
        guard = subprocess.Popen([sys.executable, "-S", "-c", _GUARD_EXEC, str(read), *map(str, stub_pids)],
                                 pass_fds=(read,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
    finally:
        os.close(read)
    return guard, write


# The pipe's end of file (no byte) means the launcher is gone: only then are the stubs killed.
_GUARD_EXEC = ("import os, signal, sys\n"
               "if os.read(int(sys.argv[1]), 1) == b'':\n"
               "    for p in map(int, sys.argv[2:]):\n"
               "        try: os.kill(p, signal.SIGKILL)\n"
               "        except ProcessLookupError: pass")


def start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), or None when no such process lives."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return None if fields[0] in ("Z", "X") else fields[19]


def claim(workdir: Path) -> None:
    """Record this process as the owner of `workdir`."""
    pid = os.getpid()
    (workdir / OWNER_FILE).write_text(f"{pid} {start_time(pid)}")


def _owner_alive(workdir: Path) -> bool:
    try:
        pid, started = (workdir / OWNER_FILE).read_text().split()
        return start_time(int(pid)) == started
    except (OSError, ValueError):
        return True  # no owner file yet (being created) or not ours: leave it


def remove_stale(tempdir: Path | None = None) -> list[Path]:
    """Work directories, and their shared-memory regions, of launchers no longer alive; those removed."""
    removed = []
    for workdir in Path(tempdir or tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*"):
        if not workdir.is_dir() or workdir.owner() != _user() or _owner_alive(workdir):
            continue
        remove_regions(workdir.name)
        shutil.rmtree(workdir, ignore_errors=True)
        removed.append(workdir)
    return removed


def remove_regions(prefix: str) -> None:
    """The shared-memory regions Triton's Python backend made under `prefix` (its shm-region-prefix-name)."""
    for region in SHM.glob(f"{prefix}-*"):
        region.unlink(missing_ok=True)


def stubs(server_pid: int) -> list[int]:
    """The Python-backend stub processes tritonserver `server_pid` runs."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            lines = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if lines.get("PPid", "").strip() == str(server_pid) and lines.get("Name", "").strip() == _STUB_NAME:
            found.append(int(status.parent.name))
    return sorted(found)


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name
