"""llguidance (Microsoft's guidance engine, what onnxruntime-genai and llama.cpp use) behind engine.py's interface.
Imported only when a request brings a guide: `pip install 'refusion-trt[structured]'`.

JSON schemas compile with strict whitespace and Python's separators (", " and ": ", what json.dumps writes): the
answer's layout is then fixed, so the guide forces every key, brace and separator (tokens without forwards) and a
schema whose values are bounded has a bounded answer. A schema's own "x-guidance" object overrides these
(llguidance's JSON options, e.g. {"whitespace_flexible": true}). Anything llguidance reports about a guide, an
error or a warning that it would leave part of it unenforced, refuses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from refusion.runtime.core.contract import mask_bytes
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.structured.engine import Grammar, GrammarEngine, Matcher, Vocabulary
from refusion.runtime.structured.guide import Guide

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
INSTALL = "pip install 'refusion-trt[structured]'"


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
        self.encode = vocabulary.encode

    def __call__(self, text: Any) -> list[int]:
        """Text as the export's tokenizer encodes it (llguidance asks for str: bytes are refused)."""
        if not isinstance(text, str):
            raise TypeError("text only")
        return self.encode(text)


class LLGuidance(GrammarEngine):
    name = "llguidance"

    def __init__(self, llguidance: Any, vocabulary: Vocabulary):
        self.llg = llguidance
        wrapper = llguidance.TokenizerWrapper(_Tokens(vocabulary))
        self.tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=vocabulary.size, eos_token=vocabulary.eos_id)
        self.vocab = vocabulary.size
        self.executor = llguidance.LLExecutor(1)  # one request's masks along its draft: no pool to spread them on

    def compile(self, guide: Guide) -> Grammar:
        llg = self.llg
        try:
            if guide.kind == "json_schema":
                text = llg.LLMatcher.grammar_from_json_schema(guide.source, defaults=JSON_OPTIONS)
            elif guide.kind == "regex":
                text = llg.LLMatcher.grammar_from_regex(guide.source)
            elif guide.kind == "choice":
                text = llg.grammar_from("choice", guide.source)
            else:
                text = llg.grammar_from("grammar", guide.source)  # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise RefusionError(f"{guide.field} cannot be enforced: {e}") from None
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer)
        if messages:
            what = "is not a guide llguidance can enforce" if failed else "would be enforced only in part"
            raise RefusionError(f"{guide.field} {what}: {'; '.join(m.strip() for m in messages)[:400]}.")
        return _Grammar(self, text)


class _Grammar(Grammar):
    def __init__(self, engine: LLGuidance, text: str):
        self.engine, self.text = engine, text
        self.width = mask_bytes(engine.vocab)

    def matcher(self) -> Matcher:
        llg = self.engine.llg
        return _Matcher(llg.LLMatcher(self.engine.tokenizer, self.text, log_level=0), self.engine.executor)


class _Matcher(Matcher):
    def __init__(self, matcher: Any, executor: Any):
        self.m, self.executor = matcher, executor

    def allowed(self, out: np.ndarray) -> bool:
        assert out.flags["C_CONTIGUOUS"] and out.dtype == np.uint8
        self.m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return not self.m.is_error() and bool(out.any())

    def allowed_along(self, draft: Sequence[int], out: np.ndarray) -> None:
        """One call for the whole draft (llguidance's masks along a draft tokens, as speculative decoding's)."""
        assert out.flags["C_CONTIGUOUS"] and out.dtype == np.uint8 and len(out) == len(draft) + 1
        if not draft:
            self.allowed(out[0])
            return
        self.executor.unsafe_compute_mask_ptr_with_draft_token([(self.m, 0, list(draft))], out.ctypes.data,
                                                                out.shape[1], len(out))

    def valid(self, tokens: Sequence[int]) -> int:
        return int(self.m.validate_tokens(list(tokens))) if tokens else 0

    def consume(self, tokens: Sequence[int]) -> None:
        if tokens and not self.m.consume_tokens(list(tokens)):
            raise RefusionError(f"the guide refused tokens it had accepted ({list(tokens)}): {self.m.get_error()}")

    def rollback(self, count: int) -> None:
        if count:
            self.m.rollback(count)

    def forced(self) -> list[int]:
        return list(self.m.compute_ff_tokens())

    @property
    def finished(self) -> bool:
        return bool(self.m.is_stopped())

    @property
    def error(self) -> str:
        return str(self.m.get_error()) if self.m.is_error() else ""
