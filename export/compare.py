"""One comparator: runners over shared cases, one report (Polygraphy's Comparator pattern).

A *case* is one forward as explicit feeds; a *runner* maps (graph, feed) to that graph's outputs:
onnxruntime (`OrtSessions`, here), the torch definition (export/validate.py) and TensorRT
(engines/check.py). Export validation, `refusion-export check` and the GPU check go through
`compare_runners`, which reports per graph and output the largest difference, NaN and inf as such.

A reference may give, beside an output, that output as its arithmetic in the export's dtype rounds it (`ROUNDED` +
name). The torch reference of an fp16 export does: it computes in fp32 on the fp16 weights and feeds (exact
arithmetic on the export's values) and in fp16. The graph is judged against the exact values, each limit widened by
the reference's own fp16 error on that output (`_rounding`), and ids tie where their exact logits lie closer than its
error on the logits: what fp16 rounding costs on this model and input, measured per forward, not guessed. Against
the fp16 run alone, which rounds elsewhere (torch after every op; onnxruntime's CPU provider fuses RMSNorm and runs
MatMuls in fp32), the graph was charged with both runs' errors: the embedded model's fp16 export failed on 4 top ids
that torch's fp16 run misorders and onnxruntime orders as exact arithmetic does.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import numpy as np

from refusion.runtime.core.contract import GRAPH_NAMES, VOCAB_MASK, GraphName, mask_bytes, past_key_name, past_value_name
from refusion.runtime.core.dtypes import dtype
from refusion.runtime.core.embeddings import EmbeddingTable, token_feed
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.decode.masks import causal_after, rows_over_prefix
from refusion.runtime.runners.ort_session import EXACT_ACCURACY_LEVEL, Provider, SharedWeights, open_session

Feed = dict[str, np.ndarray]
Outputs = dict[str, np.ndarray]
Row = tuple[str, str, float, float]  # graph, output, difference, limit: one per forward
TIE_MARGIN = 1e-3  # logits closer than this may come in either order between fp32 kernels
ID_OUTPUTS = ("argmax_ids", "top_ids")  # compared by mismatches the reference decides, not by value
ROUNDED = "rounded."  # prefix of a reference's outputs in the export's dtype, beside its exact ones (module doc)


@dataclass(frozen=True)
class Case:
    name: str
    graphs: tuple[GraphName, ...]  # the graphs this forward runs on
    feed: Feed


def feed_shape(feed: Feed) -> tuple[int, int, int]:
    """(batch, seq, past) of a feed."""
    batch, seq, total = feed["attention_mask"].shape
    return batch, seq, total - seq


@dataclass(frozen=True)
class Tolerance:
    abs: float
    rel: float = 0.0  # of the reference output's largest magnitude
    argmax: float = 0.0  # fraction of positions whose decided argmax may differ

    @property
    def tie(self) -> float:
        """Logits (or log-probabilities) closer than this are a tie the runner may order either way: the
        absolute tolerance, since values within it of the reference's pass, and at least TIE_MARGIN, so an
        fp32 comparison stays as strict as its kernels allow."""
        return max(TIE_MARGIN, self.abs)

    def __str__(self) -> str:
        rel = f" + rel {self.rel:.0e}" if self.rel else ""
        return f"abs {self.abs:.0e}{rel}, argmax mismatches <= {self.argmax:.0%} (ties within {self.tie:.0e} aside)"


class CaseRunner(ABC):
    """A backend as the comparator sees it: (graph, feed) -> outputs, loaded on first use,
    released by close() (or leaving a `with` block)."""

    name = "runner"

    @abstractmethod
    def __call__(self, graph: GraphName, feed: Feed) -> Outputs: ...

    def unsupported(self, graph: GraphName, feed: Feed) -> str:
        """Why this runner cannot run `feed` on `graph`; empty when it can."""
        return ""

    def close(self) -> None:
        """Release sessions, engines or models; the next call loads them again."""

    def __enter__(self) -> CaseRunner:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class OrtSessions(CaseRunner):
    """The export's graphs as plain sessions over explicit feeds (any batch, past as given): the
    comparator's onnxruntime runner. One graph's session at a time (the comparator goes graph by graph).
    `unpacked`: the float weights handed over from one map of weights.bin, no prepacking (export
    validation: it runs too few forwards for packing to pay, and packing holds a second copy while
    the session loads)."""

    name = "onnxruntime"

    def __init__(self, manifest: ExportManifest, providers: Sequence[Provider] = ("CPUExecutionProvider",),
                 unpacked: bool = False):
        self.manifest = manifest
        self.providers = providers
        self.unpacked = unpacked
        self._graph: GraphName | None = None
        self._session: Any = None
        self._weights: SharedWeights | None = None

    def __call__(self, graph: GraphName, feed: Feed) -> Outputs:
        if graph != self._graph:
            self.close()  # before the next session loads
            self._weights = SharedWeights(self.manifest) if self.unpacked else None
            self._session = open_session(self.manifest, graph, self.providers, accuracy_level=EXACT_ACCURACY_LEVEL,
                                         weights=self._weights)
            self._graph = graph
        names = [o.name for o in self._session.get_outputs()]
        return dict(zip(names, self._session.run(names, feed)))

    def close(self) -> None:
        self._session, self._graph = None, None
        self._weights = None  # after the session that reads it


@dataclass
class ComparisonReport:
    dtype: str
    rows: list[Row] = field(default_factory=list)
    skipped: str = ""  # why nothing was compared
    title: str = "validation"  # `compare_runners` names the two runners
    tolerance: str = ""
    cases: int = 0
    forwards: int = 0
    notes: dict[tuple[str, str], str] = field(default_factory=dict)  # first failure per text line: why, where
    left_out: list[str] = field(default_factory=list)  # forwards a runner could not take, with its reason

    @property
    def ok(self) -> bool:
        # NaN compares false, so a non-finite difference never passes.
        return bool(self.skipped or self.rows) and all(diff <= limit for *_, diff, limit in self.rows)

    def add(self, case: str, graph: GraphName, got: Outputs, want: Outputs, tol: Tolerance) -> None:
        """One row per output of the runner under test, against the reference's."""
        for name, value in got.items():
            diff, limit, problem = _difference(name, value, want, tol)
            self.rows.append((graph, name, diff, limit))
            if not diff <= limit:
                where = f"{name}, case {case!r}" if _line(name) != name else f"case {case!r}"
                self.notes.setdefault((graph, _line(name)), f"{problem or 'over tolerance'}; first in {where}")

    def text(self) -> str:
        if self.skipped:
            return f"{self.title} skipped: {self.skipped}"
        worst: dict[tuple[str, str], float] = {}
        failed: set[tuple[str, str]] = set()
        for graph, output, diff, limit in self.rows:
            key = (graph, _line(output))
            worst[key] = _worse(worst.get(key, 0.0), diff)
            if not diff <= limit:
                failed.add(key)
        lines = [f"{self.title} ({self.dtype}, {self.forwards} forwards of {self.cases} cases; "
                 f"tolerance {self.tolerance}):"]
        for key, diff in worst.items():
            graph, output = key
            value = f"mismatches {diff:.0f}" if output in ID_OUTPUTS else f"max|diff| {diff:.2e}"
            flag = "ok" if key not in failed else "FAIL" + (f" ({self.notes[key]})" if key in self.notes else "")
            lines.append(f"  {graph:8s} {output:22s} {value:20s} {flag}")
        lines += [f"  left out: {line}" for line in self.left_out]
        lines.append("  result: " + ("PASS" if self.ok else "FAIL"))
        return "\n".join(lines)


def compare_runners(test: CaseRunner, reference: CaseRunner, cases: Sequence[Case], tol: Tolerance,
                    dtype: str) -> ComparisonReport:
    """Every forward of `cases` that both runners take, on `test` and then on `reference` (one runner
    loaded at a time, graph by graph, so a runner may hold one graph at a time), compared output by output."""
    report = ComparisonReport(dtype, title=f"{test.name} vs {reference.name}", tolerance=str(tol), cases=len(cases))
    todo: list[tuple[Case, GraphName]] = []
    left_out: dict[tuple[str, str], list[str]] = {}  # (case, why) -> graphs
    for graph in GRAPH_NAMES:
        for case in (c for c in cases if graph in c.graphs):
            why = test.unsupported(graph, case.feed) or reference.unsupported(graph, case.feed)
            if why:
                left_out.setdefault((case.name, why), []).append(graph)
            else:
                todo.append((case, graph))
    report.left_out = [f"{name} ({', '.join(graphs)}): {why}" for (name, why), graphs in left_out.items()]
    report.forwards = len(todo)
    got = _run(test, todo)
    want = _run(reference, todo)
    for (case, graph), g, w in zip(todo, got, want):
        report.add(case.name, graph, g, w, tol)
    return report


def _run(runner: CaseRunner, todo: list[tuple[Case, GraphName]]) -> list[Outputs]:
    with runner:
        return [runner(graph, case.feed) for case, graph in todo]


def _difference(name: str, got: np.ndarray, want: Outputs, tol: Tolerance) -> tuple[float, float, str]:
    """(difference, limit, problem): max |got - want| (NaN or inf when either holds them) against
    abs + rel x max |want| + the reference's own rounding (`_rounding`); for argmax and top ids the count of ids the
    reference decides against (`_misranked`), tied within the tolerance or that rounding on the logits."""
    if name not in want:
        return math.inf, 0.0, "missing from the reference"
    expect = want[name]
    if got.shape != expect.shape:
        return math.inf, 0.0, f"shape {list(got.shape)}, reference {list(expect.shape)}"
    if name in ID_OUTPUTS:
        logits = want.get("logits")  # -inf where vocab_mask leaves a token out
        if logits is not None and (np.isnan(logits).any() or np.isposinf(logits).any()):
            return math.nan, 0.0, "non-finite reference logits (NaN or +inf)"
        tie = max(tol.tie, _rounding("logits", want))
        if name == "top_ids":
            wrong = _misranked(got, expect, want["top_logprobs"], logits, tie)
        elif logits is not None:  # the argmax is a list of one
            wrong = _misranked(got[..., None], expect[..., None], None, logits, tie)[..., 0]
        else:  # no logits tell a tie: every mismatch counts
            wrong = got != expect
        return float(np.sum(wrong)), float(math.floor(tol.argmax * got.size)), ""
    if not got.size:
        return 0.0, tol.abs, ""
    g, w = got.astype(np.float32), expect.astype(np.float32)
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, as it should be, but for -inf on both sides (a masked logit)
        diff = float(np.max(np.where((g == w) & (w == -np.inf), 0.0, np.abs(g - w))))  # NaN, inf never hidden as 0
    scale = float(np.max(np.abs(w[np.isfinite(w)]), initial=0.0))  # of the finite values: a masked logit is -inf
    return diff, tol.abs + tol.rel * scale + _rounding(name, want), "" if math.isfinite(diff) else "non-finite output"


def _rounding(name: str, want: Outputs) -> float:
    """The reference's own error on output `name` in the export's dtype: max |rounded - exact| over the values finite
    in both (0 where it gives no rounded output), so a reference that overflows never widens a limit to inf."""
    rounded = want.get(ROUNDED + name)
    if rounded is None:
        return 0.0
    r, w = rounded.astype(np.float64), want[name].astype(np.float64)
    finite = np.isfinite(r) & np.isfinite(w)
    return float(np.max(np.abs(r[finite] - w[finite]), initial=0.0))


def _misranked(got: np.ndarray, want: np.ndarray, want_logprobs: np.ndarray | None, logits: np.ndarray | None,
               tie: float) -> np.ndarray:
    """Which of `got`'s ranked ids [..., K] the reference decides against: the id at rank j must be one whose
    reference logit (log-probability) is within `tie` of the reference's rank-j one. So ids tied within the
    tolerance may swap, and an id the reference does not list may stand only where the ranks are tied with its
    logit, which is at most the K-th's: at the tail. A rank the reference decides holds its own id, and an id
    repeated in one list, or out of the vocabulary, is wrong. Without logits an unlisted id gets the doubt: it
    counts as tied with the reference's K-th."""
    if logits is not None:  # log-softmax shifts a position's logits alike: their gaps are the log-probs'
        vocab = logits.shape[-1]
        known = (got >= 0) & (got < vocab)
        ref = np.take_along_axis(logits, np.where(known, got, 0), axis=-1).astype(np.float64)
        ref[~known] = -np.inf
        at = np.take_along_axis(logits, want, axis=-1).astype(np.float64)
    else:
        assert want_logprobs is not None, "the argmax without logits is compared id by id"
        at = want_logprobs.astype(np.float64)
        listed = got[..., :, None] == want[..., None, :]  # [..., K got, K want]
        ref = np.where(listed, at[..., None, :], -np.inf).max(axis=-1)
        ref = np.where(listed.any(axis=-1), ref, at[..., -1:])
    repeated = np.triu(got[..., :, None] == got[..., None, :], k=1).any(axis=-2)  # an earlier rank holds it
    with np.errstate(invalid="ignore"):  # -inf - -inf: NaN, wrong
        return repeated | ~(np.abs(ref - at) <= tie)


def _line(output: str) -> str:
    return "present.*" if output.startswith("present.") else output  # one line for all layers


def _worse(a: float, b: float) -> float:
    return b if math.isnan(b) or b > a else a


def every_token(manifest: ExportManifest, batch: int = 1) -> dict[str, np.ndarray]:
    """A feed's vocab_mask that allows every token (one row for all heads), where the graphs take one."""
    if not manifest.takes_masks:
        return {}
    return {VOCAB_MASK: np.full((batch, 1, mask_bytes(manifest.vocab_size)), 255, np.uint8)}


def cases(manifest: ExportManifest, seed: int = 0, prefix: int = 12, block: int = 8, slot: int = 4) -> list[Case]:
    """The shared cases, random tokens and past KV from `seed`.

    Shapes unlike the export's: batch 1 and 2, past 0 and > 0, several lengths, shuffled
    position ids, slot rows over a shared past (both graphs each), heads at every position or at some,
    out of order and repeated; where the graphs take vocab_mask, every token allowed (one row for all heads), or
    every second case a mask of its own for each head (the K candidates and about half the rest allowed). Then the
    decode loop's forwards at small sizes, with the heads it reads: a `prefix`-token prompt, a block of `block`
    masks, slots of `slot`: prefill + plan, plan, verify, slot rows with private scratch (the infill passes), an AR
    prefill and step.
    """
    if manifest.dtype not in ("float32", "float16"):
        raise RefusionError(f"{manifest.path}: numpy holds no {manifest.dtype} KV to feed; "
                            "compare an fp32 or fp16 export of the same checkpoint.")
    rng = np.random.default_rng(seed)
    kv_dtype = dtype(manifest.dtype).numpy
    vocab = manifest.vocab_size
    table = EmbeddingTable.of(manifest.path, manifest.embeddings)  # a host table: its rows are fed, as runners do

    def case(name: str, graphs: tuple[GraphName, ...], ids: np.ndarray, positions: np.ndarray, mask: np.ndarray,
             batch: int = 1, heads: np.ndarray | None = None) -> Case:
        """`heads`: the head positions (default every position)."""
        seq, past = mask.shape[1], mask.shape[2] - mask.shape[1]
        at = np.arange(seq) if heads is None else heads
        feed = {
            **token_feed(table, np.broadcast_to(np.asarray(ids, np.int64), (batch, seq)).copy()),
            "position_ids": np.broadcast_to(np.asarray(positions, np.int64), (batch, seq)).copy(),
            "attention_mask": np.broadcast_to(mask, (batch, seq, past + seq)).copy(),  # writable: torch wants it
            "head_positions": np.broadcast_to(np.asarray(at, np.int64), (batch, len(at))).copy(),
        }
        if takes_masks:
            feed.update({VOCAB_MASK: masks(batch, len(at))} if next(made) % 2 else every_token(manifest, batch))
        for i in range(manifest.num_layers):
            for kv in (past_key_name(i), past_value_name(i)):
                feed[kv] = rng.standard_normal((batch, past, manifest.kv_heads, manifest.head_dim)).astype(kv_dtype)
        return Case(name, graphs, feed)

    takes_masks, width, made = manifest.takes_masks, mask_bytes(vocab), itertools.count()

    def masks(batch: int, heads: int) -> np.ndarray:
        """A mask per head that allows the K candidates' worth of tokens and half the others, at random."""
        allowed = np.zeros((batch, heads, 8 * width), bool)
        keep = manifest.candidates + (vocab - manifest.candidates) // 2
        for row in allowed.reshape(-1, 8 * width):
            row[rng.permutation(vocab)[:keep]] = True
        return np.packbits(allowed, axis=-1, bitorder="little")

    out: list[Case] = []
    for batch, past, seq, rows in ((1, 0, 5, 1), (2, 0, 3, 1), (1, 7, 4, 1), (2, 6, 1, 1), (1, 5, 6, 3)):
        name = f"batch {batch} past {past} seq {seq}" + (f" in {rows} rows" if rows > 1 else "")
        ids = rng.integers(0, vocab, (batch, seq))
        positions = rng.permutation(past + seq + 8)[:seq]
        heads = rng.integers(0, seq, seq) if batch == 1 and past else None  # unordered, repeated
        out.append(case(name, GRAPH_NAMES, ids, positions, rows_over_prefix(past, 0, 0, 0, rows, seq // rows), batch,
                        heads))
    w = min(slot, block // 2)  # two slot rows of w tokens fit in one block
    accepted = w // 2  # each row's private tokens in scratch
    verify = min(slot, block)
    mask_ids = np.full(block, manifest.mask_token_id)
    after = np.arange(prefix, prefix + max(block, verify, 2 * w))
    out += [
        case("prefill+plan", ("infiller",), np.concatenate([rng.integers(0, vocab, prefix), mask_ids]),
             np.arange(prefix + block), causal_after(0, prefix + block), heads=np.arange(prefix, prefix + block)),
        case("ar prefill", ("infiller",), rng.integers(0, vocab, prefix), np.arange(prefix), causal_after(0, prefix),
             heads=np.array([prefix - 1])),
        case("plan", ("planner",), mask_ids, after[:block], causal_after(prefix, block)),
        case("verify", ("infiller",), rng.integers(0, vocab, verify), after[:verify], causal_after(prefix, verify)),
        case("ar step", ("infiller",), rng.integers(0, vocab, 1), after[:1], causal_after(prefix, 1)),
    ]
    if w:
        out.append(case("slot rows", GRAPH_NAMES, rng.integers(0, vocab, 2 * (w - accepted)),
                        np.concatenate([after[accepted:w], after[w + accepted:2 * w]]),
                        rows_over_prefix(prefix, 2, w, accepted, 2, w - accepted)))
    return out
