"""docs/api.md's tables name every field and option the API has (its examples run in
tests/tools/test_doc_examples.py)."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

from refusion.runtime import DecodeParams, GenerationResult, GenerationStats, Generator, RequestOptions

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def test_the_tables_name_every_field_and_option():
    text = DOC.read_text()
    for cls in (GenerationResult, GenerationStats, DecodeParams, RequestOptions):
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}` |" in text, f"{cls.__name__}.{field.name} is not in docs/api.md"
    assert "| `steps` |" in text and "`loop_share`" in text
    for name in inspect.signature(Generator.from_dir).parameters:
        assert f"| `{name}` |" in text, f"Generator.from_dir({name}=...) is not in docs/api.md"
    for name in ("submit", "generate", "stream", "params", "prompt_ids", "close", "cancel", "result", "timeout_s",
                 "options", "fit_messages", "agenerate", "astream", "events", "aevents", "aresult"):
        assert name in text
