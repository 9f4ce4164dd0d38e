"""What `refusion-run serve` passes to the Triton model: settings.json beside the model's model.py in the
repository the launcher writes, read back in the backend's process. Not config.pbtxt's parameters, because
Triton shows the model configuration to clients, and these hold host paths."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import resolve_prefill_chunk
from refusion.runtime.prefix_cache import DEFAULT_MB, check_prefix_cache_mb
from refusion.runtime.structured.engine import BUDGET_MS, check_budget_ms

SETTINGS_FILE = "settings.json"


@dataclass(frozen=True)
class ServeSettings:
    model_dir: str
    backend: str = "auto"
    threads: int | None = None
    max_requests: int | None = None  # running at once, a KV region each (None: the runner's default)
    max_batch: int | None = None  # forwards packed per call (None: the runner's default)
    max_queue: int = 64  # waiting beyond the running ones; more are rejected at once
    prefix_cache_mb: float = DEFAULT_MB  # the Generator's prefix cache (0: off)
    prefill_chunk: int | None = None  # the most tokens a forward feeds (None: the default; 0: no bound)
    guide_budget_ms: float = BUDGET_MS  # the grammar engine's work a guided request may take a token
    # Set by the launcher (serve/triton/launcher.py): its work directory (the drain's deadline, a load error)
    # and its process id (the model exits when the launcher is gone).
    work_dir: str | None = None
    launcher_pid: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise RefusionError(f"max_queue={self.max_queue!r} (--max-queue) must be an integer >= 0.")
        check_prefix_cache_mb(self.prefix_cache_mb)
        resolve_prefill_chunk(self.prefill_chunk, None)
        check_budget_ms(self.guide_budget_ms)

    @property
    def drain_file(self) -> Path | None:
        """Where the launcher writes the drain's deadline on SIGTERM."""
        return Path(self.work_dir) / "drain" if self.work_dir is not None else None

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @staticmethod
    def read(path: Path) -> ServeSettings:
        try:
            values = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise RefusionError(f"the model's {path.name} cannot be read ({e}); start it with refusion-run serve.") \
                from e
        known = {f.name for f in fields(ServeSettings)}
        if not isinstance(values, dict) or "model_dir" not in values or not set(values) <= known:
            raise RefusionError(f"{path} is not a settings file of this version; start the model with "
                                "refusion-run serve.")
        return ServeSettings(**values)
