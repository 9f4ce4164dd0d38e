"""The threads the runtime starts (the backend's thread pools, the scheduler, the tokenizer's pool) block
asynchronous signals, so a Ctrl-C reaches the main thread: a SIGINT taken by a worker thread left
`refusion-run chat` waiting in readline's select until the next key."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from refusion.runtime.core.signals import main_thread_signals
from refusion.runtime.generator import Generator

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
