"""What a manifest records of each file it lists: size and sha256, checked at load.

Sizes are checked on every load (a stat per file). The sha256 of multi-GB files costs a full
read (docs/architecture.md gives the measured rate), so it runs on request (`verify=True`,
`--verify`) and always in `refusion-export check`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from refusion.runtime.core.errors import RefusionError


@dataclass(frozen=True)
class FileRecord:
    bytes: int
    sha256: str

    @staticmethod
    def of(file: Path) -> FileRecord:
        return FileRecord(file.stat().st_size, sha256_file(file))

    def to_json(self) -> dict[str, int | str]:
        return {"bytes": self.bytes, "sha256": self.sha256}

    def problem(self, file: Path, verify: bool) -> str | None:
        """What is wrong with `file` against this record, or None. Sizes always; sha256 with `verify`."""
        if not file.is_file():
            return f"{file} is missing"
        size = file.stat().st_size
        if size != self.bytes:
            return f"{file} has {size} bytes, {self.bytes} recorded (truncated or replaced)"
        if verify:
            digest = sha256_file(file)
            if digest != self.sha256:
                return f"{file} has sha256 {digest[:16]}..., {self.sha256[:16]}... recorded (modified or damaged)"
        return None


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    """sha256 of a file read in chunks into one buffer (weight files do not fit in memory twice)."""
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    try:
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
    except OSError as e:
        raise RefusionError(f"cannot read {path} ({e.strerror}); check the file and its permissions.") from e
    return h.hexdigest()
