"""Strict reading of JSON manifests: every field is looked up by path and type-checked, and a
bad one is one RefusionError naming the file, the field, what was found and what was expected.

    fields = Fields(file, raw, fix="re-export with `refusion-export onnx`")
    layers = fields.positive_int("model.num_layers")
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from refusion.runtime.core.errors import RefusionError

# A field: "model.kv_heads", or a tuple of keys when a key holds dots ("weights", "tensors", name).
FieldPath = str | tuple[str, ...]

class Fields:
    def __init__(self, file: Path, raw: Any, fix: str):
        self.file, self.raw, self.fix = file, raw, fix
        if not isinstance(raw, dict):
            raise RefusionError(f"{file}: the top level is {_found(raw)}, expected a JSON object; {fix}.")

    def fail(self, field: FieldPath, found: Any, expected: str) -> RefusionError:
        return RefusionError(f"{self.file}: field {show(field)} is {_found(found)}, expected {expected}; {self.fix}.")

    def get(self, field: FieldPath) -> Any:
        node: Any = self.raw
        parts = _parts(field)
        for depth, part in enumerate(parts):
            if not isinstance(node, dict):
                raise self.fail(parts[:depth], node, "a JSON object")
            if part not in node:
                raise RefusionError(f"{self.file}: field {show(field)} is missing; {self.fix}.")
            node = node[part]
        return node

    def object(self, field: FieldPath) -> dict[str, Any]:
        value = self.get(field)
        if not isinstance(value, dict):
            raise self.fail(field, value, "a JSON object")
        return value

    def list(self, field: FieldPath) -> list[Any]:
        value = self.get(field)
        if not isinstance(value, list):
            raise self.fail(field, value, "a JSON list")
        return value

    def str(self, field: FieldPath, choices: tuple[str, ...] | None = None) -> str:
        value = self.get(field)
        if not isinstance(value, str) or (choices is not None and value not in choices):
            raise self.fail(field, value, f"one of {', '.join(choices)}" if choices else "a string")
        return value

    def bool(self, field: FieldPath) -> bool:
        value = self.get(field)
        if not isinstance(value, bool):
            raise self.fail(field, value, "true or false")
        return value

    def int(self, field: FieldPath, low: int = 0, high: int | None = None) -> int:
        """An integer in [low, high) (high None: unbounded)."""
        value = self.get(field)
        if not is_int(value) or value < low or (high is not None and value >= high):
            span = f"[{low}, {high})" if high is not None else f">= {low}"
            raise self.fail(field, value, f"an integer {span}")
        return value

    def positive_int(self, field: FieldPath) -> int:
        return self.int(field, low=1)

    def float(self, field: FieldPath, low: float, high: float | None = None, low_open: bool = False) -> float:
        """A finite number in [low, high] ((low, high] when low_open)."""
        value = self.get(field)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and (value > low if low_open else value >= low) and (high is None or value <= high)
        if not ok:
            bounds = (f"in {'(' if low_open else '['}{low}, {high}]" if high is not None
                      else f"{'>' if low_open else '>='} {low}")
            raise self.fail(field, value, f"a finite number {bounds}")
        return float(value)


def show(field: FieldPath) -> str:
    """A field path for messages; keys holding dots (tensor names) in brackets."""
    text = ""
    for part in _parts(field):
        text += f'["{part}"]' if "." in part else f"{'.' if text else ''}{part}"
    return text


def _parts(field: FieldPath) -> tuple[str, ...]:
    return tuple(field.split(".")) if isinstance(field, str) else field


def is_int(value: Any) -> bool:
    """A JSON integer: int but not bool (True is an int to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _found(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{text} ({type(value).__name__})"
