"""The bench's family cases (tools/bench/guides.py FAMILY_CASES): each asks the held-out examples of its family as
they are (their conversation, tools and schema) and scores an answer by the example's own: the right answer is
valid and accurate, a different answer the guide allows is valid and not accurate, an answer cut short is neither.
Fabricated results: no model."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("jsonschema")

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.request import FinishReason, GenerationResult, GenerationStats
from refusion.runtime.structured.tools import read_tools, tool_calls
from refusion.tools import families
from refusion.tools.bench.guides import FAMILY_BY_NAME as CASES
from refusion.tools.bench.guides import FAMILY_CASES, FamilyCase
from refusion.tools.tasks import Example

N = 8


def _result(text: str, finish: FinishReason, calls: list[dict[str, Any]] | None = None) -> GenerationResult:
    stats = GenerationStats(mode="ar", backend="fake", prompt_tokens=1, tokens=1, forwards={}, forward_count=1,
                            tokens_per_forward=1.0, tpf=1.0, wall_seconds=0.0, runner_seconds=0.0, loop_seconds=0.0,
                            tokens_per_second=0.0)
    return GenerationResult(text, [], [], stats, [], finish, tool_calls=calls)


def _right(case: FamilyCase, example: Example) -> GenerationResult:
    """What a model answering the example as its family does gives back: the call read out of the answer's text."""
    if example.call is not None:
        text, calls = tool_calls(example.answer)
        return _result(text, "tool_calls", calls)
    return _result(example.answer, "eos", [] if "tools" in case.guide(example) else None)


def _other(value: dict[str, Any]) -> dict[str, Any]:
    """Another value under the same schema: the answer, the robot's speed, or the first argument changed."""
    if "answer" in value:
        answer = value["answer"]
        return {"answer": answer + [0] if isinstance(answer, list) else answer + 1 if isinstance(answer, int) else answer + "0"}
    if "action" in value:
        return {**value, "speed": value.get("speed", 0) % 100 + 1}
    key, first = next(iter(value.items()))
    return {**value, key: first + 1 if isinstance(first, int) else first + "x"}


def _wrong(case: FamilyCase, example: Example) -> GenerationResult:
    """A different answer that the example's guide (or functions) still allow."""
    if example.call is not None:
        name, arguments = example.call
        call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(_other(arguments))}}
        return _result("", "tool_calls", [call])
    if "json_schema" in case.guide(example):
        return _result(json.dumps(_other(json.loads(example.answer))), "eos")
    return _result(example.answer + "0", "eos", [])


def test_each_family_case_asks_held_out_examples_of_its_family_as_they_are():
    assert list(CASES) == ["json-answer", "robot-command", "tool-call", "typed-call", "tool-choice", "tool-answer"]
    for case in FAMILY_CASES:
        examples = case.examples(N)
        assert len(examples) == N and all(case.picks(ex) for ex in examples), case.name
        held = families.held_out(case.family, families.HELD_OUT_RESERVED)
        assert all(ex in held for ex in examples), case.name
        for ex in examples:
            asks = case.asks(ex)
            assert asks["messages"] == ex.messages() and asks["max_tokens"] == case.max_tokens
            assert "gen_length" not in asks  # the export's blocks, as a client's request has them
            if "tools" in asks:
                assert asks["tools"] == list(ex.tools) and read_tools(asks["tools"], asks["tool_choice"])
    schemas = tuple(families.answer_schema(t) for t in ("list", "add", "sort"))  # integers, an integer, a string
    assert all(CASES["json-answer"].asks(ex)["json_schema"] == ex.schema in schemas for ex in CASES["json-answer"].examples(N))
    assert all(CASES["robot-command"].asks(ex)["json_schema"] == families.ROBOT_SCHEMA
               for ex in CASES["robot-command"].examples(N))
    for ex in CASES["tool-call"].examples(N):
        assert ex.call is not None and ex.call[0] in families.FUNCTIONS and CASES["tool-call"].asks(ex)["tool_choice"] == "required"
    chosen = CASES["tool-choice"].examples(N)
    assert all(CASES["tool-choice"].asks(ex)["tool_choice"] == "auto" and not ex.after for ex in chosen)
    assert {ex.call is None for ex in chosen} == {True, False}  # calls and plain answers
    for ex in CASES["typed-call"].examples(N):
        assert ex.call is not None and CASES["typed-call"].asks(ex)["tool_choice"]["function"]["name"] == ex.call[0]
    for ex in CASES["tool-answer"].examples(N):
        assert ex.after and ex.call is None and CASES["tool-answer"].asks(ex)["tool_choice"] == "auto"
    with pytest.raises(RefusionError, match="held-out examples; got n=100000"):
        CASES["tool-call"].examples(100_000)


@pytest.mark.parametrize("name", list(CASES))
def test_the_right_answer_is_accurate_and_another_valid_one_is_not(name):
    case = CASES[name]
    for ex in case.examples(N):
        right, wrong = _right(case, ex), _wrong(case, ex)
        assert case.valid(ex, right) and case.accurate(ex, right), (name, ex.prompt, right.text, right.tool_calls)
        assert case.valid(ex, wrong) and not case.accurate(ex, wrong), (name, ex.prompt, wrong.text, wrong.tool_calls)
        cut = _result(right.text, "length", right.tool_calls)  # the right text, but cut at max_tokens
        assert not case.valid(ex, cut) and not case.accurate(ex, cut), (name, ex.prompt)


def test_a_call_where_text_was_asked_and_text_where_a_call_was_are_neither_valid_nor_accurate():
    answer = CASES["tool-answer"].examples(1)[0]
    call = CASES["tool-call"].examples(1)[0]
    again = _right(CASES["tool-call"], call)  # the tool called again after its result
    assert not CASES["tool-answer"].valid(answer, again) and not CASES["tool-answer"].accurate(answer, again)
    plain = _result(call.answer, "eos", [])  # the call's markup left as text: no call read
    assert not CASES["tool-call"].valid(call, plain) and not CASES["tool-call"].accurate(call, plain)
