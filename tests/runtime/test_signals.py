"""The threads the runtime starts (the backend's thread pools, the scheduler, the tokenizer's pool) block
asynchronous signals, so a Ctrl-C reaches the main thread: a SIGINT taken by a worker thread left
`refusion-run chat` waiting in readline's select until the next key."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from refusion.runtime.core.signals import main_thread_signals
from refusion.runtime.generator import Generator
from tests.helpers import REPO

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir() or not hasattr(signal, "pthread_sigmask"),
                                reason="per-thread signal masks, read from Linux's /proc")


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _blocks_sigint(tid: str) -> bool:
    status = Path(f"/proc/self/task/{tid}/status").read_text()
    blocked = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
    return bool(blocked >> (signal.SIGINT - 1) & 1)


def test_the_threads_the_runtime_starts_leave_sigint_to_the_main_thread(tiny_export):
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    before = _threads()
    with Generator.from_dir(tiny_export, backend="ort-cpu", threads=2) as gen:  # 2: onnxruntime starts a worker
        gen.generate("sort: 5 2 8 2", chat=True, gen_length=16)
        started = _threads() - before
        assert len(started) >= 2, started  # onnxruntime's worker and the scheduler at least
        assert [t for t in started if not _blocks_sigint(t)] == []
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask  # the caller's own mask is as it was


def test_the_callers_mask_comes_back_after_an_error():
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with pytest.raises(RuntimeError), main_thread_signals():
        assert signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        raise RuntimeError
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
    assert signal.SIGSEGV not in mask  # a crash is still reported by the thread that faults


_POOL = """
import os, sys
from refusion.runtime.tokenizer import Tokenizer
from tests.runtime.test_signals import _blocks_sigint, _threads
tok = Tokenizer.from_dir(sys.argv[1])
before = _threads()
tok.encode("sort: 5 2 8 2")
pool = _threads() - before
tok.encode("reverse: a b c")
print(len(pool), [t for t in pool if not _blocks_sigint(t)], len(_threads() - before - pool))
"""


def test_the_tokenizers_pool_starts_on_the_first_encode_blocking_sigint_and_later_encodes_start_no_thread():
    """Only the first encode runs inside main_thread_signals (the mask costs 0.1 ms a request): in a fresh process
    it starts the tokenizers library's pool, whose threads block SIGINT, and no later encode starts one."""
    out = subprocess.run([sys.executable, "-c", _POOL, str(REPO / "models" / "refusion-tiny")], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split(maxsplit=1)
    assert int(out[0]) >= 1 and out[1].strip() == "[] 0", out
