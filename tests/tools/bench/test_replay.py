"""tools/bench/replay.py: a decode's forward shapes recorded on the embedded model and replayed on another export
reproduce the recording exactly (the scale bench's ReFusion side), and the scale bench's report reads its data."""

from __future__ import annotations

import pytest

from refusion.runtime.generator import Generator
from refusion.tools.bench import replay as R
from refusion.tools.bench.measure import ar_genai
from refusion.tools.tasks import held_out
from tests.helpers import REPO

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def recordings(tiny_export) -> dict[str, list[R.Recording]]:
    """Two held-out prompts decoded by AR and by ReFusion at the export's recorded setting, recorded."""
    with Generator.from_dir(tiny_export, backend="ort-cpu", threads=1, prefix_cache_mb=0) as gen:
        feeds = [gen.prompt_ids(ex.prompt, chat=True) for ex in held_out(2)]
        options = {"ar": {"mode": "ar", "max_tokens": 16}, "refusion": {}}
        out = {}
        for decoder in ar_genai.DECODERS:
            runs = [R.recorded(gen.runner, lambda: gen.generate(prompt_ids=ids, **options[decoder]),
                               lambda r: r.stats.tokens) for ids in feeds]
            for result, rec in runs:  # the recording is what the decode's own counters say it ran
                assert len(rec.forwards) == result.stats.forward_count and rec.tokens == result.stats.tokens > 0
            out[decoder] = [rec for _, rec in runs]
        assert gen.runner.stats.record is None  # recording ends with the run
    return out


def test_a_replay_on_another_model_reproduces_the_recorded_shapes(recordings, exports):
    """The random tiny checkpoint (another vocabulary and width) replays every forward and KV move: same graph,
    rows, fed tokens, past, write offset and heads, in the same order."""
    refusion = recordings["refusion"]
    assert any(len(r.heads) < r.fed for rec in refusion for f in rec.forwards for r in f.rows)  # heads where read
    with Generator.from_dir(exports["fp32"], backend="ort-cpu", threads=1, prefix_cache_mb=0) as gen:
        for rec in refusion + recordings["ar"]:
            plan = R.prepare(rec, gen.manifest.vocab_size)
            _, replayed = R.recorded(gen.runner, lambda: R.replay(gen.runner, plan), lambda _: rec.tokens)
            assert replayed.events == rec.events
            assert plan.tokens == rec.tokens
    ar_forwards = [f for rec in recordings["ar"] for f in rec.forwards]
    assert len(ar_forwards) == sum(rec.tokens for rec in recordings["ar"])  # AR: one forward a token


def test_a_recording_round_trips_through_json_and_sizes_its_region(recordings):
    for rec in recordings["refusion"]:
        assert R.Recording.from_json(rec.to_json()) == rec
        reach = max(r.past + r.fed for f in rec.forwards for r in f.rows)
        assert rec.capacity >= reach


def test_the_report_reads_its_data(recordings, tmp_path):
    sides = {"ours": 2.0, "genai": 4.0, "ar_replay": 3.0, "refusion_replay": 6.0, "refusion": 5.0,
             "ours_ort": 2.5, "ar_replay_ort": 3.5, "refusion_replay_ort": 7.0, "refusion_ort": 6.0}
    model = {"layers": 4, "hidden": 192, "prompts": 2, "tokens": dict.fromkeys(sides, 30),
             "tokens_per_second": sides, "tokens_per_second_range": {k: [v, v] for k, v in sides.items()},
             "ratios": {f"{a}/{b}": sides[a] / sides[b] for a, b in ar_genai.RATIOS},
             "ratios_range": {f"{a}/{b}": [sides[a] / sides[b]] * 2 for a, b in ar_genai.RATIOS},
             "identical_before_eos": 2, "ort_ops_identical": 2, "refusion_reproduces_recording": 2,
             "refusion_ort_reproduces_recording": 2,
             "graph_nodes": {"ours_infiller": 289, "ours_ort_infiller": 143, "genai": 87}}
    data = {"cpu": "a CPU", "threads": 1, "host": {}, "models": {"embedded": model},
            "recorded_shapes": {d: ar_genai.shape_summary(recordings[d]) for d in ar_genai.DECODERS},
            "recordings": {d: [rec.to_json() for rec in recordings[d]] for d in ar_genai.DECODERS}}
    text = ar_genai.markdown(data)
    assert ("| embedded (4 layers, hidden 192) | 2 | 30 | 2.0 | 2.5 | 4.0 | 0.50x (0.50-0.50) | 0.62x (0.62-0.62) | "
            "2/2 | 2/2 | 289 / 143 / 87 |") in text
    assert "| embedded | standard | 2 | 30 | 5.0 | 6.0 | 3.0 | 1.25x (1.25-1.25) | 2.00x (2.00-2.00) |" in text
    assert ("| embedded | onnxruntime ops | 2 | 30 | 6.0 | 7.0 | 3.5 | 1.50x (1.50-1.50) | 2.00x (2.00-2.00) | "
            "1.75x (1.75-1.75) | 2.80x (2.80-2.80) | 1.40x (1.40-1.40) |") in text
    assert f"| refusion | 2 | {sum(rec.tokens for rec in recordings['refusion'])} |" in text
    ar_genai.plot(data, tmp_path / "scale.png")
    assert (tmp_path / "scale.png").stat().st_size > 0


def test_the_docs_quote_the_committed_tables():
    """docs/benchmark.md's scale-bench tables are lines of the committed results/ar-genai/ar-genai.md: quoted from
    what the command wrote, never typed."""
    generated = set((REPO / "results" / "ar-genai" / "ar-genai.md").read_text().splitlines())
    doc = (REPO / "docs" / "benchmark.md").read_text()
    section = doc[doc.index("## The scale bench"):]
    rows = [line for line in section.split("\n## ")[0].splitlines() if line.startswith("|")]
    assert len(rows) >= 8 and set(rows) <= generated
