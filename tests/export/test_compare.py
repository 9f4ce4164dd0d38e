"""The one comparator (refusion.export.compare) without any backend: its report, its run order,
and the shared cases' feeds."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from refusion.export.compare import ROUNDED, CaseRunner, ComparisonReport, Tolerance, cases, compare_runners, feed_shape
from refusion.runtime.core.contract import GRAPH_NAMES
from refusion.runtime.core.embeddings import Embeddings
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.decode import masks

TOL = Tolerance(1e-4)
MANIFEST = SimpleNamespace(path="tiny", dtype="float16", vocab_size=50, mask_token_id=49, num_layers=2, kv_heads=2,
                           head_dim=4, embeddings=Embeddings(), takes_masks=False, candidates=8)


def _report(*outputs: tuple[str, dict, dict], tol: Tolerance = TOL) -> ComparisonReport:
    report = ComparisonReport("float32", tolerance=str(tol))
    for case, got, want in outputs:
        report.add(case, "infiller", got, want, tol)
    return report


def _line(report: ComparisonReport, output: str) -> str:
    return next(line for line in report.text().splitlines() if line.split()[1:2] == [output])


@pytest.mark.parametrize("bad, shown", [(np.nan, "nan"), (np.inf, "inf")])
def test_non_finite_outputs_show_as_such_in_any_row_order(bad, shown):
    fine = {"argmax_probs": np.full((1, 3), 0.5, np.float32)}
    broken = {"argmax_probs": np.array([[0.5, bad, 0.5]], np.float32)}
    for order in ([("a", broken, fine), ("b", fine, fine)], [("b", fine, fine), ("a", broken, fine)]):
        report = _report(*order)
        line = _line(report, "argmax_probs")
        assert f"max|diff| {shown} " in line and line.endswith("FAIL (non-finite output; first in case 'a')"), line
        assert not report.ok and report.text().endswith("result: FAIL")
    both = _report(("a", broken, broken))  # the same NaN on both sides is no agreement
    assert not both.ok and "FAIL (non-finite output" in _line(both, "argmax_probs")


def test_present_rows_are_one_line_naming_the_first_failing_layer():
    kv = np.zeros((1, 2, 2, 4), np.float32)
    got = {"present.0.key": kv, "present.1.key": kv + 1.0}
    line = _line(_report(("verify", got, {"present.0.key": kv, "present.1.key": kv})), "present.*")
    assert "max|diff| 1.00e+00" in line and line.endswith("FAIL (over tolerance; first in present.1.key, case 'verify')")


def test_shape_mismatch_and_missing_outputs_fail():
    got = {"argmax_probs": np.zeros((1, 3), np.float32), "input_probs": np.zeros((1, 3), np.float32)}
    report = _report(("c", got, {"argmax_probs": np.zeros((1, 4), np.float32)}))
    assert _line(report, "argmax_probs").endswith("FAIL (shape [1, 3], reference [1, 4]; first in case 'c')")
    assert _line(report, "input_probs").endswith("FAIL (missing from the reference; first in case 'c')")


def test_relative_tolerance_scales_with_the_reference():
    tol = Tolerance(1e-3, 1e-2)
    want = {"present.0.value": np.array([100.0, 1.0], np.float32)}
    assert _report(("c", {"present.0.value": np.array([100.5, 1.0], np.float32)}, want), tol=tol).ok
    assert not _report(("c", {"present.0.value": np.array([101.5, 1.0], np.float32)}, want), tol=tol).ok


def test_argmax_counts_only_mismatches_the_reference_logits_decide():
    logits = np.array([[[0.0, 5.0, 5.0000001], [9.0, 0.0, 0.0], [0.0, 0.0, 9.0]]], np.float32)
    want = {"argmax_ids": np.array([[2, 0, 2]]), "logits": logits}
    tie_flipped = {"argmax_ids": np.array([[1, 0, 2]])}
    assert _report(("c", tie_flipped, want)).ok  # position 0 is a tie
    decided = {"argmax_ids": np.array([[2, 1, 2]])}
    report = _report(("c", decided, want))
    assert not report.ok and "mismatches 1 " in _line(report, "argmax_ids")
    no_logits = {"argmax_ids": want["argmax_ids"]}  # then every mismatch counts, up to the allowed fraction
    assert not _report(("c", tie_flipped, no_logits)).ok
    assert _report(("c", tie_flipped, no_logits), tol=Tolerance(1e-4, argmax=0.34)).ok
    nan_logits = {"argmax_ids": want["argmax_ids"], "logits": np.full_like(logits, np.nan)}
    line = _line(_report(("c", want, nan_logits)), "argmax_ids")
    assert "mismatches nan" in line and "FAIL (non-finite reference logits" in line


def test_top_ids_count_only_swaps_of_ranks_the_reference_decides():
    logits = np.array([[[0.0, 3.0, 5.0, 5.0000001, 9.0]]], np.float32)  # ranks: 4, then 3 and 2 tied, then 1
    lp = np.sort(logits, axis=-1)[..., ::-1][..., :3] - 10.0
    want = {"top_ids": np.array([[[4, 3, 2]]]), "top_logprobs": lp, "logits": logits}
    assert _report(("c", {"top_ids": np.array([[[4, 2, 3]]])}, want)).ok  # the tied pair swapped
    report = _report(("c", {"top_ids": np.array([[[3, 4, 2]]])}, want))  # rank 0 is decided: 3 and 4 both wrong
    assert not report.ok and "mismatches 2 " in _line(report, "top_ids")
    # The last rank's neighbour outside the K is unknown without logits, so it counts as undecided; with them,
    # a K+1-th apart from it decides it.
    apart = np.array([[[0.0, 1.0, 3.0, 5.0, 9.0]]], np.float32)
    edge = {"top_ids": np.array([[[4, 3, 2]]]), "top_logprobs": np.array([[[9.0, 5.0, 3.0]]], np.float32) - 10.0}
    assert _report(("c", {"top_ids": np.array([[[4, 3, 1]]])}, edge)).ok
    assert not _report(("c", {"top_ids": np.array([[[4, 3, 1]]])}, {**edge, "logits": apart})).ok


def test_ids_tied_within_an_fp16_tolerance_may_swap_and_a_wrong_id_still_counts():
    """fp16 kernels reorder logits a few 1e-3 apart (the gpu check's own export: 4 such swaps in its top-K tail):
    within the tolerance a tie, in the argmax too, and an unlisted id only at the tail, tied with the K-th. fp32
    keeps the 1e-3 margin."""
    fp16, fp32 = Tolerance(2e-2), Tolerance(1e-4)
    logits = np.array([[[9.0, 6.0, 5.995, 4.0, 3.0, 2.995, 1.0]]], np.float32)  # ids 1 and 2, 4 and 5: 5e-3 apart
    lp = logits[..., :5] - 10.0
    want = {"top_ids": np.array([[[0, 1, 2, 3, 4]]]), "top_logprobs": lp, "logits": logits}

    def mismatches(top: list[int], tol: Tolerance) -> int:
        report = _report(("c", {"top_ids": np.array([[top]])}, want), tol=tol)
        assert report.ok == (report.rows[0][2] == 0)
        return int(report.rows[0][2])

    assert mismatches([0, 2, 1, 3, 4], fp16) == 0  # the near tie swapped
    assert mismatches([0, 1, 2, 3, 5], fp16) == 0  # id 5, unlisted, at the tail: within 2e-2 of the K-th
    assert mismatches([0, 2, 1, 3, 4], fp32) == 2 and mismatches([0, 1, 2, 3, 5], fp32) == 1
    assert mismatches([0, 1, 2, 3, 6], fp16) == 1  # id 6 is 2 below the K-th: a wrong id
    assert mismatches([0, 1, 2, 5, 4], fp16) == 1  # id 5 is no tie of rank 3
    assert mismatches([1, 0, 2, 3, 4], fp16) == 2  # a decided swap
    assert mismatches([0, 1, 1, 3, 4], fp16) == 1  # a repeated id
    assert mismatches([0, 1, 2, 3, 7], fp16) == 1  # out of the vocabulary
    near = np.array([[[0.0, 5.0, 5.005]]], np.float32)
    flipped = {"argmax_ids": np.array([[1]])}
    assert _report(("c", flipped, {"argmax_ids": np.array([[2]]), "logits": near}), tol=fp16).ok
    assert not _report(("c", flipped, {"argmax_ids": np.array([[2]]), "logits": near}), tol=fp32).ok


def test_a_reference_rounding_of_its_own_widens_limits_and_ties_by_that_much():
    """An fp16 export's reference is exact arithmetic with its own fp16 outputs beside (ROUNDED): each limit grows by
    that output's rounding error, ids tie within the logits' one; none given, the limits are the tolerance's; a
    non-finite rounded value (an overflow) widens nothing."""
    tol = Tolerance(2e-2)
    exact = {"top_logprobs": np.array([[[-1.0, -3.0]]], np.float32)}
    got = {"top_logprobs": exact["top_logprobs"] + 0.05}
    assert not _report(("c", got, exact), tol=tol).ok
    rounded = {**exact, ROUNDED + "top_logprobs": exact["top_logprobs"] - 0.04}  # the reference's fp16 run: 0.04 off
    assert _report(("c", got, rounded), tol=tol).ok  # 0.05 <= 2e-2 + 0.04
    assert not _report(("c", {"top_logprobs": got["top_logprobs"] + 0.02}, rounded), tol=tol).ok  # 0.07
    overflowed = {**exact, ROUNDED + "top_logprobs": np.array([[[np.inf, -3.0]]], np.float32)}
    assert not _report(("c", got, overflowed), tol=tol).ok
    logits = np.array([[[9.0, 5.0, 4.97, 1.0]]], np.float32)  # ids 1 and 2 0.03 apart: no tie at 2e-2
    want = {"top_ids": np.array([[[0, 1, 2]]]), "top_logprobs": logits[..., :3] - 10.0, "logits": logits}
    swapped = {"top_ids": np.array([[[0, 2, 1]]])}
    assert not _report(("c", swapped, want), tol=tol).ok
    noisy = {**want, ROUNDED + "logits": logits + np.float32([0.0, 0.0, 0.04, 0.0])}  # fp16 put id 2 above id 1
    assert _report(("c", swapped, noisy), tol=tol).ok
    assert not _report(("c", {"top_ids": np.array([[[1, 0, 2]]])}, noisy), tol=tol).ok  # 4 apart: still decided


def test_an_empty_report_does_not_pass_and_a_skipped_one_says_why():
    assert not ComparisonReport("float32").ok
    skipped = ComparisonReport("bfloat16", skipped="no bf16 MatMul")
    assert skipped.text() == "validation skipped: no bf16 MatMul"


class _Logged(CaseRunner):
    def __init__(self, name: str, log: list[str], batch1: bool = False):
        self.name, self.log, self.batch1 = name, log, batch1

    def __call__(self, graph, feed):
        self.log.append(f"{self.name} {graph}")
        return {"argmax_probs": feed["position_ids"].astype(np.float32)}

    def unsupported(self, graph, feed):
        return f"batch {feed_shape(feed)[0]}" if self.batch1 and feed_shape(feed)[0] != 1 else ""

    def close(self):
        self.log.append(f"{self.name} closed")


def test_runners_run_one_at_a_time_graph_by_graph_and_leave_out_what_they_cannot_take():
    shared = cases(MANIFEST)
    log: list[str] = []
    report = compare_runners(_Logged("trt", log, batch1=True), _Logged("ort", log), shared, TOL, "float16")
    assert report.ok and report.forwards == sum(len(c.graphs) for c in shared) - 4
    first_ort = log.index("ort planner")
    assert log.index("trt closed") < first_ort and all(e.startswith("ort") for e in log[first_ort:])
    for runner in ("trt", "ort"):  # every planner forward before any infiller forward
        graphs = [e.split()[1] for e in log if e.startswith(runner) and not e.endswith("closed")]
        assert graphs == sorted(graphs, key=GRAPH_NAMES.index)
    assert report.left_out == ["batch 2 past 0 seq 3 (planner, infiller): batch 2",
                               "batch 2 past 6 seq 1 (planner, infiller): batch 2"]
    assert "  left out: batch 2 past 0 seq 3 (planner, infiller): batch 2" in report.text()


def test_cases_are_explicit_feeds_with_the_loops_masks():
    shared = {c.name: c for c in cases(MANIFEST, prefix=6, block=4, slot=4)}
    for case in shared.values():
        feed = case.feed
        batch, seq, past = feed_shape(feed)
        assert feed["input_ids"].shape == feed["position_ids"].shape == (batch, seq)
        assert feed["input_ids"].dtype == feed["position_ids"].dtype == np.int64 and feed["attention_mask"].dtype == bool
        assert len(set(feed["position_ids"][0])) == seq and (feed["attention_mask"] == feed["attention_mask"][:1]).all()
        for i in range(MANIFEST.num_layers):
            for kind in ("key", "value"):
                assert feed[f"past_key_values.{i}.{kind}"].shape == (batch, past, 2, 4)
                assert feed[f"past_key_values.{i}.{kind}"].dtype == np.float16
    rows = shared["batch 1 past 5 seq 6 in 3 rows"].feed["attention_mask"]
    assert (rows == masks.rows_over_prefix(5, 0, 0, 0, 3, 2)).all()
    assert shared["batch 2 past 6 seq 1"].feed["attention_mask"].shape == (2, 1, 7)
    plan = shared["plan"]
    assert plan.graphs == ("planner",) and (plan.feed["input_ids"] == 49).all()
    assert (plan.feed["attention_mask"] == masks.causal_after(6, 4)).all()
    assert (shared["prefill+plan"].feed["attention_mask"] == masks.causal_after(0, 10)).all()
    slot_rows = shared["slot rows"]  # two rows of 2 slots, 1 accepted each, over prompt + scratch
    assert slot_rows.graphs == GRAPH_NAMES
    assert (slot_rows.feed["attention_mask"] == masks.rows_over_prefix(6, 2, 2, 1, 2, 1)).all()
    assert slot_rows.feed["position_ids"].tolist() == [[7, 9]]
    assert feed_shape(shared["ar step"].feed) == (1, 1, 6)
    with pytest.raises(RefusionError, match="numpy holds no bfloat16 KV"):
        cases(SimpleNamespace(**{**vars(MANIFEST), "dtype": "bfloat16"}))
