"""Progress of the long steps (export, validation, engine builds, benchmarks) as events that a
plain log and a progress bar both read.

A `ProgressEvent` is its log line (a `str`), so any callable that takes text serves as a progress
callback, and it also carries `stage`, `done`, `total` and `unit` for a bar:

    export_onnx(ckpt, out, progress=print)                     # the lines, as a log shows them
    def show(event): bar(event.stage, event.done, event.total)  # the same events, as numbers

Events with text are lines worth a log, and producers keep them few (every 10 % of the weights,
a TensorRT phase every 10 s). Between them come *ticks*, events with no text that only a bar
wants (every tensor, every forward); a callback receives them when it has a true `ticks`
attribute (`show.ticks = True`). An event whose `done` reaches `total` ends its stage.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str], None]  # called with ProgressEvents


class ProgressEvent(str):
    """One report: the text a log prints ("" for a tick) and where `stage` stands, `done` of
    `total` (None: unknown) in `unit` ("B", "forward", "step", "run"; "" for items)."""

    stage: str
    done: float
    total: float | None
    unit: str

    def __new__(cls, text: str = "", *, stage: str = "", done: float = 0, total: float | None = None,
                unit: str = "") -> ProgressEvent:
        event = super().__new__(cls, text)
        event.stage, event.done, event.total, event.unit = stage, done, total, unit
        return event

    @property
    def message(self) -> str:
        return str(self)

    @property
    def finished(self) -> bool:
        """The stage is complete."""
        return self.total is not None and self.done >= self.total

    def __repr__(self) -> str:
        return (f"ProgressEvent({self.message!r}, stage={self.stage!r}, done={self.done!r}, total={self.total!r}, "
                f"unit={self.unit!r})")


def silent(event: str) -> None:
    """The default callback: reports nothing."""


def line(progress: Progress, text: str, stage: str = "", done: float = 0, total: float | None = None,
         unit: str = "") -> None:
    """Report a line (every callback receives it)."""
    progress(ProgressEvent(text, stage=stage, done=done, total=total, unit=unit))


def tick(progress: Progress, stage: str, done: float, total: float | None, unit: str = "") -> None:
    """Report a tick, to a callback that asks for ticks only."""
    if getattr(progress, "ticks", False):
        progress(ProgressEvent(stage=stage, done=done, total=total, unit=unit))
