"""The grammar engine behind structured output, as a small interface: an engine compiles a guide (guide.py) over
the export's vocabulary into a `Grammar`; each request follows it with a `Matcher` of its own. llguidance is the
engine (llguidance_engine.py, imported on the first guide: `pip install 'refusion-trt[structured]'`); another
(xgrammar) is one more module with these three classes and a row in ENGINES.

Masks are the graphs' vocab_mask rows (runtime/core/contract.py): a bit a token, little-endian, in whole int32
words, which is how both llguidance and xgrammar write them.
"""

from __future__ import annotations

import importlib
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.structured.guide import Guide

CACHED = 64  # compiled grammars a Generator keeps, the least recently used dropped first
ENGINES = {"llguidance": "refusion.runtime.structured.llguidance_engine"}  # name -> module with `make_engine`


@dataclass(frozen=True)
class Vocabulary:
    """What an engine reads of the export: each id's bytes (up to the tokenizer's size), the special ids, the
    graphs' vocabulary size (ids past the tokenizer's are never allowed), the EOS id, and how to encode text."""

    token_bytes: list[bytes]
    special_ids: list[int]
    size: int
    eos_id: int
    encode: Callable[[str], list[int]]


class Matcher(ABC):
    """One request's place in its guide: what it allows next, given the tokens consumed so far."""

    @abstractmethod
    def allowed(self, out: np.ndarray) -> bool:
        """The tokens the guide allows next, written into `out` (uint8 [mask bytes]); False when it allows none
        (a dead end: `error` says why)."""

    @abstractmethod
    def valid(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the first, the guide accepts here; nothing is consumed."""

    @abstractmethod
    def consume(self, tokens: Sequence[int]) -> None:
        """Take `tokens`, which the guide accepts (`valid`), as the answer's next."""

    @abstractmethod
    def rollback(self, count: int) -> None:
        """Give back the last `count` tokens consumed."""

    @abstractmethod
    def forced(self) -> list[int]:
        """The tokens the guide allows alone from here, in order (none when it allows a choice): they need no
        forward."""

    @property
    @abstractmethod
    def finished(self) -> bool:
        """Only the end of the answer (EOS) may follow."""

    @property
    @abstractmethod
    def error(self) -> str:
        """Why the guide cannot go on ("" while it can)."""

    def allowed_along(self, draft: Sequence[int], out: np.ndarray) -> None:
        """The masks along `draft` (which the guide accepts whole): out[j] (uint8 [len + 1, mask bytes]) is what it
        allows after draft[:j]. The matcher is where it was after."""
        for j, token in enumerate(draft):
            self.allowed(out[j])
            self.consume([token])
        self.allowed(out[len(draft)])
        self.rollback(len(draft))


class Grammar(ABC):
    """A compiled guide: any number of requests follow it, each with its own matcher."""

    width: int  # bytes of one mask: the vocabulary's bits in whole int32 words (contract.mask_bytes)
    compile_seconds: float = 0.0

    @abstractmethod
    def matcher(self) -> Matcher: ...


class GrammarEngine(ABC):
    name: str

    @abstractmethod
    def compile(self, guide: Guide) -> Grammar:
        """The guide compiled over the vocabulary, or a RefusionError naming `guide.field` and why the engine
        cannot enforce it (an unsupported keyword, a bad schema or expression, a grammar over a limit)."""


class Guides:
    """The guides of one Generator's requests: compiled by the engine over the export's vocabulary, which it reads
    once, on the first guide; each compiled once (CACHED of them, by kind and source). Thread-safe."""

    def __init__(self, vocabulary: Vocabulary, engine: str = "llguidance"):
        if engine not in ENGINES:
            raise RefusionError(f"grammar engine {engine!r} is not one of {', '.join(ENGINES)}.")
        self.vocabulary, self.engine_name = vocabulary, engine
        self._engine: GrammarEngine | None = None
        self._compiled: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def engine(self) -> GrammarEngine:
        with self._lock:
            if self._engine is None:
                self._engine = importlib.import_module(ENGINES[self.engine_name]).make_engine(self.vocabulary)
            return self._engine

    def wrap(self, wrapper: Callable[[GrammarEngine], GrammarEngine]) -> None:
        """Compile every guide from now on with `wrapper(engine)` (a measurement's: tools/bench/measure/
        structured.py times masks and turns forcing off through it); what was compiled is dropped."""
        engine = self.engine
        with self._lock:
            self._engine = wrapper(engine)
            self._compiled.clear()

    def compile(self, guide: Guide) -> Grammar:
        engine = self.engine
        with self._lock:
            grammar = self._compiled.get(guide.key)
            if grammar is not None:
                self._compiled.move_to_end(guide.key)
                return grammar
        t0 = time.perf_counter()
        grammar = engine.compile(guide)  # outside the lock: another request's cached guide need not wait
        grammar.compile_seconds = time.perf_counter() - t0
        with self._lock:
            self._compiled[guide.key] = grammar
            if len(self._compiled) > CACHED:
                self._compiled.popitem(last=False)
        return grammar
