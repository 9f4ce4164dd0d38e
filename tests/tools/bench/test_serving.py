"""`refusion-run bench-serve` on the embedded model: a small run over a real tritonserver and a real OpenAI
server, end to end through its click command; skipped without the serve extra."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

pytestmark = pytest.mark.slow  # a real tritonserver and OpenAI server, and the bench on every side
pytest.importorskip("pytriton", reason="serving needs the serve extra: pip install -e '.[serve]'")
pytest.importorskip("onnxruntime")
pytest.importorskip("torch")  # the embedded model is a checkpoint: the bench exports it first

from refusion.runtime.core.errors import RefusionError
from refusion.tools.bench import serving as S

REPO = Path(__file__).resolve().parents[3]
REQUESTS = 6
SUMMARY_KEYS = {"concurrency", "requests", "output_tokens_per_second", "requests_per_second", "speedup", "identical",
                "compared", "ttft_ms", "itl_ms", "latency_ms", "cpu_cores"}


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("serving")
    result = CliRunner().invoke(S.bench_serve, [
        str(REPO / "models" / "refusion-tiny"), "--concurrency", "1,2", "--requests", str(REQUESTS), "--repeats", "1",
        "--warmup", "2", "--out", str(out), "--no-plot"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return json.loads((out / "serve-threads1.json").read_text()), out


def test_the_report_has_every_side_at_every_level(report):
    data, out = report
    assert sorted(p.name for p in out.iterdir()) == ["serve-threads1.json", "serve-threads1.md"]  # --no-plot
    meta = data["meta"]
    assert meta["requests"] == REQUESTS and meta["backend"] == "ort-cpu" and meta["params"]["mode"] == "refusion"
    assert [row["concurrency"] for row in data["levels"]] == [1, 2]
    for row in data["levels"]:
        for side in S.SIDES:
            level = row[side]
            assert SUMMARY_KEYS <= set(level) and level["requests"] == REQUESTS
            assert level["output_tokens_per_second"] > 0 and level["latency_ms"]["p99"] >= level["latency_ms"]["p50"]
            assert 0 < level["ttft_ms"]["p50"] <= level["latency_ms"]["p99"]
        for side in S.SIDES:
            assert set(row[side]["cpu_cores"]) == set(S.PROCESSES[side])
    for server in S.SERVERS:
        assert {"mean", "p50", "paired_median"} <= set(data["overhead"][server]["latency_ms"])
        assert data["saturation"][server]["level"] in (1, 2)
    markdown = (out / "serve-threads1.md").read_text()
    assert "Triton: overhead per request" in markdown and "The OpenAI server: overhead per request" in markdown


def test_every_request_got_the_in_process_generators_tokens(report):
    for row in report[0]["levels"]:
        for side in S.SIDES:
            assert row[side]["identical"] == row[side]["compared"] == REQUESTS, (row["concurrency"], side)


def test_token_counts_are_recovered_from_the_text_of_each_piece():
    decode = "".join  # a one-character-per-token tokenizer
    answer = list("hello world")
    assert S.token_counts(answer, [2, 5, 11], decode) == [2, 5, 11]
    assert S.token_counts(answer, [11, 14], decode) == [11, 11]  # text past the settled tokens: all of them
    timing = S.to_timing(S.Streamed(list("abc"), "eos", 0.05, [(0.01, 1), (0.03, 3)]), decode)
    assert (timing.tokens, timing.settled, timing.pieces, timing.ttft) == (4, 3, 2, 0.01)  # the EOS counted
    assert S.to_timing(S.Streamed(list("abc"), "length", 0.05, [(0.01, 1)]), decode).tokens == 3
    assert timing.itl == pytest.approx(0.01)


def test_too_few_requests_for_the_highest_level_are_refused():
    with pytest.raises(RefusionError, match="--requests 4 is fewer than concurrency 8"):
        S.run_serve_bench(S.ServeBenchConfig(model=Path("unused"), levels=(1, 8), requests=4, out=None))
