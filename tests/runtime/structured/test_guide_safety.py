"""A guide can neither stall the Generator nor pass off a broken answer as complete (reliability probe 5): guide work
runs under a budget, a guide that can never be followed to an answer is refused before any work, naming its field
(and the characters the vocabulary cannot write), a dead end mid-answer ends `dead_end`, never `eos`, and a choice of
thousands of strings compiles as an enum does."""

from __future__ import annotations

import json
import re
import threading
import time

import numpy as np
import pytest

pytest.importorskip("llguidance")

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import Generator
from refusion.runtime.structured.engine import BUDGET_MS, Budgeted, Grammar, GrammarEngine, Matcher
from refusion.runtime.structured.guide import Guide

MODES = ["refusion", "ar"]
AMBIGUOUS = 'start: s\ns: s s s | s s | "a" | "b"\n'  # the probe's worst: Earley work that grows with every token

# Guides with no answer at all, or none this vocabulary can write: each is refused when submitted.
NEVER = [
    ({"grammar": 'start: a\na: a "x"\n'}, "its language holds no answer"),  # G08: a rule that never ends
    ({"grammar": "start: start\n"}, "its language holds no answer"),  # G09
    ({"regex": r"ab[^\s\S]"}, "its language holds no answer"),  # X6: a class that matches nothing
    ({"json_schema": {"type": "object", "properties": {"k": {"$ref": "#/$defs/a"}}, "required": ["k"],
                      "$defs": {"a": {"$ref": "#/$defs/a"}}}}, "its language holds no answer"),  # 2a: circular $ref
    ({"json_schema": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
     "its language holds no answer"),  # J13
    ({"json_schema": {"$defs": {"n": {"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}, "required": ["x"]}},
                      "$ref": "#/$defs/n"}}, "the grammar engine gave up on its opening .*Too many items"),  # J12
    ({"regex": "a{4294967295}"}, "the grammar engine gave up on its opening .*lexer"),  # R10
    ({"choice": ["é", "ü"]}, "this model's vocabulary cannot write 'é', 'ü'"),  # X1: the embedded model is ASCII
    ({"regex": "x(日|本)"}, "this model's vocabulary cannot write '日', '本'"),  # X2
    ({"regex": "日本語"}, "this model's vocabulary cannot write '日', '本', '語'"),  # D02
    ({"json_schema": {"const": "café"}}, "this model's vocabulary cannot write 'é'"),  # 5b
]


@pytest.mark.parametrize("guide, why", NEVER, ids=[f"{next(iter(g))}-{i}" for i, (g, _) in enumerate(NEVER)])
def test_a_guide_with_no_writable_answer_is_refused_at_submit_naming_its_field(tiny, guide, why):
    field = next(iter(guide))
    with pytest.raises(RefusionError, match=f"^{field} can never be followed to a complete answer: {why}") as e:
        tiny.submit("hi", chat=True, **guide)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400  # one line, never the engine's state
    assert tiny.scheduler.in_flight == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_dead_end_mid_answer_ends_dead_end_with_the_text_so_far_streamed_or_not(tiny, mode):
    # Either first character leads into a rule with no end: the guide allows neither a token nor the EOS after it.
    grammar = 'start: "a" d | "b" d\nd: d "x"\n'
    result = tiny.generate("hi", chat=True, mode=mode, grammar=grammar)
    assert result.finish_reason == "dead_end" and result.text in ("a", "b")
    assert "".join(tiny.stream("hi", chat=True, mode=mode, grammar=grammar)) == result.text


@pytest.mark.parametrize("mode", MODES)
def test_a_choice_of_thousands_compiles_as_an_enum_does_and_its_strings_are_literal(tiny, mode):
    many = [f"c{i}" for i in range(7000)]  # an Earley alternation of 2,000 or more failed on its first token
    assert tiny.generate("hi", chat=True, mode=mode, choice=many).text in many
    odd = ["a.b|c", "(x)*+?", "[^q]{2}", "back\\slash", "$^#&-~", "new\nline"]
    for chosen in odd:  # each string forced whole: its regex meta characters are literal
        assert tiny.generate("hi", chat=True, mode=mode, choice=[chosen]).text == chosen
    assert tiny.generate("hi", chat=True, mode=mode, choice=odd).text in odd


def test_a_grammar_of_2500_rules_is_decoded(tiny):
    rules = "".join(f'r{i}: "a" r{i + 1} | "b"\n' for i in range(2499))  # G07: refused mid-answer by the row limit
    text = tiny.generate("hi", chat=True, grammar=f'start: r0\n{rules}r2499: "z"\n').text
    assert re.fullmatch(r"a*b|a{2499}z", text)


class _Spinning(Matcher):
    """A matcher whose masks take `ms` of this thread's CPU time each (a guide's work, whatever the machine)."""

    def __init__(self, ms: float):
        self.ms = ms

    def allowed(self, out: np.ndarray) -> bool:
        t0 = time.thread_time()
        while time.thread_time() - t0 < self.ms / 1e3:
            pass
        out[:] = 255
        return True

    def valid(self, tokens) -> int:
        return len(tokens)

    def consume(self, tokens) -> None:
        pass

    def rollback(self, count: int) -> None:
        pass

    def forced(self) -> list[int]:
        return []

    @property
    def finished(self) -> bool:
        return False


def test_the_budget_counts_the_guides_cpu_time_a_token_and_names_the_field():
    out = np.empty((3, 4), np.uint8)
    assert Budgeted(_Spinning(5), "grammar", budget_ms=100).allowed(out[0])
    with pytest.raises(RefusionError, match=r"^grammar took \d+\.\d ms of the grammar engine's work for 1 token\(s\) "
                                            r"\(a mask\), over this server's budget of 2 ms a token"):
        Budgeted(_Spinning(5), "grammar", budget_ms=2).allowed(out[0])
    # masks along a draft of two tokens: three masks, three tokens' budget
    Budgeted(_Spinning(4), "json_schema", budget_ms=5).allowed_along([1, 2], out)


class _Costly(Matcher):
    """A real matcher whose masks each take `ms` more of this thread's CPU: a costly guide, on any machine."""

    def __init__(self, inner: Matcher, ms: float):
        self.inner, self.spin = inner, _Spinning(ms)

    def allowed(self, out: np.ndarray) -> bool:
        self.spin.allowed(out.copy())
        return self.inner.allowed(out)

    def allowed_along(self, draft, out: np.ndarray) -> None:
        self.spin.allowed(out[0].copy())
        self.inner.allowed_along(draft, out)

    def valid(self, tokens) -> int:
        return self.inner.valid(tokens)

    def consume(self, tokens) -> None:
        self.inner.consume(tokens)

    def rollback(self, count: int) -> None:
        self.inner.rollback(count)

    def forced(self) -> list[int]:
        return self.inner.forced()

    @property
    def finished(self) -> bool:
        return self.inner.finished


class _CostlyEngine(GrammarEngine):
    def __init__(self, inner: GrammarEngine, ms: float):
        self.inner, self.ms, self.name = inner, ms, inner.name

    def compile(self, guide: Guide) -> Grammar:
        grammar, ms = self.inner.compile(guide), self.ms

        class Costly(Grammar):
            width = grammar.width

            def matcher(self) -> Matcher:
                return _Costly(grammar.matcher(), ms)

        return Costly()


def test_a_costly_guide_shares_the_scheduler_thread_and_does_not_step_in_every_round(exports):
    """A guided request whose steps each take 30 ms of the thread's CPU sits out the rounds after each, while others
    run: a neighbour's eight-token answer (eight rounds) meets one or two of its steps, not one a round."""
    with Generator.from_dir(exports["fp32"], backend="ort-cpu", threads=1, max_requests=2, max_batch=2,
                            guide_budget_ms=10_000) as gen:
        gen.guides.wrap(lambda engine: _CostlyEngine(engine, 30))
        costly = gen.submit("hi", mode="ar", regex="[ab]{200}")
        pieces = iter(costly)
        next(pieces), next(pieces)  # it runs, and owes the thread
        before = len(costly.commits)
        neighbour = gen.generate("hello", mode="ar", max_tokens=8)
        during = len(costly.commits) - before
        costly.cancel()
    assert neighbour.finish_reason == "length" and neighbour.stats.forward_count >= 8
    assert during <= neighbour.stats.forward_count // 2, f"the costly guide stepped {during} times in its neighbour's life"


def test_a_budget_is_a_positive_number_of_milliseconds(tiny_export):
    for bad in (0, -1.0, float("nan"), True, "20"):
        with pytest.raises(RefusionError, match=r"guide_budget_ms=.* \(--guide-budget-ms\) must be a positive number"):
            Generator.from_dir(tiny_export, backend="ort-cpu", threads=1, guide_budget_ms=bad)


@pytest.mark.parametrize("mode", MODES)
def test_the_ambiguous_grammar_ends_by_its_budget_while_others_are_answered_and_the_gil_is_free(exports, mode):
    """The probe's 36-byte grammar: its work grows with every token. It ends with an error naming its field once a
    token's work passes the budget; a 1 ms ticker thread (what keeps /health answered) never waits 50 ms for the
    GIL, and a neighbour's requests are answered while it runs."""
    with Generator.from_dir(exports["fp32"], backend="ort-cpu", threads=1, max_requests=2, max_batch=2) as gen:
        worst, done = [0.0], threading.Event()

        def tick() -> None:
            last = time.perf_counter()
            while not done.is_set():
                time.sleep(0.001)
                now = time.perf_counter()
                worst[0], last = max(worst[0], now - last), now

        ticker = threading.Thread(target=tick)
        ticker.start()
        try:
            request = gen.submit("hi", mode=mode, grammar=AMBIGUOUS)
            answered = 0
            while not request.done:  # a neighbour, four tokens at a time, for as long as the grammar runs
                assert gen.generate("hello", mode="ar", max_tokens=4).finish_reason == "length"
                answered += 1
            with pytest.raises(RefusionError, match=rf"^grammar took .* over this server's budget of {BUDGET_MS:g} "
                                                    r"ms a token; simplify the guide"):
                request.result()
        finally:
            done.set()
            ticker.join()
    assert answered >= 1
    assert worst[0] < 0.050, f"a thread waited {worst[0] * 1e3:.0f} ms for the GIL"


# Guides the random model (which writes anything the guide allows) follows: valid answers, or cut ones.
SCHEMAS = [
    {"type": "object", "properties": {"action": {"enum": ["left", "right", "stop"]}, "speed": {"type": "number"}},
     "required": ["action", "speed"]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "maxItems": 3},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {"anyOf": [{"type": "boolean"}, {"type": "null"}, {"const": "n/a"}]},
    {"type": "object", "properties": {"k": {"$ref": "#/$defs/tree"}}, "required": ["k"],
     "$defs": {"tree": {"type": "object", "properties": {"v": {"type": "integer"},
                                                         "kids": {"type": "array", "items": {"$ref": "#/$defs/tree"},
                                                                  "maxItems": 2}},
                        "required": ["v"]}}},
]
REGEXES = [r"[a-c]{1,3}@[a-c]{2}\.(com|org)", r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)!?"]
# Grammars with a branch that leads nowhere (2b): the language is the regex beside each.
GRAMMARS = [('start: "go" | "stop" d\nd: d "x"\n', "go"), ('start: "a"+ | "b" "c" d\nd: d "x"\n', "a+")]


def _valid(kind: str, guide, text: str) -> bool:
    if kind == "grammar":
        return re.fullmatch(dict(GRAMMARS)[guide], text) is not None
    if kind == "json_schema":
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), guide)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    return re.fullmatch(guide, text) is not None


@pytest.mark.parametrize("mode", MODES)
def test_an_answer_that_breaks_its_guide_never_ends_but_by_length_or_a_dead_end(random_model, mode):
    cases = [("json_schema", s) for s in SCHEMAS] + [("regex", r) for r in REGEXES] + [("grammar", g) for g, _ in GRAMMARS]
    for kind, guide in cases:
        for seed in range(3):
            kw = {kind: guide, "mode": mode, "temperature": 1.0, "seed": seed, "max_tokens": 64}
            result = random_model.generate("the answer", **kw)
            assert _valid(kind, guide, result.text) or result.finish_reason in ("length", "dead_end"), (guide, result)
            assert result.finish_reason in ("eos", "length", "dead_end")
            assert "".join(random_model.stream("the answer", **kw)) == result.text
