"""Tiny checkpoints and their exports, each made once per session and shared by the export tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from refusion.tools.checks.fixtures.checkpoints import make_checkpoint
from tests.helpers import SPECS

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")


@dataclass
class Export:
    checkpoint: Path
    path: Path
    dtype: str
    logits: bool
    report: object  # ValidationReport of a fresh validate_export(path)


class Store:
    """Lazily made checkpoints and exports, keyed by what they are; nothing is made twice."""

    def __init__(self, root: Path):
        self.root = root
        self._checkpoints: dict[str, Path] = {}
        self._exports: dict[tuple[str, str, bool, str, str], Export] = {}

    def checkpoint(self, name: str) -> Path:
        if name not in self._checkpoints:
            self._checkpoints[name] = make_checkpoint(self.root / "ckpt" / name, SPECS[name])
        return self._checkpoints[name]

    def export(self, name: str, dtype: str = "fp32", logits: bool = False, embeddings: str = "graph",
               ops: str = "standard") -> Export:
        from refusion.export.exporter import export_onnx
        from refusion.export.validate import validate_export

        key = (name, dtype, logits, embeddings, ops)
        if key not in self._exports:
            out = self.root / "exports" / f"{name}-{dtype}{'-logits' if logits else ''}-{embeddings}-{ops}"
            export_onnx(self.checkpoint(name), out, dtype=dtype, logits=logits, embeddings=embeddings, ops=ops,
                        validate=True)
            self._exports[key] = Export(self.checkpoint(name), out, dtype, logits, validate_export(out))
        return self._exports[key]


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny models: torch's thread pool only adds contention (next to onnxruntime's spinning threads
    on a shared 2-core box it made validation ~15x slower)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    return Store(tmp_path_factory.mktemp("refusion-export"))
