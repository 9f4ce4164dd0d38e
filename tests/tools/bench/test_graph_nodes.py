"""tools/bench/measure/graph_nodes.py's command line: exports are named LABEL=EXPORT_DIR, and anything else is a usage error."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("onnxruntime")

from refusion.tools.bench.measure.graph_nodes import main  # noqa: E402


@pytest.mark.parametrize("arg", ["out/refusion-onnx", "=out/refusion-onnx", "new="])
def test_an_export_without_its_label_is_a_usage_error(monkeypatch, capsys, arg):
    monkeypatch.setattr(sys, "argv", ["graph_nodes", arg])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2 and f"{arg!r} is not LABEL=EXPORT_DIR" in capsys.readouterr().err
