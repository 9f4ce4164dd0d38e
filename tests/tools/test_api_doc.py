"""docs/api.md stays true: its examples run, in order, on the embedded model's export, and its
tables name every field and option the API has."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import re
from pathlib import Path

import pytest

from refusion.export.exporter import export_onnx
from refusion.models import EMBEDDED_MODEL
from refusion.runtime import GenerationResult, GenerationStats, Generator

pytest.importorskip("onnxruntime")

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_the_examples_run(tmp_path):
    export = export_onnx(EMBEDDED_MODEL, tmp_path / "refusion-onnx", validate=False)
    paths = {"out/refusion-onnx": export, "out/my-export": tmp_path / "my-export",
             "models/refusion-tiny": EMBEDDED_MODEL}
    namespace: dict = {}
    out = io.StringIO()
    blocks = examples()
    assert len(blocks) >= 8
    for i, block in enumerate(blocks):
        for written, real in paths.items():
            block = block.replace(f'"{written}"', repr(str(real)))
        with contextlib.redirect_stdout(out):
            exec(compile(block, f"docs/api.md example {i + 1}", "exec"), namespace)  # noqa: S102 - the docs' examples
    printed = out.getvalue()
    assert "ort-cpu float32" in printed
    assert "{'weights': 1.0, 'validation': 1.0}" in printed
    for message in ("(padded to slot_size 5) cannot be cut", "slot_threshold=1.5 is outside [0, 1]",
                    "gen_length 10000 exceeds the model's 256 positions", "mode='fast' is not one of"):
        assert message in printed  # each bad setting's RefusionError, naming it
    assert "weights 47/47 written" in printed  # progress=print: the lines the CLI logs
    assert namespace["gen"].scheduler._closed


def test_the_tables_name_every_field_and_option():
    text = DOC.read_text()
    for cls in (GenerationResult, GenerationStats):
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}` |" in text, f"{cls.__name__}.{field.name} is not in docs/api.md"
    assert "| `steps` |" in text and "`loop_share`" in text
    for name in inspect.signature(Generator.from_dir).parameters:
        assert f"| `{name}` |" in text, f"Generator.from_dir({name}=...) is not in docs/api.md"
    for name in ("submit", "generate", "stream", "params", "prompt_ids", "close", "cancel", "result", "timeout_s"):
        assert name in text
