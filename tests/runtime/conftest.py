"""Generators the runtime's structured-output tests share, one a test module (closed with it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from refusion.runtime.generator import Generator


@pytest.fixture(scope="module")
def tiny(tiny_export) -> Iterator[Generator]:
    """The embedded model on onnxruntime CPU, one thread."""
    with Generator.from_dir(tiny_export, backend="ort-cpu", threads=1) as gen:
        yield gen


@pytest.fixture(scope="module")
def random_model(exports) -> Iterator[Generator]:
    """A random-weight model with the fixture's byte-level tokenizer, whose chat template has a tool format; four
    requests at once, their forwards batched."""
    with Generator.from_dir(exports["fp32"], backend="ort-cpu", threads=1, max_requests=4, max_batch=4) as gen:
        yield gen
