"""tools/bench/measure/cpu_forward.py's pieces that run without onnxruntime-genai: the CPU's flags and the feeds it
builds (graph_nodes.graph_feed) for either graph family, from the session's own inputs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from refusion.tools.bench.common import SIMD_FLAGS, cpu_flags  # noqa: E402
from refusion.tools.bench.measure.cpu_forward import session  # noqa: E402
from refusion.tools.bench.measure.graph_nodes import graph_feed  # noqa: E402


def test_cpu_flags_name_the_simd_extensions_in_their_table_order():
    flags = cpu_flags()
    assert flags == [f for f in SIMD_FLAGS if f in flags]


def test_our_graphs_feed_runs_with_the_heads_asked(tiny_export):
    s = session(tiny_export / "infiller.onnx")
    feed = graph_feed(s, 3, 5, 2, 48)
    assert feed["attention_mask"].shape == (1, 3, 8) and feed["past_key_values.0.key"].shape[:2] == (1, 5)
    outputs = dict(zip([o.name for o in s.get_outputs()], s.run(None, feed)))
    assert outputs["argmax_ids"].shape == (1, 2) and outputs["present.0.key"].shape[1] == 3


def test_onnxruntime_genais_layout_gets_its_mask_and_head_major_past():
    inputs = [SimpleNamespace(name="input_ids", shape=["batch_size", "sequence_length"], type="tensor(int64)"),
              SimpleNamespace(name="attention_mask", shape=["batch_size", "total_sequence_length"], type="tensor(int64)"),
              SimpleNamespace(name="past_key_values.0.key", shape=["batch_size", 2, "past_sequence_length", "kv_cache_dim"],
                              type="tensor(float)")]
    feed = graph_feed(SimpleNamespace(get_inputs=lambda: inputs), 4, 6, 1, 48)
    assert feed["attention_mask"].dtype == np.int64 and feed["attention_mask"].shape == (1, 10)
    assert feed["past_key_values.0.key"].shape == (1, 2, 6, 48)
