"""The structured bench's arithmetic (tools/bench/measure/structured.py): tokens/s of a method over repeats, the
family cases grouped by family and by whether a guide shaped them, and the whole guided set. A stub generator
answers every family example rightly, ReFusion in fewer forwards than AR; no model."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("jsonschema")

from refusion.runtime.request import GenerationResult, GenerationStats
from refusion.runtime.structured.tools import tool_calls
from refusion.tools.bench.guides import FAMILY_CASES
from refusion.tools.bench.measure import structured


def test_tokens_per_second_are_a_repeats_tokens_over_its_median_seconds():
    tally = structured.Tally(tokens=30, forwards=10, requests=2, seconds=[2.0, 4.0, 3.0])  # tokens counted once
    summary = tally.summary()
    assert summary["tokens_per_second"] == 10.0 and summary["tokens_per_forward"] == 3.0


class _Stub:
    """Answers each family example with its own answer: `tokens` tokens in `tokens` forwards (AR) or 4 (ReFusion)."""

    def __init__(self) -> None:
        self.asked: list[dict[str, Any]] = []

    def generate(self, messages: list[dict[str, Any]], mode: str, **asks: Any) -> GenerationResult:
        self.asked.append({"messages": messages, "mode": mode, **asks})
        example = next(ex for case in FAMILY_CASES for ex in case.examples(2)  # the same prompt may be framed or called
                       if ex.messages() == messages and list(ex.tools) == asks.get("tools", []))
        text, calls = tool_calls(example.answer) if example.call else (example.answer, [])
        tokens = len(example.answer)
        forwards = 4 if mode == "refusion" else tokens
        stats = GenerationStats(mode=mode, backend="stub", prompt_tokens=1, tokens=tokens, forwards={},
                                forward_count=forwards, tokens_per_forward=0.0, tpf=0.0, wall_seconds=0.0,
                                runner_seconds=forwards * (0.002 if mode == "refusion" else 0.001),
                                loop_seconds=forwards * 0.0005, tokens_per_second=0.0)
        finish = "tool_calls" if calls else "eos"
        return GenerationResult(text, [], [], stats, [], finish, tool_calls=calls or ([] if "tools" in asks else None))


def test_family_cases_are_grouped_by_family_and_by_guide():
    stub = _Stub()
    out = structured.run_families(stub, 2, 1)  # type: ignore[arg-type]
    groups = ["json family", "robot family", "tool family", "typed family", "guided"]
    assert list(out) == [case.name for case in FAMILY_CASES] + groups
    assert len(stub.asked) == 2 * 2 * len(FAMILY_CASES)  # each example, each method
    # the method first on a prompt (its prefill not yet cached) rotates: ReFusion on the first, AR on the second
    assert [ask["mode"] for ask in stub.asked[:4]] == ["refusion", "ar", "ar", "refusion"]
    for name, runs in out.items():
        assert runs["refusion"]["accuracy"] == runs["ar"]["accuracy"] == 1.0, name
        assert runs["refusion"]["ended"] == 1.0 and runs["ratios"]["tokens_per_forward"] > 1, name
        assert runs["refusion"]["runner_ms_per_forward"] == 2.0 and runs["ar"]["runner_ms_per_forward"] == 1.0, name
        assert runs["refusion"]["loop_ms_per_forward"] == runs["ar"]["loop_ms_per_forward"] == 0.5, name
    assert out["guided"]["ar"]["requests"] == 2 * len(FAMILY_CASES)  # every case carries a guide
    assert out["tool family"]["ar"]["requests"] == 2 * sum(case.family == "tool" for case in FAMILY_CASES)
    tokens = sum(len(ex.answer) for case in FAMILY_CASES for ex in case.examples(2))
    assert out["guided"]["ar"]["tokens"] == out["guided"]["ar"]["forwards"] == tokens


def test_the_whole_set_weighs_each_part_by_its_tokens_and_seconds():
    def part(tokens: int, per_second: float, forwards: int, requests: int) -> dict[str, Any]:
        return {"tokens": tokens, "tokens_per_second": per_second, "forwards": forwards, "requests": requests}

    cases = {"choice": {"refusion guided": part(100, 100.0, 10, 4), "ar guided": part(100, 50.0, 50, 4),
                        "refusion unguided": part(1, 1.0, 1, 1)},
             "tool": {"refused": "no tool format"}}
    families = {"guided": {"refusion": part(300, 300.0, 30, 6), "ar": part(300, 100.0, 150, 6)}}
    whole = structured.whole_set(cases, families)
    assert whole["requests"] == 10
    assert whole["refusion"]["tokens_per_second"] == 200.0 and whole["ar"]["tokens_per_second"] == 80.0  # 400 / 5 s
    assert whole["ratios"]["tokens_per_second"] == 2.5 and whole["ratios"]["tokens_per_forward"] == 5.0

