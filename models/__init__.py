"""Checkpoints that ship with refusion-trt (installed as package data)."""

from pathlib import Path

EMBEDDED_MODEL = Path(__file__).parent / "refusion-tiny"
