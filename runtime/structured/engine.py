"""The grammar engine behind structured output, as a small interface: an engine compiles a guide (guide.py) over
the export's vocabulary into a `Grammar`; each request follows it with a `Matcher` of its own. llguidance is the
engine (llguidance_engine.py, imported on the first guide: `pip install 'refusion-trt[structured]'`); another
(xgrammar) is one more module with these three classes and a row in ENGINES.

Masks are the graphs' vocab_mask rows (runtime/core/contract.py): a bit a token, little-endian, in whole int32
words, which is how both llguidance and xgrammar write them.

A guide's cost is the client's to choose (an ambiguous grammar's work grows with every token), so the server bounds
it twice: the engine's own limits bound what one call may do (llguidance_engine.py), and every call a request's
matcher makes is timed against `budget_ms` a token (`Budgeted`): past it, the request ends with an error naming the
guide's field. A guide is also tried once when it is compiled (`Guides.compile`): one that fails on its forced
opening, or whose language holds no answer the vocabulary can write, is refused before any work.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from numbers import Real
from typing import Any

import numpy as np

from refusion.runtime.core.errors import RefusionError, refusing
from refusion.runtime.structured.guide import Guide

CACHED = 64  # compiled grammars a Generator keeps, the least recently used dropped first
# The guide's work a token may take by default (a mask, a commit, a validation: each call against this much a token
# it reads): over 100x what a mask of an ordinary JSON schema, regex or enum of 7,400 strings takes on a 2-core CPU
# (0.1 ms or less, docs/serving.md "Guides").
BUDGET_MS = 20.0
# The most CPU seconds a guide's compile (and its try) may take: llguidance's own limits bound it first (a schema of
# 64 KiB compiles in 15-35 ms here); this refuses what still runs long, as vLLM's regex compile timeout does.
COMPILE_LIMIT_S = 2.0
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

    def unwritable(self, text: str) -> list[str]:
        """The characters of `text` no run of this vocabulary's tokens spells (each once, in order; the first 8)."""
        found: list[str] = []
        for char in dict.fromkeys(text):
            if b"".join(self.token_bytes[i] for i in self.encode(char) if i < len(self.token_bytes)) != char.encode(
                    "utf-8", "surrogatepass"):
                found.append(char)
                if len(found) == 8:
                    break
        return found


class Matcher(ABC):
    """One request's place in its guide: what it allows next, given the tokens consumed so far. The EOS is
    allowed only where the answer is complete; where nothing else may follow either, the guide is at a dead end.
    A call the engine cannot finish within its limits raises a RefusionError of one line."""

    @abstractmethod
    def allowed(self, out: np.ndarray) -> bool:
        """The tokens the guide allows next, written into `out` (uint8 [mask bytes]); False at a dead end (none
        allowed: the answer so far can be neither continued nor ended)."""

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
        """The answer is complete and only its end (EOS) may follow."""

    def allowed_along(self, draft: Sequence[int], out: np.ndarray) -> None:
        """The masks along `draft` (which the guide accepts whole): out[j] (uint8 [len + 1, mask bytes]) is what it
        allows after draft[:j], all zero at a dead end. The matcher is where it was after."""
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


class Ending(Matcher):
    """A request's matcher that owns the answer's end: the EOS is a token like the others to whoever follows the
    guide (valid where the answer is complete, forced where the engine forces it, consumed to end the answer, given
    back by a rollback over it), which the engine's matcher (`inner`) never sees. After the end nothing is valid
    or forced; along a draft that ends with the EOS, the row after it allows every token (nothing is read there).
    A complete answer (`finished`) is the decoding loop's to end: a draft is not written in with its EOS."""

    def __init__(self, inner: Matcher, eos: int):
        self.inner, self.eos = inner, eos
        self.ended = False  # the EOS is consumed: the answer has ended

    def allowed(self, out: np.ndarray) -> bool:
        if self.ended:
            out[:] = 0
            return False
        return self.inner.allowed(out)

    def allowed_along(self, draft: Sequence[int], out: np.ndarray) -> None:
        if len(draft) and draft[-1] == self.eos:
            self.inner.allowed_along(draft[:-1], out[: len(draft)])
            out[len(draft)] = 255
        else:
            self.inner.allowed_along(draft, out)

    def valid(self, tokens: Sequence[int]) -> int:
        if self.ended:
            return 0
        n = self.inner.valid(tokens)
        return list(tokens[:n]).index(self.eos) + 1 if self.eos in tokens[:n] else n

    def consume(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)
        if self.eos in tokens:
            assert tokens[-1] == self.eos and not self.ended, "nothing follows the end of the answer"
            self.inner.consume(tokens[:-1])
            self.ended = True
        else:
            self.inner.consume(tokens)

    def rollback(self, count: int) -> None:
        if count and self.ended:
            self.ended, count = False, count - 1
        self.inner.rollback(count)

    def forced(self) -> list[int]:
        if self.ended:
            return []
        run = self.inner.forced()
        return run[: run.index(self.eos) + 1] if self.eos in run else run

    @property
    def finished(self) -> bool:
        return not self.ended and self.inner.finished


class Budgeted(Matcher):
    """A matcher whose every call is timed against the server's budget: at most `budget_ms` a token the call reads
    (a mask is one token; masks along a draft, one more than the draft). A call over it, or one the engine gives up
    on, ends the request with a RefusionError naming `field`: the server goes on with its other requests. The time
    is the calling thread's CPU time (the engines work on it): a wait for the GIL or for a core is not the guide's."""

    def __init__(self, inner: Matcher, field: str, budget_ms: float):
        self.inner, self.field, self.budget_ms = inner, field, budget_ms

    def _timed(self, what: str, tokens: int | None, call: Callable[..., Any], *args: Any) -> Any:
        """`call(*args)`, timed against the budget for `tokens` tokens (None: as many as it returns)."""
        t0 = time.thread_time()
        try:
            result = call(*args)
        except RefusionError as e:
            raise RefusionError(f"{self.field} could not be followed: {e}", self.field) from None
        spent, tokens = (time.thread_time() - t0) * 1e3, max(1, len(result) if tokens is None else tokens)
        if spent > self.budget_ms * tokens:
            raise RefusionError(
                f"{self.field} took {spent:.1f} ms of the grammar engine's work for {tokens} token(s) ({what}), over "
                f"this server's budget of {self.budget_ms:g} ms a token; simplify the guide (an ambiguous grammar's "
                "work grows with every token: make its rules unambiguous, or use a regex or a JSON schema).", self.field)
        return result

    def allowed(self, out: np.ndarray) -> bool:
        return bool(self._timed("a mask", 1, self.inner.allowed, out))

    def allowed_along(self, draft: Sequence[int], out: np.ndarray) -> None:
        self._timed("masks along a draft" if draft else "a mask", len(draft) + 1, self.inner.allowed_along, draft, out)

    def valid(self, tokens: Sequence[int]) -> int:
        return int(self._timed("a validation", len(tokens), self.inner.valid, tokens))

    def consume(self, tokens: Sequence[int]) -> None:
        self._timed("a commit", len(tokens), self.inner.consume, tokens)

    def rollback(self, count: int) -> None:
        self._timed("a rollback", count, self.inner.rollback, count)

    def forced(self) -> list[int]:
        return list(self._timed("forced tokens", None, self.inner.forced))

    @property
    def finished(self) -> bool:
        return self.inner.finished


class _Bound(Grammar):
    """A compiled guide as one request follows it: its matchers are budgeted, their refusals name its field."""

    def __init__(self, grammar: Grammar, field: str, budget_ms: float):
        self.grammar, self.field, self.budget_ms = grammar, field, budget_ms
        self.width, self.compile_seconds = grammar.width, grammar.compile_seconds

    def matcher(self) -> Matcher:
        return Budgeted(self.grammar.matcher(), self.field, self.budget_ms)


class GrammarEngine(ABC):
    name: str

    @abstractmethod
    def compile(self, guide: Guide) -> Grammar:
        """The guide compiled over the vocabulary, or a RefusionError naming `guide.field` and why the engine
        cannot enforce it (an unsupported keyword, a bad schema or expression, a grammar over a limit)."""


class Guides:
    """The guides of one Generator's requests: compiled by the engine over the export's vocabulary, which it reads
    once, on the first guide; each compiled and tried once (CACHED of them, by kind and source; requests that ask
    for a guide while it compiles wait for that compile), then followed by each request under `budget_ms` a token
    (Budgeted). Thread-safe."""

    def __init__(self, vocabulary: Vocabulary, engine: str = "llguidance", budget_ms: float = BUDGET_MS):
        if engine not in ENGINES:
            raise RefusionError(f"grammar engine {engine!r} is not one of {', '.join(ENGINES)}.")
        check_budget_ms(budget_ms)
        self.vocabulary, self.engine_name, self.budget_ms = vocabulary, engine, budget_ms
        self._engine: GrammarEngine | None = None
        self._compiled: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._compiling: dict[tuple[str, str], Future[Grammar]] = {}  # a compile in flight, which others wait on
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
        """`guide` compiled, as a request follows it (its refusals name `guide.field`); a RefusionError when the
        engine cannot enforce it, or when it can hold no answer (`_try`)."""
        engine = self.engine
        while True:
            with self._lock:
                grammar = self._compiled.get(guide.key)
                if grammar is not None:
                    self._compiled.move_to_end(guide.key)
                    return _Bound(grammar, guide.field, self.budget_ms)
                pending = self._compiling.get(guide.key)
                if pending is None:
                    compiling = self._compiling[guide.key] = Future()
                    break
            with contextlib.suppress(RefusionError):  # refused: compiled again, so that its refusal names this field
                return _Bound(pending.result(), guide.field, self.budget_ms)
        try:
            with refusing(guide.field):  # every refusal of the compile names the guide's field
                t0, cpu = time.perf_counter(), time.thread_time()
                grammar = engine.compile(guide)  # outside the lock: another request's cached guide need not wait
                grammar.compile_seconds = time.perf_counter() - t0
                self._try(grammar, guide)
                spent = time.thread_time() - cpu
                if spent > COMPILE_LIMIT_S:
                    raise RefusionError(f"{guide.field} took {spent:.1f} s of the grammar engine's work to compile, "
                                        f"over the {COMPILE_LIMIT_S:g} s a guide may take; simplify it (fewer "
                                        "alternatives, a smaller schema).")
        except BaseException as e:
            with self._lock:
                del self._compiling[guide.key]
            compiling.set_exception(e)
            raise
        with self._lock:
            del self._compiling[guide.key]
            self._compiled[guide.key] = grammar
            if len(self._compiled) > CACHED:
                self._compiled.popitem(last=False)
        compiling.set_result(grammar)
        return _Bound(grammar, guide.field, self.budget_ms)

    def _try(self, grammar: Grammar, guide: Guide) -> None:
        """Follow the guide's forced opening and read the mask after it, as the first step of every request would:
        a guide that fails there (an engine limit, text the vocabulary cannot write), or allows nothing there (a
        language with no answer), would fail every request, so it is refused here, before any work."""
        matcher = Ending(grammar.matcher(), self.vocabulary.eos_id)
        try:
            matcher.consume(matcher.forced())
            if matcher.ended or matcher.allowed(np.empty(grammar.width, np.uint8)):
                return
            why = ("its language holds no answer (a rule or $ref that never ends, a class that matches nothing, a "
                   "branch that leads nowhere)")
        except RefusionError as e:
            why = f"the grammar engine gave up on its opening ({e})"
        unwritable = self.vocabulary.unwritable(guide.source)
        if unwritable:
            why = f"this model's vocabulary cannot write {', '.join(map(repr, unwritable))}"
        raise RefusionError(f"{guide.field} can never be followed to a complete answer: {why}; fix the guide.")


def check_budget_ms(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)) or float(value) <= 0:
        raise RefusionError(f"guide_budget_ms={value!r} (--guide-budget-ms) must be a positive number of milliseconds "
                            f"(default {BUDGET_MS:g}).")
