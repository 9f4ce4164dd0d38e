"""What `refusion-run serve` passes to the Triton model: a few strings in config.pbtxt's parameters,
read back in the backend's process."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.prefix_cache import DEFAULT_MB, check_prefix_cache_mb


@dataclass(frozen=True)
class ServeSettings:
    model_dir: str
    backend: str = "auto"
    threads: int | None = None
    max_requests: int | None = None  # running at once, a KV region each (None: the runner's default)
    max_batch: int | None = None  # forwards packed per call (None: the runner's default)
    max_queue: int = 64  # waiting beyond the running ones; more are rejected at once
    prefix_cache_mb: float = DEFAULT_MB  # the Generator's prefix cache (0: off)
    drain_file: str | None = None  # the launcher writes the drain's deadline here on SIGTERM (serve/triton/launcher.py)

    def __post_init__(self) -> None:
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise RefusionError(f"max_queue={self.max_queue!r} (--max-queue) must be an integer >= 0.")
        check_prefix_cache_mb(self.prefix_cache_mb)

    def to_parameters(self) -> dict[str, str]:
        return {f.name: str(getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None}

    @staticmethod
    def from_parameters(parameters: Mapping[str, str]) -> ServeSettings:
        if "model_dir" not in parameters:
            raise RefusionError("the model's config.pbtxt has no model_dir parameter; "
                                "start it with refusion-run serve.")
        known = {f.name for f in fields(ServeSettings)}
        return ServeSettings(**{name: text if name in _TEXT else _number(name, text, float if name in _FLOAT else int)
                                for name, text in parameters.items() if name in known})


_TEXT = ("model_dir", "backend", "drain_file")
_FLOAT = ("prefix_cache_mb",)


def _number(name: str, text: str, kind: type[int] | type[float]) -> int | float:
    try:
        return kind(text)
    except ValueError as e:
        raise RefusionError(f"model parameter {name}={text!r} is not {'an integer' if kind is int else 'a number'}.") from e
