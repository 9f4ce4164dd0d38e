"""`refusion-run bench` on a tiny random (peaky) export: seconds, no trained model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

from refusion.runtime.core.errors import RefusionError
from refusion.tools.bench import decoding as B
from refusion.tools.cli_common import ErrorReportingGroup

GEN = 16
SETTINGS = "4,1,0.6,0.3;4,2,0.5,0.1"
DIFFUSION = "16,8;8,8,exit"


@pytest.fixture(scope="module")
def checkpoint(peaky_export) -> Path:
    """A peaky tiny Qwen3 with the fixture tokenizer and a mask id, saved as an HF checkpoint."""
    return peaky_export.parent / "ckpt0"  # export_peaky's, beside its export


@pytest.fixture(scope="module")
def export_dir(peaky_export) -> Path:
    return peaky_export


# ----------------------------------------------------------------------------- interleaving


def test_methods_run_interleaved_with_a_rotating_order():
    calls = []

    def method(name):
        def run(ids):
            calls.append((ids[0], name))
            return B.Sample([1], 1, {"x": 1}, 0.01, 0.005, 1.0)
        return B.Method(name, "ar", name, "fake", {}, run, short=name)

    methods = [method(n) for n in "abc"]
    examples = [B.T.Example("add", f"p{i}", "a") for i in range(4)]
    samples = B.run_interleaved(methods, examples, [[i] for i in range(4)], lambda ex, s: None, lambda msg: None)
    assert [n for _, n in calls] == list("abc" "bca" "cab" "abc")
    assert [i for i, _ in calls] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    assert all(len(v) == 4 for v in samples.values())


def test_settings_parse_and_reject():
    ps = B.parse_settings("8,2,0.9,0.4; 4,1,0.7,0.2", 64)
    assert [(p.slot_size, p.serial_num_blocks, p.slot_threshold, p.token_threshold) for p in ps] == [
        (8, 2, 0.9, 0.4), (4, 1, 0.7, 0.2)]
    ds = B.parse_diffusion("64,32;32,32,exit,clean", 64)
    assert ds[1].early_exit and ds[1].order == "clean_first" and ds[0].steps == 64
    for bad in ("8,2,0.9", "8,x,0.9,0.4", "8,3,0.9,0.4"):
        with pytest.raises(RefusionError):
            B.parse_settings(bad, 64)
    with pytest.raises(RefusionError):
        B.parse_diffusion("64,32,fast", 64)


# ----------------------------------------------------------------------------- end to end


def _cli():
    group = ErrorReportingGroup()
    group.add_command(B.bench)  # as run_cli registers it
    return group


def _expected_ids(reference: bool) -> list[str]:
    ids = ["ar", "refusion:k4b1s0.6t0.3", "refusion:k4b2s0.5t0.1", "diffusion:s16b8", "diffusion:s8b8x"]
    return ids + (["reference-refusion:k4b1s0.6t0.3", "reference-refusion:k4b2s0.5t0.1", "reference-ar"] if reference else [])


def _check_outputs(out: Path, n: int, reference: bool) -> dict:
    data = json.loads((out / "bench.json").read_text())
    rows = {r["id"]: r for r in data["methods"]}
    assert list(rows) == _expected_ids(reference)
    md = (out / "bench.md").read_text()
    for r in rows.values():
        assert r["n"] == n and len(data["per_prompt"][r["id"]]["tokens"]) == n
        assert r["tokens"] == sum(data["per_prompt"][r["id"]]["tokens"])
        assert f"| {r['method']} | {r['setting']} |" in md
        if r["id"] != "ar":
            # every ratio is computed from this run's own per-prompt numbers
            pa, pb = data["per_prompt"][r["id"]], data["per_prompt"]["ar"]
            expected = (sum(pa["tokens"]) / sum(pa["wall_ms"])) / (sum(pb["tokens"]) / sum(pb["wall_ms"]))
            ratio = r["ratios"]["vs_ar"]
            assert ratio["ratio"] == pytest.approx(expected, rel=1e-3)
            assert ratio["ci95"][0] <= ratio["ratio"] * (1 + 1e-9) and ratio["ci95"][1] >= ratio["ratio"] * (1 - 1e-9)
            assert r["tokens_per_second"] / rows["ar"]["tokens_per_second"] == pytest.approx(ratio["ratio"])
    for r in rows.values():  # tokens fed through the network: the runner's own count (RunnerStats), or torch's
        assert r["fed_tokens_per_forward"] > 0 and r["fed_tokens_per_token"] > 0, r["id"]
    assert rows["diffusion:s16b8"]["fed_tokens_per_forward"] > GEN  # every step feeds prompt + the whole span
    assert rows["diffusion:s16b8"]["forwards"] == n * 16  # no early exit: every step runs
    assert rows["ar"]["forwards_by_kind"].keys() <= {"prefill", "decode"}
    assert "## ReFusion against the other methods" in md and "vs LLaDA-style" in md
    assert "target" not in md.lower() and "missed" not in md  # the project's targets are docs/benchmark.md's
    assert data["meta"]["threads"] == 1 and data["meta"]["n"] == n
    if reference:
        ref = rows["reference-refusion:k4b1s0.6t0.3"]
        assert "vs_reference" in rows["refusion:k4b1s0.6t0.3"]["ratios"] and "vs_reference" in rows["ar"]["ratios"]
        # the reference ran the same setting on the same prompts: the same tokens and forwards
        assert rows["refusion:k4b1s0.6t0.3"]["same_tokens_as_reference"] == n
        assert rows["refusion:k4b2s0.5t0.1"]["same_tokens_as_reference"] == n
        assert rows["ar"]["same_tokens_as_reference"] == n
        assert ref["forwards"] == rows["refusion:k4b1s0.6t0.3"]["forwards"]
        # AR feeds the prompt, then one token a forward, in either implementation
        assert rows["ar"]["fed_tokens_per_forward"] == pytest.approx(rows["reference-ar"]["fed_tokens_per_forward"])
        assert "runtime_vs_reference" in data["comparisons"]
    if B.__dict__.get("render_plot") and _has_matplotlib():
        assert (out / "bench.png").stat().st_size > 1000
    return data


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401 - only whether it imports
    except ImportError:
        return False
    return True


def test_bench_cli_end_to_end_on_a_checkpoint_without_reference(checkpoint, tmp_path):
    out = tmp_path / "bench"
    result = CliRunner().invoke(_cli(), ["bench", str(checkpoint), "--n", "3", "--gen-length", str(GEN),
                                         "--settings", SETTINGS, "--diffusion", DIFFUSION, "--no-reference",
                                         "--warmup", "1", "--out", str(out), "--profile"])
    assert result.exit_code == 0, result.output
    assert "[3/3] accuracy ar" in result.stderr and "exporting" in result.stderr
    data = _check_outputs(out, 3, reference=False)
    profile = (out / "profile.txt").read_text()
    assert "engine (Runner.run/move_kv)" in profile and "profile" not in data
    assert "refusion_steps" in profile  # the loop itself, which runs on the engine thread
    for p in data["comparisons"]["refusion_vs_ar"]["settings"]:
        assert p["speedup_vs_ar"] == pytest.approx(p["tokens_per_forward_ratio"] * p["forward_speed_ratio"])


def test_bench_with_the_pytorch_reference_on_an_export(export_dir, tmp_path):
    """An export dir: the reference finds the checkpoint through refusion.json's source."""
    report = B.run_bench(B.BenchConfig(model=export_dir, n=3, gen_length=GEN, settings=SETTINGS, diffusion=DIFFUSION,
                                       warmup=1, out=tmp_path / "bench"), progress=lambda msg: None)
    data = _check_outputs(tmp_path / "bench", 3, reference=True)
    assert report["comparisons"] == data["comparisons"]


def test_bench_errors_are_one_line(export_dir, tmp_path):
    cli = _cli()
    bad = CliRunner().invoke(cli, ["bench", str(tmp_path), "--no-reference"])
    assert bad.exit_code == 1 and "neither an export" in bad.stderr
    bad = CliRunner().invoke(cli, ["bench", str(export_dir), "--settings", "4,1,0.6", "--no-reference"])
    assert bad.exit_code == 1 and "--settings entry" in bad.stderr
    bad = CliRunner().invoke(cli, ["bench", str(export_dir), "--seed", "7", "--no-reference"])
    assert bad.exit_code == 1 and "one seed" in bad.stderr
