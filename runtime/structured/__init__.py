"""Structured output: the guide a request's answer follows (guide.py), the grammar engine that enforces it behind
a small interface (engine.py; llguidance by default, llguidance_engine.py, imported only when a guide comes), and
tool calls (tools.py). The decoding that applies a guide is runtime/decode/guided.py; docs/decoding.md,
"Structured output", says how it stays exact and where it keeps ReFusion's parallelism."""
