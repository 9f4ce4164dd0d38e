"""`refusion-run bench-concurrency` on the embedded model: a small run end to end, its metrics, its CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import Generator
from refusion.tools.bench import common
from refusion.tools.bench import concurrency as C
from refusion.tools.run_cli import cli
from refusion.tools.tasks import held_out

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    from refusion.export.exporter import export_onnx

    return export_onnx(REPO / "models" / "refusion-tiny", tmp_path_factory.mktemp("tiny") / "onnx", validate=False)


@pytest.fixture(scope="module")
def report(export, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("concurrency")
    cfg = C.ConcurrencyConfig(model=export, levels=(1, 2, 4), requests=8, repeats=2, warmup=2, out=out, profile=4)
    return C.run_concurrency_bench(cfg, progress=lambda line: None), out


def test_levels_parsed_and_checked():
    assert common.parse_levels("16, 1,4,4") == (1, 4, 16)
    for text, match in [("2,4", r"lacks 1: concurrency 1 is the baseline"), ("1,x", r"not a comma-separated list"),
                        ("0,1", r"must be a positive number of clients"), ("", r"must be a positive number")]:
        with pytest.raises(RefusionError, match=match):
            common.parse_levels(text)


def test_inter_token_latency_is_the_gap_per_token_after_the_first_piece():
    assert common.inter_token_latency([(0.010, 3), (0.014, 5), (0.020, 9)]) == pytest.approx(0.010 / 6)
    assert common.inter_token_latency([(0.010, 3)]) is None  # one piece: no gap
    assert common.inter_token_latency([]) is None


def test_one_request_as_its_client_sees_it(export):
    with Generator.from_dir(export, backend="ort-cpu", threads=1) as gen:
        ids = gen.prompt_ids(held_out(1)[0].prompt, chat=True)
        timing = common.run_request(gen, ids, {"mode": "refusion"})
        alone = gen.generate(prompt_ids=ids)
    assert timing.token_ids == alone.token_ids and timing.tokens == alone.stats.tokens
    eos = gen.manifest.eos_token_id
    assert timing.settled == len(alone.token_ids[: alone.token_ids.index(eos)] if eos in alone.token_ids
                                 else alone.token_ids)
    assert timing.pieces >= 1 and 0 < timing.ttft <= timing.latency


def test_report_per_level(report):
    rep, _ = report
    levels = rep["levels"]
    assert [r["concurrency"] for r in levels] == [1, 2, 4]
    for r in levels:
        assert r["identical"] == r["compared"] == 2 * 8  # every request of every pass as at concurrency 1
        assert r["requests"] == 8 and sum(r["per_request"]["tokens"]) == r["tokens"] > 0
        assert r["output_tokens_per_second"] == pytest.approx(r["tokens"] / r["wall_seconds"])
        lo, hi = r["output_tokens_per_second_range"]
        assert lo <= r["output_tokens_per_second"] <= hi
        assert r["ttft_ms"]["p50"] <= r["latency_ms"]["p50"] and r["latency_ms"]["p50"] <= r["latency_ms"]["p99"]
        assert all(v >= 0 for v in r["engine"]["seconds"].values()), r["engine"]["seconds"]
        assert r["engine"]["counters"]["rows"] >= r["engine"]["counters"]["calls"] > 0
    assert levels[0]["speedup"] == 1.0 and levels[0]["engine"]["rows_per_forward"] == 1.0  # one request at a time
    assert "target" not in rep  # the project's targets are docs/benchmark.md's, not the bench's output
    assert rep["meta"]["command"].startswith(f"refusion-run bench-concurrency {rep['meta']['model']} "
                                             "--concurrency 1,2,4 --requests 8 --repeats 2")


def test_outputs_written(report):
    rep, out = report
    stem = "refusion-threads1"
    assert {p.name for p in out.iterdir()} == {f"{stem}.md", f"{stem}.json", f"{stem}.png", f"{stem}-profile.txt"}
    md = (out / f"{stem}.md").read_text()
    assert md.count("\n| 4 |") == 2 and f"Reproduce: `{rep['meta']['command']}`" in md
    assert "target" not in md.lower()
    assert json.loads((out / f"{stem}.json").read_text())["levels"][2]["identical"] == 16
    profile = (out / f"{stem}-profile.txt").read_text()
    assert profile.startswith("concurrency 4 under cProfile") and "_advance" in profile


@pytest.mark.parametrize("kwargs, match", [
    (dict(levels=(1, 4), requests=2), r"--requests 2 is fewer than concurrency 4"),
    (dict(profile=8), r"--profile 8 is not one of the levels 1,2"),
    (dict(repeats=0), r"--repeats 0 must be at least 1"),
    (dict(requests=1990, warmup=32), r"--requests \+ --warmup"),
])
def test_bad_settings_refused_before_running(export, kwargs, match):
    cfg = C.ConcurrencyConfig(**{"model": export, "levels": (1, 2), "requests": 4, "out": None, **kwargs})
    with pytest.raises(RefusionError, match=match):
        C.run_concurrency_bench(cfg, progress=lambda line: None)


def test_cli(export, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(cli, ["bench-concurrency", str(export), "--concurrency", "1,2", "--requests", "4",
                             "--repeats", "1", "--warmup", "0", "--mode", "ar", "--no-plot", "--out", str(tmp_path)])
    assert ok.exit_code == 0, ok.output
    assert "| 2 |" in ok.output and sorted(p.name for p in tmp_path.iterdir()) == ["ar-threads1.json", "ar-threads1.md"]
    bad = runner.invoke(cli, ["bench-concurrency", str(export), "--concurrency", "2,4"])
    assert bad.exit_code == 1 and "error: --concurrency '2,4' lacks 1" in bad.output
