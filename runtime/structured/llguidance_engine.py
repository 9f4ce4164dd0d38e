"""llguidance (Microsoft's guidance engine, what onnxruntime-genai and llama.cpp use) behind engine.py's interface.
Imported only when a request brings a guide: `pip install 'refusion-trt[structured]'`.

JSON schemas compile with strict whitespace and Python's separators (", " and ": ", what json.dumps writes): the
answer's layout is then fixed, so the guide forces every key, brace and separator (tokens without forwards) and a
schema whose values are bounded has a bounded answer. A schema's own "x-guidance" object overrides these
(llguidance's JSON options, e.g. {"whitespace_flexible": true}). Anything llguidance reports about a guide, an
error or a warning that it would leave part of it unenforced, refuses it. A choice compiles as one regular expression
of its strings, as an enum does (a grammar alternation of N strings is an Earley row of N items, which the parser's
row limit refuses past 2,000).

Every call runs under LIMITS, llguidance's bounds on one call's work, set below its defaults so that no call holds
the GIL for long (its forced tokens and commits hold it; its masks do not): the lexer's fuel bounds a compile and a
forced run (`a{4294967295}` forced 250,001 tokens in 0.5-0.8 s at the default; 25,001 in 40 ms here), the items of
one step bound a mask or a forced run on an Earley grammar (a schema with no finite instance: 260 ms at the
default). A schema of 64 KiB, an enum of 7,400 strings and a regex of 7,000 branches compile under them in 15-35 ms.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from refusion.runtime.core.contract import mask_bytes
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.structured.engine import Grammar, GrammarEngine, Matcher, Vocabulary
from refusion.runtime.structured.guide import Guide, ToolCallGuide

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
INSTALL = "pip install 'refusion-trt[structured]'"
LIMITS = {"initial_lexer_fuel": 100_000, "step_max_items": 10_000}  # defaults: 1,000,000 and 50,000
MEMO_TEXTS, MEMO_CHARS = 4096, 256  # forced texts whose tokens are kept, and the longest kept
DEAD_END = "NoExtensionBias"  # what llguidance's error reads where the answer can be neither continued nor ended
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")  # what llguidance's regex syntax (Rust's regex-syntax) takes as syntax


def make_engine(vocabulary: Vocabulary) -> LLGuidance:
    try:
        import llguidance
    except ImportError:
        raise RefusionError(f"structured output needs llguidance, which is not installed: {INSTALL}.") from None
    return LLGuidance(llguidance, vocabulary)


class _Tokens:
    """The vocabulary as llguidance's TokenizerWrapper reads a tokenizer: each id's bytes, the special ids. Ids the
    graphs have past the tokenizer's are special tokens of their own, which no guide allows."""

    def __init__(self, vocabulary: Vocabulary):
        known = len(vocabulary.token_bytes)
        unused = range(known, vocabulary.size)
        self.eos_token_id, self.bos_token_id = vocabulary.eos_id, None
        self.tokens = [*vocabulary.token_bytes, *(f"<|unused {i}|>".encode() for i in unused)]
        self.special_token_ids = [*vocabulary.special_ids, *unused]
        self.encode, self.unwritable = vocabulary.encode, vocabulary.unwritable
        # llguidance asks for the tokens of every forced stretch, and a schema's stretches (its keys, separators)
        # come back with every request: the short ones are kept (a bounded, thread-safe cache)
        self.known = lru_cache(maxsize=MEMO_TEXTS)(lambda text: tuple(self.spelled(text)))

    def __call__(self, text: Any) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")
        return list(self.known(text)) if len(text) <= MEMO_CHARS else self.spelled(text)

    def spelled(self, text: str) -> list[int]:
        """Text as the export's tokenizer encodes it (llguidance asks for str: bytes are refused), up to the first
        character its tokens cannot spell: a tokenizer writes that as its unknown token, which llguidance would then
        take for those bytes and allow."""
        ids = self.encode(text)
        if b"".join(self.tokens[i] for i in ids) == text.encode("utf-8", "surrogatepass"):
            return ids
        cut = next((i for i, c in enumerate(text) if self.unwritable(c)), None)
        return ids if cut is None else self.encode(text[:cut]) if cut else []


class LLGuidance(GrammarEngine):
    name = "llguidance"

    def __init__(self, llguidance: Any, vocabulary: Vocabulary):
        self.llg = llguidance
        wrapper = llguidance.TokenizerWrapper(_Tokens(vocabulary))
        self.tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=vocabulary.size, eos_token=vocabulary.eos_id)
        self.vocab, self.eos = vocabulary.size, vocabulary.eos_id
        self.executor = llguidance.LLExecutor(1)  # one request's masks along its draft: no pool to spread them on
        self.limits = llguidance.LLParserLimits(**LIMITS)

    def compile(self, guide: Guide) -> Grammar:
        llg = self.llg
        try:
            if guide.kind == "json_schema":
                text = llg.LLMatcher.grammar_from_json_schema(guide.source, defaults=JSON_OPTIONS)
            elif guide.kind == "regex":
                text = llg.LLMatcher.grammar_from_regex(guide.source)
            elif guide.kind == "choice":
                text = llg.LLMatcher.grammar_from_regex(_alternation(json.loads(guide.source)))
            elif guide.kind == "tool_call":
                text = llg.grammar_from("grammar", _tool_call_lark(ToolCallGuide.read(guide.source)))
            else:
                text = llg.grammar_from("grammar", guide.source)  # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise RefusionError(f"{guide.field} cannot be enforced: {e}") from None
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer, limits=self.limits)
        if messages:
            what = "is not a guide llguidance can enforce" if failed else "would be enforced only in part"
            raise RefusionError(f"{guide.field} {what}: {'; '.join(m.strip() for m in messages)[:400]}.")
        return _Grammar(self, text)


class _Grammar(Grammar):
    def __init__(self, engine: LLGuidance, text: str):
        self.engine, self.width = engine, mask_bytes(engine.vocab)
        # A matcher made from the grammar's text parses it again (0.2-1.2 ms for the families' guides, on the
        # scheduler's thread, every request); a copy of one takes a microsecond. Each request's matcher is a copy of
        # this one, which nothing moves.
        self.start = engine.llg.LLMatcher(engine.tokenizer, text, log_level=0, limits=engine.limits)

    def matcher(self) -> Matcher:
        return _Matcher(self.start.deep_copy(), self.engine.executor, self.engine.eos)


def _tool_call_lark(guide: ToolCallGuide) -> str:
    """The call as Lark: its tags around %json (with JSON_OPTIONS' layout, unless its schema sets its own), or,
    with an answer, that or the answer's %json, or, with text, that or any text in which the opening tag never
    appears (a lexeme: Lark's `&` and `~` take terminals only)."""
    call = f"{json.dumps(guide.opening)} %json {_laid_out(guide.call)} {json.dumps(guide.closing)}"
    if guide.answer is not None:
        return f"start: call | answer\ncall: {call}\nanswer: %json {_laid_out(guide.answer)}\n"
    if guide.text:
        tag = re.escape(guide.opening.strip())
        return f"start: call | text\ncall: {call}\ntext: TEXT\nTEXT: /(?s:.*)/ & ~/(?s:.*{tag}.*)/\n"
    return f"start: {call}\n"


def _laid_out(schema: dict[str, Any]) -> str:
    return json.dumps({"x-guidance": JSON_OPTIONS, **schema}, ensure_ascii=False)


def _alternation(choices: list[str]) -> str:
    """A regular expression that matches exactly one of `choices`, each character literal."""
    return "|".join("".join("\\" + c if c in _REGEX_META else c for c in choice) for choice in choices)


class _Matcher(Matcher):
    def __init__(self, matcher: Any, executor: Any, eos: int):
        self.m, self.executor, self.eos = matcher, executor, eos

    def _failed(self, what: str, matcher: Any = None) -> RefusionError:
        """llguidance's error as one line (its first: the rest is the parser's state and the grammar)."""
        error = (matcher or self.m).get_error().strip()
        return RefusionError(f"{what}: {error.splitlines()[0][:200] if error else 'no reason given'}")

    def _eos_where_complete(self, out: np.ndarray, draft: Sequence[int]) -> None:
        """Clear the EOS bit of `out` (the mask after `draft`) unless the answer is complete there."""
        byte, bit = divmod(self.eos, 8)
        if not out[byte] >> bit & 1:
            return
        # (a matcher already stopped validates nothing, its EOS included: it is asked whether it accepts instead)
        complete = self.m.validate_tokens([*draft, self.eos]) == len(draft) + 1 if draft else self.m.is_accepting()
        if not complete:
            out[byte] &= ~np.uint8(1 << bit)

    def allowed(self, out: np.ndarray) -> bool:
        assert out.flags["C_CONTIGUOUS"] and out.dtype == np.uint8
        self.m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self.m.is_error():  # for good: llguidance rolls no error back
            if not self.m.get_error().startswith(DEAD_END):
                raise self._failed("the grammar engine gave up")
            out[:] = 0
            return False
        self._eos_where_complete(out, [])
        return bool(out.any())

    def allowed_along(self, draft: Sequence[int], out: np.ndarray) -> None:
        """One call for the whole draft (llguidance's masks along a draft tokens, as speculative decoding's), on a
        copy: a draft that runs into a dead end would leave the request's matcher in error for good."""
        assert out.flags["C_CONTIGUOUS"] and out.dtype == np.uint8 and len(out) == len(draft) + 1
        if not draft:
            self.allowed(out[0])
            return
        probe = self.m.deep_copy()
        self.executor.unsafe_compute_mask_ptr_with_draft_token([(probe, 0, list(draft))], out.ctypes.data,
                                                                out.shape[1], len(out))
        if probe.is_error():  # at the draft's end: each token before it is one the guide accepts there
            if not probe.get_error().startswith(DEAD_END):
                raise self._failed("the grammar engine gave up", probe)
            out[-1] = 0
        for j in range(len(out)):
            self._eos_where_complete(out[j], draft[:j])

    def valid(self, tokens: Sequence[int]) -> int:
        return int(self.m.validate_tokens(list(tokens))) if tokens else 0

    def consume(self, tokens: Sequence[int]) -> None:
        if tokens and not self.m.consume_tokens(list(tokens)):
            raise self._failed(f"the guide refused {len(tokens)} token(s) it had allowed")

    def rollback(self, count: int) -> None:
        if count:
            self.m.rollback(count)

    def forced(self) -> list[int]:
        run = list(self.m.compute_ff_tokens())
        if self.m.is_error():
            raise self._failed("the grammar engine gave up")
        return run

    @property
    def finished(self) -> bool:
        return bool(self.m.is_stopped()) and not self.m.is_error()
