"""llguidance behind the engine interface, over the embedded model's character vocabulary and the fixture's
byte-level BPE one: guides compile once, are refused whole when any part cannot be enforced, and their matchers
allow, validate, force and roll back as the guided loop reads them."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytest.importorskip("llguidance")

from refusion.runtime.core.contract import mask_bytes
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.structured.engine import Guides, Vocabulary
from refusion.runtime.structured.guide import Guide
from refusion.runtime.tokenizer import Tokenizer
from tests.helpers import REPO

ROBOT = {"type": "object", "properties": {"action": {"enum": ["left", "right", "stop"]},
                                          "speed": {"type": "number", "minimum": 0, "maximum": 2, "multipleOf": 0.1}},
         "required": ["action", "speed"], "additionalProperties": False}


def guides(tokenizer: Tokenizer, size: int) -> Guides:
    token_bytes, special = tokenizer.token_bytes()
    return Guides(Vocabulary(token_bytes, special, size, tokenizer.eos_token_id or 0, tokenizer.encode))


TINY_VOCAB = 108  # the embedded model's vocabulary: its tokenizer's ids, the graphs' too


@pytest.fixture(scope="module")
def tiny_guides() -> tuple[Tokenizer, Guides]:
    tok = Tokenizer.from_dir(REPO / "models" / "refusion-tiny")
    return tok, guides(tok, TINY_VOCAB)


def allowed(tok: Tokenizer, matcher, size: int = TINY_VOCAB) -> list[str]:
    out = np.zeros(mask_bytes(size), np.uint8)
    matcher.allowed(out)
    return [tok.decode([i], skip_special_tokens=False) for i in np.flatnonzero(np.unpackbits(out, bitorder="little"))]


def test_a_schema_forces_its_keys_and_separators_and_allows_its_values(tiny_guides):
    tok, g = tiny_guides
    m = g.compile(Guide("json_schema", json.dumps(ROBOT), "json_schema")).matcher()
    assert tok.decode(m.forced()) == '{"action": "'  # strict whitespace, Python's separators: fixed layout
    m.consume(m.forced())
    assert allowed(tok, m) == ["l", "r", "s"]
    m.consume(tok.encode("ri"))
    assert tok.decode(m.forced()) == 'ght", "speed": '
    m.consume(m.forced())
    assert m.valid(tok.encode("0.3}")) == 4 and m.valid(tok.encode("0.35}")) == 3  # multipleOf 0.1
    m.consume(tok.encode("1.5}"))
    assert m.finished and allowed(tok, m) == ["<|im_end|>"] and m.forced() == []


def test_each_matcher_of_a_grammar_starts_at_its_beginning_whatever_the_others_did(tiny_guides):
    """A request's matcher is a copy of one the grammar keeps: what one request consumes, or a dead end it reaches,
    moves neither that one nor the next request's."""
    tok, g = tiny_guides
    grammar = g.compile(Guide("json_schema", json.dumps(ROBOT), "json_schema"))
    first = grammar.matcher()
    first.consume(first.forced())
    first.consume(tok.encode("ri"))
    second = grammar.matcher()
    assert tok.decode(second.forced()) == '{"action": "'
    with pytest.raises(RefusionError):
        second.consume(tok.encode("}"))  # refused: llguidance's matcher is in error for good
    third = grammar.matcher()
    third.consume(third.forced())
    assert allowed(tok, third) == ["l", "r", "s"]
    assert tok.decode(first.forced()) == 'ght", "speed": '


def test_a_schemas_forced_stretches_are_tokenized_once_whatever_the_requests():
    """llguidance asks for the tokens of each forced stretch ('{"action": "', '", "speed": ') at every request: the
    short ones are kept, so the tokenizer sees each once, and every request is forced the same tokens."""
    tok = Tokenizer.from_dir(REPO / "models" / "refusion-tiny")
    texts: list[str] = []

    def encode(text: str) -> list[int]:
        texts.append(text)
        return tok.encode(text)

    token_bytes, special = tok.token_bytes()
    grammar = Guides(Vocabulary(token_bytes, special, TINY_VOCAB, tok.eos_token_id, encode)).compile(
        Guide("json_schema", json.dumps(ROBOT), "json_schema"))
    runs = []
    for _ in range(3):
        m = grammar.matcher()
        run = m.forced()
        m.consume(run + tok.encode("ri"))
        runs.append((run, m.forced()))
    assert tok.decode(runs[0][0]) == '{"action": "' and tok.decode(runs[0][1]) == 'ght", "speed": '
    assert runs[1] == runs[2] == runs[0]
    assert texts and len(texts) == len(set(texts)), texts


def test_masks_along_a_draft_are_the_masks_after_each_of_its_prefixes(tiny_guides):
    tok, g = tiny_guides
    m = g.compile(Guide("regex", r"[ab]+c", "regex")).matcher()
    draft = tok.encode("abc")
    along = np.zeros((4, mask_bytes(TINY_VOCAB)), np.uint8)
    m.allowed_along(draft, along)
    for j in range(4):
        fresh = g.compile(Guide("regex", r"[ab]+c", "regex")).matcher()
        fresh.consume(draft[:j])
        expected = np.zeros(mask_bytes(TINY_VOCAB), np.uint8)
        fresh.allowed(expected)
        assert np.array_equal(along[j], expected), j
    assert m.valid(draft) == 3  # where it was: nothing consumed


def test_rollback_gives_back_what_was_consumed(tiny_guides):
    tok, g = tiny_guides
    m = g.compile(Guide("choice", '["left", "right"]', "choice")).matcher()
    m.consume(tok.encode("le"))
    m.rollback(2)
    assert allowed(tok, m) == ["l", "r"]


def test_each_guide_compiles_once_per_generator(tiny_guides):
    _, g = tiny_guides
    first = g.compile(Guide("regex", r"\d{3}", "regex"))
    assert g.compile(Guide("regex", r"\d{3}", "regex")).grammar is first.grammar  # cached by kind and source
    again = g.compile(Guide("regex", r"\d{3}", "guided_regex"))
    assert again.grammar is first.grammar and again.field == "guided_regex"  # the field names it only
    assert g.compile(Guide("regex", r"\d{4}", "regex")).grammar is not first.grammar


@pytest.mark.parametrize("guide, message", [
    (Guide("json_schema", '{"type": "array", "uniqueItems": true}', "json_schema"),
     'json_schema is not a guide llguidance can enforce: Unimplemented keys: \\["uniqueItems"\\]'),
    (Guide("json_schema", '{"type": "object", "not": {"required": ["a"]}}', "response_format.json_schema.schema"),
     "response_format.json_schema.schema is not a guide"),
    (Guide("json_schema", '{"type": "string", "minLength": 3, "maxLength": 1}', "json_schema"), "Unsatisfiable"),
    (Guide("json_schema", '{"type": "wat"}', "json_schema"), "Invalid type: wat"),
    (Guide("json_schema", '{"$ref": "#/defs/x"}', "json_schema"), "does not exist"),
    (Guide("regex", "(a|b", "regex"), "(?s)regex is not a guide llguidance can enforce: .*unclosed group"),
    (Guide("regex", "(?<=a)b", "regex"), "look-around"),
    (Guide("grammar", "start: x\n", "grammar"), "grammar is not a guide"),
])
def test_a_guide_the_engine_cannot_enforce_is_refused_naming_its_field(tiny_guides, guide, message):
    with pytest.raises(RefusionError, match=message):
        tiny_guides[1].compile(guide)


def test_ids_past_the_tokenizers_are_never_allowed(tiny_guides):
    tok, _ = tiny_guides
    g = guides(tok, 160)  # a model vocabulary larger than its tokenizer's, as Qwen3's is
    m = g.compile(Guide("regex", ".+", "regex")).matcher()
    out = np.zeros(mask_bytes(160), np.uint8)
    assert m.allowed(out)
    bits = np.unpackbits(out, bitorder="little")
    assert bits[:100].any() and not bits[TINY_VOCAB:].any()


def test_byte_level_vocabularies_read_through_their_alphabet(tmp_path):
    from refusion.tools.checks.fixtures.tokenizer_files import write_tokenizer

    write_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    token_bytes, special = tok.token_bytes()
    text = "Grüße, 日本語 🙂 {\"a\": [1, 2]}\n"
    assert b"".join(token_bytes[i] for i in tok.encode(text)) == text.encode()
    assert [token_bytes[i] for i in special] == [b"<|endoftext|>", b"<|im_start|>", b"<|im_end|>", b"<|mask|>"]
    m = guides(tok, 384).compile(Guide("choice", '["Grüße", "日本語"]', "choice")).matcher()
    assert m.valid(tok.encode("日本語")) == len(tok.encode("日本語"))


def test_requests_asking_for_a_guide_while_it_compiles_wait_for_that_compile(tiny_guides, monkeypatch):
    """Concurrent compiles of one guide are merged (what SGLang does with its cache entry): the engine compiles it
    once, and every request gets it; a refusal is each request's own, naming its field."""
    import threading
    from concurrent.futures import Future

    from refusion.runtime.structured import engine as engine_module
    from refusion.runtime.structured.engine import GrammarEngine

    tok, _ = tiny_guides
    g = guides(tok, TINY_VOCAB)
    release, asked, calls = threading.Event(), threading.Event(), []  # asked: a second request waits, or compiles

    class Held(GrammarEngine):
        def __init__(self, inner: GrammarEngine):
            self.inner, self.name = inner, inner.name

        def compile(self, guide: Guide):
            calls.append(guide.field)
            if len(calls) > 1:
                asked.set()
            release.wait(timeout=30)  # held until the second request has asked (the timeout only guards a hang)
            return self.inner.compile(guide)

    class Watched(Future):
        def result(self, timeout=None):
            asked.set()
            return super().result(timeout)

    monkeypatch.setattr(engine_module, "Future", Watched, raising=False)
    g.wrap(Held)
    got: dict[str, object] = {}
    first = threading.Thread(target=lambda: got.update(a=g.compile(Guide("regex", r"\d{2}", "regex"))))
    first.start()
    while not calls:  # the first compile has begun
        first.join(timeout=0.01)
    second = threading.Thread(target=lambda: got.update(b=g.compile(Guide("regex", r"\d{2}", "guided_regex"))))
    second.start()
    asked.wait(timeout=30)
    release.set()
    first.join(timeout=30)
    second.join(timeout=30)
    assert calls == ["regex"] and got["a"].grammar is got["b"].grammar and got["b"].field == "guided_regex"
    for field in ("json_schema", "response_format.json_schema.schema"):  # refused: each names its own field
        with pytest.raises(RefusionError, match=f"^{re.escape(field)} is not a guide"):
            g.compile(Guide("json_schema", '{"type": "array", "uniqueItems": true}', field))


def test_a_compile_past_its_limit_is_refused_as_the_fields_error(tiny_guides, monkeypatch):
    import time

    from refusion.runtime.structured import engine as engine_module
    from refusion.runtime.structured.engine import GrammarEngine

    tok, _ = tiny_guides
    g = guides(tok, TINY_VOCAB)

    class Slow(GrammarEngine):
        def __init__(self, inner: GrammarEngine):
            self.inner, self.name = inner, inner.name

        def compile(self, guide: Guide):
            t0 = time.thread_time()
            while time.thread_time() - t0 < 0.05:  # 50 ms of this thread's CPU, on any machine
                pass
            return self.inner.compile(guide)

    monkeypatch.setattr(engine_module, "COMPILE_LIMIT_S", 0.02)
    g.wrap(Slow)
    with pytest.raises(RefusionError, match=r"^regex took 0\.\d s of the grammar engine's work to compile, over the "
                                            r"0\.02 s a guide may take"):
        g.compile(Guide("regex", "[0-9]+", "regex"))
    monkeypatch.setattr(engine_module, "COMPILE_LIMIT_S", 2.0)
    assert g.compile(Guide("regex", "[0-9]+", "regex")).field == "regex"  # refused, not cached: compiled again


def test_tool_choice_auto_allows_a_valid_call_or_text_without_one(tiny_guides):
    """auto's guide (Tools.guide): one call valid under its function's parameters, or text in which the opening tag
    never appears; a call begun and garbled (what ReFusion's unguided drafts wrote) is cut where it goes wrong."""
    from refusion.runtime.structured.tools import read_tools

    tok, g = tiny_guides
    room = {"type": "object", "properties": {"room": {"type": "string"}}, "required": ["room"]}
    tools = read_tools([{"type": "function", "function": {"name": "lights_on", "parameters": room}}], "auto")
    guide = tools.guide()
    assert guide is not None and guide.kind == "tool_call"
    m = g.compile(guide).matcher()
    assert m.forced() == []  # a call or text: nothing is certain at the start
    call = tok.encode('<tool_call>\n{"name": "lights_on", "arguments": {"room": "den"}}\n</tool_call>')
    assert tok.decode(call[:1], skip_special_tokens=False) == "<tool_call>" and m.valid(call) == len(call)
    garbled = tok.encode('<tool_call>\n{"name": "lights_of"')
    assert m.valid(garbled) == len(garbled) - 2  # "lights_o" is a prefix of the name; "f" is refused
    text = tok.encode("The den light is on.")
    assert m.valid(text) == len(text)
    assert m.valid(tok.encode("ok <tool_call>")) == len(tok.encode("ok "))  # no call inside text
    m.consume(text)
    assert "<|im_end|>" in allowed(tok, m)
