"""Every runner counts its own work (RunnerStats): forwards, rows, tokens fed and padded, time by graph, KV
moves; and the scheduler its rounds. The benches read these instead of wrapping runtime methods."""

from __future__ import annotations

import numpy as np
import pytest

from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.decode import masks
from refusion.runtime.generator import Generator
from refusion.runtime.runners.onnxruntime import OrtRunner
from refusion.runtime.runners.rows import RowFeed
from refusion.runtime.runners.stats import ForwardShape, MoveShape, RowShape, RunnerStats
from refusion.runtime.runners.tensorrt import TensorRTRunner
from tests.fakes import CpuBoundCudaRunner
from tests.helpers import fake_engines

pytest.importorskip("onnxruntime")


def _rows(past_seq: list[tuple[int, int]]) -> list[RowFeed]:
    return [RowFeed(np.zeros((1, seq), np.int64), np.arange(past, past + seq)[None], masks.causal_after(past, seq),
                    past, past, region) for region, (past, seq) in enumerate(past_seq)]


def _runner(kind: str, export, tmp_path):
    manifest = ExportManifest.load(export)
    if kind == "ort-cpu":
        return OrtRunner(manifest, threads=1, max_requests=2, max_batch=2)
    if kind == "ort-cuda":
        return CpuBoundCudaRunner(manifest, threads=1, max_requests=2, max_batch=2)
    return TensorRTRunner.from_dir(fake_engines(export, tmp_path / "engines"))  # batch 1: one row a forward


@pytest.mark.parametrize("kind", ["ort-cpu", "ort-cuda", "trt"])
def test_each_runner_counts_its_forwards_rows_tokens_and_moves(kind, peaky_export, fakes, tmp_path):
    with _runner(kind, peaky_export, tmp_path) as runner:
        for region in range(runner.max_requests):
            runner.allocate_kv(32, region)
        before = runner.stats.copy()
        runner.stats.record = recorded = []
        rows = _rows([(0, 5), (0, 3)][: runner.max_batch])
        runner.run_batch("infiller", rows)
        runner.run_batch("infiller", _rows([(5, 1)]))
        runner.move_kv(0, 8, 4)
        runner.move_kv(3, 3, 4)  # moves nothing
        counted = runner.stats.since(before)
    infiller = counted.graphs["infiller"]
    fed = sum(r.input_ids.shape[1] for r in rows) + 1
    assert (infiller.forwards, infiller.rows, infiller.fed) == (2, len(rows) + 1, fed)
    assert infiller.padded == len(rows) * 5 + 1  # rows padded to the longest, as packed
    assert 0 < infiller.backend_seconds <= infiller.seconds
    assert (counted.moves, counted.moved_tokens) == (1, 4) and counted.move_seconds > 0
    assert counted.total.fed == fed and counted.busy_seconds == pytest.approx(infiller.seconds + counted.move_seconds)
    assert "planner" not in counted.graphs
    assert recorded == [ForwardShape("infiller", tuple(RowShape(seq, 0, 0, tuple(range(seq))) for seq in (5, 3)[: len(rows)])),
                        ForwardShape("infiller", (RowShape(1, 5, 5, (0,)),)), MoveShape(0, 8, 4)]


def test_nothing_is_recorded_unless_asked(tiny_export):
    with Generator.from_dir(tiny_export, backend="ort-cpu", threads=1) as gen:
        gen.generate(prompt_ids=[5, 17, 42], gen_length=8, mode="ar")
        assert gen.runner.stats.record is None


def test_since_and_total_add_up_by_graph():
    stats = RunnerStats()
    stats.graph("planner").add(_rows([(0, 4)]), 0.5)
    earlier = stats.copy()
    stats.graph("planner").add(_rows([(0, 2), (0, 6)]), 1.0)
    stats.graph("infiller").add(_rows([(0, 3)]), 0.25)
    later = stats.since(earlier)
    assert (later.graphs["planner"].forwards, later.graphs["planner"].fed, later.graphs["planner"].padded) == (1, 8, 12)
    assert later.total.fed == 11 and later.total.seconds == pytest.approx(1.25)
    assert earlier.graphs["planner"].fed == 4  # a copy, not a view


def test_a_generation_is_counted_by_the_runner_and_the_scheduler(tiny_export):
    with Generator.from_dir(tiny_export, backend="ort-cpu", threads=1) as gen:
        result = gen.generate(prompt_ids=[5, 17, 42], gen_length=8, mode="ar")
        stats = gen.runner.stats
        assert stats.total.forwards == result.stats.forward_count
        assert stats.total.fed == 3 + result.stats.forward_count - 1  # the prompt, then one token a forward
        assert gen.scheduler.stats.rounds >= result.stats.forward_count and gen.scheduler.stats.busy_seconds > 0
