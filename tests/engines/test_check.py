"""`refusion-export check ENGINES_DIR` end to end on the CPU fakes: it passes on engines of the
export, fails on engines of another model, runs the shared cases it can, and runs the very cases
export validation runs."""

from __future__ import annotations

import numpy as np
import pytest

from refusion.engines import check
from refusion.export import compare
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.core.profiles import DecodeLimits
from tests.helpers import fake_engines

LOOP = {"prefill+plan", "plan", "verify", "ar prefill", "ar step", "slot rows"}


def test_check_passes_on_engines_of_the_export(peaky_export, fakes, tmp_path, monkeypatch):
    from tests.fakes import _Context

    lines: list[str] = []
    engines = fake_engines(peaky_export, tmp_path / "engines")
    ran: list[int] = []  # the profile of every forward: all on the one engine, the planner's on its plan profile
    real = _Context.execute_async_v3
    monkeypatch.setattr(_Context, "execute_async_v3",
                        lambda self, stream: ran.append(self.profile) or real(self, stream))
    assert check.check_engines(engines, report=lines.append)
    assert sorted(set(ran)) == [0, 1, 2] and ran.count(2) == 5  # 3 batch-1 shapes, plan, slot rows
    assert lines[-1].startswith("PASS") and "  result: PASS" in lines
    assert "13 forwards of 11 cases" in lines[0]  # 17 forwards, less the batch-2 ones
    assert any(line.startswith("  infiller present.*") and line.endswith("ok") for line in lines)
    left_out = [line for line in lines if line.startswith("  left out:")]
    held = "batch 2; this TensorRT runner holds 1 request(s) (engines built with --max-batch 1)"
    assert left_out == [f"  left out: batch 2 past 0 seq 3 (planner, infiller): {held}",
                        f"  left out: batch 2 past 6 seq 1 (planner, infiller): {held}"]


def test_check_runs_batch_cases_on_batched_engines(peaky_export, fakes, tmp_path, monkeypatch):
    """Engines built with --max-batch 2 run the batch-2 cases too, each row a request of its own: rows
    packed into one execution of a decode profile, the infiller's prefill rows one by one."""
    from tests.fakes import _Context

    limits = DecodeLimits(max_prompt=16, gen_length=64, slot_size=4, serial_blocks=2, max_batch=2)
    ran: list[tuple[int, int]] = []  # (profile, rows) of every execution
    real = _Context.execute_async_v3
    monkeypatch.setattr(_Context, "execute_async_v3", lambda self, stream: ran.append(
        (self.profile, self.shapes["input_ids"][0])) or real(self, stream))
    lines: list[str] = []
    assert check.check_engines(fake_engines(peaky_export, tmp_path / "engines", limits), report=lines.append)
    assert "17 forwards of 11 cases" in lines[0] and not [line for line in lines if line.startswith("  left out:")]
    assert ran.count((1, 2)) == 1  # the infiller's batch 2 past 6 seq 1, packed; its past-0 case is a prefill
    assert ran.count((2, 2)) == 2  # the planner's two batch-2 cases, packed (its plan profile takes past 0)
    assert max(rows for profile, rows in ran if profile == 0) == 1  # prefills stay batch 1


def test_check_runs_only_the_cases_inside_the_profiles(peaky_export, fakes, tmp_path):
    limits = DecodeLimits(max_prompt=4, gen_length=8, slot_size=2, serial_blocks=2)  # blocks of 4 tokens
    lines: list[str] = []
    assert check.check_engines(fake_engines(peaky_export, tmp_path / "engines", limits), report=lines.append)
    left_out = [line.removeprefix("  left out: ") for line in lines if line.startswith("  left out:")]
    # the planner takes at most a block; the infiller's prefill profile takes past 0 up to prompt + block
    assert "batch 1 past 0 seq 5 (planner): seq 5 over past 0 (5 heads) lies outside the engine's planner profiles" in left_out
    for graph in ("planner", "infiller"):
        assert (f"batch 1 past 5 seq 6 in 3 rows ({graph}): seq 6 over past 5 (6 heads) lies outside the engine's {graph} "
                "profiles") in left_out
    assert not LOOP & {line.split(" (")[0] for line in left_out}  # the loop's forwards are sized to the limits


def test_check_fails_on_engines_of_another_model(peaky_export, exports, fakes, tmp_path, monkeypatch):
    engines = fake_engines(peaky_export, tmp_path / "engines")
    monkeypatch.setattr(check, "source_export", lambda m: ExportManifest.load(exports["fp32"]))
    lines: list[str] = []
    assert not check.check_engines(engines, report=lines.append)
    assert lines[-1].startswith("FAIL") and any("FAIL (over tolerance" in line for line in lines[:-1])


def test_validation_and_the_engines_check_run_the_same_cases(peaky_export, fakes, tmp_path, monkeypatch):
    from refusion.export import validate

    seen: dict[str, list[compare.Case]] = {}

    def spy(who: str):
        def run(test, reference, cases, *args):
            seen[who] = list(cases)
            return compare.compare_runners(test, reference, cases, *args)
        return run

    monkeypatch.setattr(validate, "compare_runners", spy("validation"))
    monkeypatch.setattr(check, "compare_runners", spy("engines"))
    assert validate.validate_export(peaky_export).ok
    assert check.check_engines(fake_engines(peaky_export, tmp_path / "engines"), report=lambda line: None)
    ours, theirs = seen["validation"], seen["engines"]
    assert [c.name for c in ours] == [c.name for c in theirs] and LOOP <= {c.name for c in ours}
    for a, b in zip(ours, theirs):  # limits 16 / 32 / 4 size the loop's cases as validation's defaults do
        assert a.graphs == b.graphs and a.feed.keys() == b.feed.keys()
        assert all(np.array_equal(a.feed[k], b.feed[k]) for k in a.feed), a.name


def test_check_refuses_a_changed_export_and_bf16(peaky_export, exports, fakes, tmp_path):
    engines = fake_engines(peaky_export, tmp_path / "engines")
    (peaky_export / "planner.onnx").write_bytes((peaky_export / "planner.onnx").read_bytes() + b" ")
    try:
        with pytest.raises(RefusionError, match="planner.onnx changed since the engines were built"):
            check.check_engines(engines)
    finally:
        (peaky_export / "planner.onnx").write_bytes((peaky_export / "planner.onnx").read_bytes()[:-1])
    with pytest.raises(RefusionError, match="bfloat16 engines; onnxruntime cannot feed"):
        check.check_engines(fake_engines(exports["bf16"], tmp_path / "bf16"))


def test_fp32_engines_are_compared_with_an_fp32_reference(monkeypatch):
    """onnxruntime's CUDA provider turns TF32 on for fp32 GEMMs by default; fp32 engines are built with it off,
    so their reference runs with it off too. Without CUDA the reference is the CPU."""
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert check.reference_providers("float32") == ["CPUExecutionProvider"]
    monkeypatch.setattr(onnxruntime, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert check.reference_providers("float32") == [("CUDAExecutionProvider", {"use_tf32": "0"}),
                                                    "CPUExecutionProvider"]
    assert check.reference_providers("float16") == ["CUDAExecutionProvider", "CPUExecutionProvider"]


def test_check_passes_on_an_int4_head_engine(peaky_int4_head, fakes, tmp_path):
    """An export with an int4 lm_head (--quantize-head): its engine's heads match onnxruntime on the shared cases."""
    lines: list[str] = []
    assert check.check_engines(fake_engines(peaky_int4_head, tmp_path / "engines"), report=lines.append)
    assert "  result: PASS" in lines
    assert any(line.startswith("  infiller argmax_ids") and line.endswith("ok") for line in lines)
