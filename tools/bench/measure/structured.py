"""Structured output measured: over tools/bench/guides.py's fixed set of guides, on the embedded model and on a
random-weight model (which writes garbage unguided), constrained ReFusion against constrained AR and against
both unconstrained: validity, accuracy, tokens per forward and tokens/s, the forwards forced tokens save, the
grammar engine's mask time per token and compile time, and what the graphs' vocab_mask costs a forward without a
guide. Then the structured families' cases (guides.FAMILY_CASES) on the embedded model alone, each held-out example
asked as it is, ReFusion against AR: validity, accuracy, the share ended by the structure, tokens per forward and
tokens/s (a random-weight model runs only the guides outside the families: it has no family answer to be accurate
to). Writes results/structured/ (structured.json and .md).

    python -m refusion.tools.bench.measure.structured --work DIR [--out results/structured] [--prompts 12] [--examples 24] [--repeats 3]

Every sample interleaves the methods (the machine is shared: ratios, not times); tokens/s are a method's tokens over
its wall seconds, summed over its requests, the median of the repeats. Forced tokens' savings: the same guided
requests with the engine's forcing turned off (each forced token then costs the forwards a free one costs).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.decode.masks import causal_after
from refusion.runtime.generator import Generator
from refusion.runtime.request import GenerationResult
from refusion.runtime.structured.engine import Grammar, GrammarEngine, Matcher
from refusion.runtime.structured.guide import Guide
from refusion.runtime.structured.tools import read_tools
from refusion.tools.bench.common import cpu_model, host_info, write_report
from refusion.tools.bench.guides import CASES, FAMILY_CASES, RANDOM_SETTINGS, GuideCase
from refusion.tools.cli_common import progress
from refusion.tools.tasks import held_out

METHODS = ("refusion", "ar")
RANDOM_PROMPTS = ("robot, go left", "stop now", "Grüße 🙂", "turn right slowly", "what next?", "left or right",
                  "the arm", "go", "move it", "hold", "fast", "where?")


def _in_turn(i: int) -> tuple[str, ...]:
    """The methods in the order they run on prompt i: rotated, so neither always runs first (the first pays the
    prompt's prefill, the other reads it from the prefix cache)."""
    return METHODS[i % len(METHODS):] + METHODS[:i % len(METHODS)]


# ----------------------------------------------------------------------------- the engine, timed
class Timing:
    """Every mask the guides computed (seconds a row) and each guide's compile time."""

    def __init__(self) -> None:
        self.masks: list[float] = []
        self.compiles: dict[str, float] = {}
        self.forcing = True  # off: the matchers force nothing (each forced token is then decoded)


class _TimedEngine(GrammarEngine):
    def __init__(self, engine: GrammarEngine, timing: Timing):
        self.inner, self.timing, self.name = engine, timing, engine.name

    def compile(self, guide: Guide) -> Grammar:
        t0 = time.perf_counter()
        grammar = self.inner.compile(guide)
        self.timing.compiles.setdefault(guide.kind + ":" + guide.source[:40], time.perf_counter() - t0)
        return _TimedGrammar(grammar, self.timing)


class _TimedGrammar(Grammar):
    def __init__(self, grammar: Grammar, timing: Timing):
        self.inner, self.timing, self.width = grammar, timing, grammar.width

    def matcher(self) -> Matcher:
        return _TimedMatcher(self.inner.matcher(), self.timing)


class _TimedMatcher(Matcher):
    def __init__(self, matcher: Matcher, timing: Timing):
        self.inner, self.timing = matcher, timing

    def allowed(self, out: np.ndarray) -> bool:
        t0 = time.perf_counter()
        ok = self.inner.allowed(out)
        self.timing.masks.append(time.perf_counter() - t0)
        return ok

    def valid(self, tokens: Sequence[int]) -> int:
        return self.inner.valid(tokens)

    def consume(self, tokens: Sequence[int]) -> None:
        self.inner.consume(tokens)

    def rollback(self, count: int) -> None:
        self.inner.rollback(count)

    def forced(self) -> list[int]:
        return self.inner.forced() if self.timing.forcing else []

    @property
    def finished(self) -> bool:
        return self.inner.finished and self.timing.forcing  # without forcing, the EOS too is decoded


# ----------------------------------------------------------------------------- one model's runs
@dataclass
class Tally:
    requests: int = 0
    valid: int = 0
    finish: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    forwards: int = 0
    forced: int = 0
    seconds: list[float] = field(default_factory=list)  # a method's wall seconds of each repeat
    accurate: int = 0  # the framed answer is the task's
    scored: int = 0  # requests with a task answer to match
    agree: int = 0  # the framed answer is the unconstrained one
    fitting: int = 0  # requests whose unconstrained answer follows the guide
    runner: float = 0.0  # seconds inside the runner (the graphs), the first repeat's
    loop: float = 0.0  # the rest of the requests' seconds on the scheduler: masks, drafts, bookkeeping

    def add(self, result: GenerationResult) -> None:
        self.requests += 1
        self.finish[result.finish_reason] = self.finish.get(result.finish_reason, 0) + 1
        self.tokens += result.stats.tokens
        self.forwards += result.stats.forward_count
        self.forced += result.stats.branches.get("forced_tokens", 0)
        self.runner += result.stats.runner_seconds
        self.loop += result.stats.loop_seconds

    def include(self, other: Tally) -> None:
        """Count `other`'s requests in too (its seconds added repeat by repeat)."""
        for name in ("requests", "valid", "tokens", "forwards", "forced", "accurate", "scored", "agree", "fitting",
                     "runner", "loop"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for reason, count in other.finish.items():
            self.finish[reason] = self.finish.get(reason, 0) + count
        self.seconds = [a + b for a, b in zip(self.seconds, other.seconds)] if self.seconds else list(other.seconds)

    def summary(self) -> dict[str, Any]:
        seconds = statistics.median(self.seconds) if self.seconds else 0.0  # a repeat's: its tokens are counted once
        ended = self.finish.get("eos", 0) + self.finish.get("tool_calls", 0)
        return {"requests": self.requests, "valid": self.valid, "finish": self.finish,
                "ended": round(ended / self.requests, 3) if self.requests else None,
                "tokens_per_forward": round(self.tokens / max(1, self.forwards), 3),
                "tokens_per_second": round(self.tokens / seconds, 1) if seconds else None,
                "forwards": self.forwards, "tokens": self.tokens, "forced_share": round(self.forced / max(1, self.tokens), 3),
                "runner_ms_per_forward": round(self.runner / max(1, self.forwards) * 1e3, 3),
                "loop_ms_per_forward": round(self.loop / max(1, self.forwards) * 1e3, 3),
                "accuracy": round(self.accurate / self.scored, 3) if self.scored else None,
                "agreement": round(self.agree / self.fitting, 3) if self.fitting else None}


def asks(case: GuideCase, prompt: str, chat: bool) -> dict[str, Any]:
    if case.tools or chat:
        return {"messages": [{"role": "user", "content": prompt}], **case.settings}
    return {"prompt": prompt, **case.settings}


def prompts_for(case: GuideCase, n: int, embedded: bool) -> list[tuple[str, str | None]]:
    """(prompt, the task's answer or None) for a case: the held-out prompts of its task on the embedded model."""
    if not embedded:
        return [(p, None) for p in RANDOM_PROMPTS[:n]]
    examples = [ex for ex in held_out(12 * n) if case.task in ("*", ex.task) or case.task is None]
    return [(ex.prompt, ex.answer if case.task else None) for ex in examples[:n]]


def run_model(gen: Generator, embedded: bool, n: int, repeats: int, timing: Timing) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in CASES:
        settings: dict[str, Any] = {} if embedded else RANDOM_SETTINGS
        if case.tools and embedded:
            try:  # a chat template without a tool format refuses it
                gen.prompt_ids(messages=[{"role": "user", "content": "go"}],
                               tools=read_tools(case.settings["tools"], case.settings["tool_choice"]))
            except RefusionError as e:
                out[case.name] = {"refused": str(e)}
                continue
            settings = {"gen_length": RANDOM_SETTINGS["gen_length"]}  # a call to move: 70 tokens, past a canvas of 64
        prompts = prompts_for(case, n, embedded)
        kinds = ("unguided", "guided", "unforced")  # unguided first: the guided read it
        tallies = {f"{m} {kind}": Tally() for m in METHODS for kind in kinds}
        for repeat in range(repeats):
            spent = {name: 0.0 for name in tallies}
            for i, (prompt, answer) in enumerate(prompts):
                for mode in _in_turn(i):
                    for kind in kinds:
                        timing.forcing = kind != "unforced"
                        ask = asks(case, prompt, embedded)
                        if kind == "unguided":
                            ask = {k: v for k, v in ask.items() if k not in case.settings}
                        t0 = time.perf_counter()
                        result = gen.generate(**ask, mode=mode, **settings)
                        spent[f"{mode} {kind}"] += time.perf_counter() - t0
                        if repeat:
                            continue
                        tally = tallies[f"{mode} {kind}"]
                        tally.add(result)
                        if kind == "unguided":
                            free = result
                            continue
                        tally.valid += case.valid(result)
                        framed = case.answer(result) if case.valid(result) else None
                        if answer is not None:
                            tally.scored += 1
                            tally.accurate += framed is not None and framed.strip() == answer
                            tallies[f"{mode} unguided"].scored += kind == "guided"
                            tallies[f"{mode} unguided"].accurate += kind == "guided" and free.text.strip() == answer
                        if case.task and case.valid(free):  # the unconstrained answer already follows the guide
                            tally.fitting += 1
                            tally.agree += framed == case.answer(free)
            for name, seconds in spent.items():
                tallies[name].seconds.append(seconds)
        timing.forcing = True
        out[case.name] = {name: t.summary() for name, t in tallies.items()}
    return out


def run_families(gen: Generator, n: int, repeats: int) -> dict[str, Any]:
    """Each family case over its first n held-out examples, each asked as the case builds it from the example, each
    method in turn: per case and method a summary and the ReFusion/AR ratios; then the same over each family's
    cases ("json family", ...) and over every case ("guided": every family case carries a guide; tool_choice auto's is
    a call or text without one)."""
    out: dict[str, Any] = {}
    groups: dict[str, dict[str, Tally]] = {}
    for case in FAMILY_CASES:
        tallies = {mode: Tally() for mode in METHODS}
        examples = case.examples(n)
        for repeat in range(repeats):
            spent = dict.fromkeys(METHODS, 0.0)
            for i, example in enumerate(examples):
                for mode in _in_turn(i):  # later repeats find every prompt cached, as an app's tool list is
                    t0 = time.perf_counter()
                    result = gen.generate(**case.asks(example), mode=mode)
                    spent[mode] += time.perf_counter() - t0
                    if repeat:
                        continue
                    tally = tallies[mode]
                    tally.add(result)
                    tally.valid += case.valid(example, result)
                    tally.scored += 1
                    tally.accurate += case.accurate(example, result)
            for mode, seconds in spent.items():
                tallies[mode].seconds.append(seconds)
        for group in (f"{case.family} family", "guided"):
            for mode, tally in tallies.items():
                groups.setdefault(group, {m: Tally() for m in METHODS})[mode].include(tally)
        out[case.name] = _versus({mode: t.summary() for mode, t in tallies.items()})
    for group in sorted(groups, key=lambda g: (not g.endswith(" family"), g)):  # each family's, then guided, unguided
        out[group] = _versus({mode: t.summary() for mode, t in groups[group].items()})
    return out


def _versus(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each method's summary, and ReFusion's tokens/s and tokens per forward over AR's."""
    r, ar = summaries["refusion"], summaries["ar"]
    speed = r["tokens_per_second"] / ar["tokens_per_second"] if r["tokens_per_second"] and ar["tokens_per_second"] else None
    return {**summaries, "ratios": {"tokens_per_second": speed,
                                    "tokens_per_forward": r["tokens_per_forward"] / ar["tokens_per_forward"]
                                    if ar["tokens_per_forward"] else None}}


# ----------------------------------------------------------------------------- what vocab_mask costs a forward
def without_mask(infiller: Path, out: Path) -> Path:
    """The infiller graph with vocab_mask's nodes taken out (the logits straight to the heads): the graph of an
    export before it (format 6), over the same weights."""
    import onnx

    model = onnx.load(infiller, load_external_data=False)
    graph = model.graph
    where = next(n for n in graph.node if n.op_type == "Where" and "vocab_mask" in _upstream(graph, n.input[0]))
    for node in graph.node:
        node.input[:] = [where.input[1] if i == where.output[0] else i for i in node.input]
    wanted = {o.name for o in graph.output}
    kept = [n for n in graph.node if n is not where]
    while True:  # drop what nothing reads any more: the mask's nodes, their constants
        read = wanted | {i for n in kept for i in n.input}
        live = [n for n in kept if any(o in read for o in n.output)]
        if len(live) == len(kept):
            break
        kept = live
    read = {i for n in kept for i in n.input}
    initializers = [t for t in graph.initializer if t.name in read]
    inputs = [i for i in graph.input if i.name != "vocab_mask"]
    del graph.node[:], graph.initializer[:], graph.input[:]
    graph.node.extend(kept)
    graph.initializer.extend(initializers)
    graph.input.extend(inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, out)
    return out


def _upstream(graph: Any, name: str) -> set[str]:
    """Every tensor `name` is computed from."""
    makers = {o: n for n in graph.node for o in n.output}
    seen, todo = set(), [name]
    while todo:
        tensor = todo.pop()
        if tensor not in seen:
            seen.add(tensor)
            todo.extend(makers[tensor].input if tensor in makers else [])
    return seen


def mask_cost(export: Path, work: Path, repeats: int) -> dict[str, Any]:
    """Median forward time of the infiller with and without vocab_mask's nodes (an all-ones mask: no guide), and
    with a guide's mask a head, at an AR step and a ReFusion block, interleaved; onnxruntime CPU, one thread."""
    import shutil

    import onnxruntime as ort

    from refusion.runtime.core.contract import mask_bytes
    from refusion.runtime.core.export_manifest import ExportManifest

    m = ExportManifest.load(export)
    base = work / "no-mask"
    if base.exists():
        shutil.rmtree(base)
    shutil.copytree(export, base)
    without_mask(export / "infiller.onnx", base / "infiller.onnx")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sessions = {name: ort.InferenceSession(str((base if name == "none" else export) / "infiller.onnx"), options)
                for name in ("none", "vocab_mask", "guided")}  # a session each: each as warm as the others
    rng = np.random.default_rng(0)
    past, out = 48, {}
    for label, seq in (("AR step (1 token, 1 head)", 1), ("ReFusion block (16 tokens, 16 heads)", 16)):
        feed = {"input_ids": rng.integers(0, min(300, m.vocab_size), (1, seq)), "position_ids": np.arange(past, past + seq)[None],
                "attention_mask": causal_after(past, seq), "head_positions": np.arange(seq)[None]}
        for i in range(m.num_layers):
            for kind in ("key", "value"):
                feed[f"past_key_values.{i}.{kind}"] = rng.standard_normal((1, past, m.kv_heads, m.head_dim)).astype(np.float32)
        ones = np.full((1, 1, mask_bytes(m.vocab_size)), 255, np.uint8)
        guided = np.packbits(rng.random((1, seq, 8 * mask_bytes(m.vocab_size))) < 0.5, axis=-1, bitorder="little")
        variants = {"none": feed, "vocab_mask": {**feed, "vocab_mask": ones}, "guided": {**feed, "vocab_mask": guided}}
        same = all(np.array_equal(a, b) for a, b in zip(sessions["none"].run(None, feed),
                                                         sessions["vocab_mask"].run(None, variants["vocab_mask"])))
        times: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(repeats):
            for name in list(variants)[:: 1 if r % 2 else -1]:  # the order alternates: neither runs warmer
                session = sessions[name]
                t0 = time.perf_counter()
                session.run(["argmax_ids"], variants[name])
                times[name].append(time.perf_counter() - t0)
        median = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        out[label] = {"ms": {k: round(v, 4) for k, v in median.items()}, "equal": same,
                      "overhead": round(median["vocab_mask"] / median["none"] - 1, 4)}
    return out


# ----------------------------------------------------------------------------- the report
def random_export(work: Path) -> Path:
    from refusion.export.exporter import export_onnx
    from refusion.tools.checks.fixtures.checkpoints import make_checkpoint

    ckpt = make_checkpoint(work / "random-ckpt")
    return export_onnx(ckpt, work / "random-onnx", force=True, validate=False)


def large_vocabulary_export(work: Path) -> Path:
    """A random 1-layer model with Qwen3's vocabulary (151936) and hidden 256: where the vocabulary head, and so the
    mask's share of a forward, weighs most (at Qwen3-8B's hidden 4096 the head is 16x larger beside the mask)."""
    from refusion.export.exporter import export_onnx
    from refusion.tools.checks.fixtures.checkpoints import TinySpec, make_checkpoint

    spec = TinySpec(num_layers=1, hidden_size=256, num_heads=4, kv_heads=2, head_dim=64, intermediate_size=512,
                    vocab_size=151936)
    return export_onnx(make_checkpoint(work / "vocab-ckpt", spec), work / "vocab-onnx", force=True, validate=False)


def embedded_export(work: Path) -> Path:
    from refusion.export.exporter import export_onnx
    from refusion.models import EMBEDDED_MODEL

    return export_onnx(EMBEDDED_MODEL, work / "tiny-onnx", force=True, validate=False)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def report(data: dict[str, Any]) -> str:
    lines = [f"# Structured output: {data['machine']['cpu']}, onnxruntime CPU, {data['threads']} thread(s)", "",
             "Generated by `python -m refusion.tools.bench.measure.structured` (docs/decoding.md, \"Structured "
             "output\", reads it). First the guides outside the models' families (guides.CASES), one guide for every "
             "prompt, then the structured families' cases (guides.FAMILY_CASES). Each model's prompts, each method "
             f"interleaved; tokens/s: the median of {data['repeats']} repeats (a shared machine: read ratios). "
             "`unforced`: the same guided requests with the engine's forcing off.", ""]
    for model, runs in data["models"].items():
        lines += [f"## {model}", "", "| guide | method | valid | finish | tokens/forward | tokens/s | forced share | "
                  "accuracy | agrees with unguided |", "|---|---|---|---|---|---|---|---|---|"]
        for case, methods in runs.items():
            if "refused" in methods:
                lines.append(f"| {case} | (refused) | {methods['refused']} | | | | | | |")
                continue
            for name, s in methods.items():
                valid = f"{s['valid']}/{s['requests']}" if "unguided" not in name else "-"
                finish = ", ".join(f"{k} {v}" for k, v in sorted(s["finish"].items()))
                acc = "-" if s["accuracy"] is None else f"{s['accuracy']:.0%}"
                agree = "-" if s["agreement"] is None else f"{s['agreement']:.0%}"
                lines.append(f"| {case} | {name} | {valid} | {finish} | {s['tokens_per_forward']:.2f} | "
                             f"{s['tokens_per_second']} | {s['forced_share']:.0%} | {acc} | {agree} |")
        totals = data["totals"][model]
        lines += ["", "Over every guide: " + "; ".join(f"{k} {v['tokens_per_second']} tokens/s, "
                                                        f"{v['tokens_per_forward']:.2f} tokens/forward, "
                                                        f"{v['forwards']} forwards"
                                                        for k, v in totals.items()), ""]
        ratio = data["ratios"][model]
        lines += [f"Constrained ReFusion against constrained AR: {ratio['tokens_per_second']:.2f}x tokens/s, "
                  f"{ratio['tokens_per_forward']:.2f}x tokens/forward; against unconstrained ReFusion: "
                  f"{ratio['vs_unguided_tokens_per_forward']:.2f}x tokens/forward. Forced tokens save "
                  f"{ratio['forwards_saved_refusion']:.0%} of ReFusion's forwards and {ratio['forwards_saved_ar']:.0%} "
                  "of AR's (guided against unforced).", ""]
        t = data["engine"][model]
        lines += [f"Grammar engine ({data['engine_name']}): mask {t['mask_us_p50']:.1f} us p50, {t['mask_us_p99']:.1f} us "
                  f"p99 a row ({t['masks']} masks); compile {t['compile_ms_median']:.2f} ms median, "
                  f"{t['compile_ms_max']:.2f} ms max ({t['guides']} guides).", ""]
    if "families" in data:
        lines += family_lines(data)
    lines += ["## What vocab_mask costs a forward (onnxruntime CPU, 1 thread)", "",
              "The same graph without the mask's nodes (an export of format 6) against the mask all ones (a request "
              "without a guide) and a guide's masks, a head each; the heads of the first two compared bit for bit.", "",
              "| model | forward | no mask nodes (v6) ms | all-ones mask ms | a guide's masks ms | overhead | heads equal |",
              "|---|---|---|---|---|---|---|"]
    for model, costs in data["mask_cost"].items():
        for label, c in costs.items():
            lines.append(f"| {model} | {label} | {c['ms']['none']:.3f} | {c['ms']['vocab_mask']:.3f} | "
                         f"{c['ms']['guided']:.3f} | {c['overhead']:+.1%} | {'bit for bit' if c['equal'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def family_lines(data: dict[str, Any]) -> list[str]:
    """The family cases' section: what each measures, and a row each, ReFusion / AR in every cell."""
    lines = ["## The structured families on the embedded model", "",
             f"Each case's first {data['examples']} held-out examples of its family (tools/families.py), each asked as "
             "it is: its conversation, its tools or its schema. valid: ended by itself (EOS, or the call) and follows "
             "the schema (a call: the called function's parameters); accuracy: valid, and the answer read back is the "
             "example's (the same JSON value, the same call name and arguments, the same text); ended: the share that "
             "ended by the structure (EOS or the call) rather than at max_tokens; ms a forward: the seconds of a method's "
             "requests in the runner (the graphs) and the rest on the scheduler (masks, drafts, bookkeeping), each over "
             "its forwards (a request's first, its prompt's, included). Each cell: ReFusion / AR. The "
             "random-weight model runs none of these: it has no family answer to be accurate to.", ""]
    lines += [f"- `{c.name}` ({c.family} family, max_tokens {c.max_tokens}): {c.about}" for c in FAMILY_CASES]
    lines += ["", "| case | valid | accuracy | ended | tokens/forward | ms a forward: runner + loop | tokens/s | "
              "ReFusion/AR tokens/s | ReFusion/AR tokens/forward |", "|---|---|---|---|---|---|---|---|---|"]
    names = {c.name for c in FAMILY_CASES}
    for case, runs in data["families"].items():
        r, ar, ratios = runs["refusion"], runs["ar"], runs["ratios"]
        shares = [(s["valid"] / max(1, s["requests"]), s["accuracy"], s["ended"]) for s in (r, ar)]
        cells = [f"{_percent(a)} / {_percent(b)}" for a, b in zip(*shares)]
        cells += [f"{r['tokens_per_forward']:.2f} / {ar['tokens_per_forward']:.2f}",
                  " / ".join(f"{x['runner_ms_per_forward']:.2f} + {x['loop_ms_per_forward']:.2f}" for x in (r, ar)),
                  f"{r['tokens_per_second']} / {ar['tokens_per_second']}"]
        cells += ["-" if ratios[key] is None else f"{ratios[key]:.2f}x" for key in ("tokens_per_second", "tokens_per_forward")]
        label = case if case in names else f"**{case}**"  # a group: a family's cases, or all of them
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    whole = data["whole_set"]
    lines += ["", f"The whole guided set (guides.CASES on the embedded model and every guided family case, "
                  f"{whole['requests']} requests a method): constrained ReFusion {whole['refusion']['tokens_per_second']}"
                  f" tokens/s ({whole['refusion']['tokens_per_forward']:.2f} tokens/forward), constrained AR "
                  f"{whole['ar']['tokens_per_second']} ({whole['ar']['tokens_per_forward']:.2f}): "
                  f"**{whole['ratios']['tokens_per_second']:.2f}x** tokens/s, "
                  f"{whole['ratios']['tokens_per_forward']:.2f}x tokens/forward."]
    return lines + [""]


def whole_set(cases: dict[str, Any], families: dict[str, Any]) -> dict[str, Any]:
    """Constrained ReFusion against constrained AR over guides.CASES' runs on the embedded model and the guided
    family cases together: tokens over seconds (each part's tokens over its tokens/s), tokens over forwards."""
    out: dict[str, Any] = {"requests": 0}
    for mode in METHODS:
        parts = [methods[f"{mode} guided"] for methods in cases.values() if f"{mode} guided" in methods]
        parts.append(families["guided"][mode])
        tokens, forwards = sum(p["tokens"] for p in parts), sum(p["forwards"] for p in parts)
        seconds = sum(p["tokens"] / p["tokens_per_second"] for p in parts if p["tokens_per_second"])
        out[mode] = {"tokens_per_second": round(tokens / seconds, 1), "tokens_per_forward": tokens / max(1, forwards)}
        out["requests"] = sum(p["requests"] for p in parts)
    r, ar = out["refusion"], out["ar"]
    out["ratios"] = {key: r[key] / ar[key] for key in ("tokens_per_second", "tokens_per_forward")}
    return out


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("results/structured"))
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--examples", type=int, default=24, help="held-out examples of each family case")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    exports = {"embedded model (models/refusion-tiny)": (embedded_export(args.work), True),
               "random-weight model (2 layers, byte-level BPE, tool template)": (random_export(args.work), False)}
    data: dict[str, Any] = {"machine": {"cpu": cpu_model(), **host_info(("onnxruntime", "numpy", "llguidance"))},
                            "threads": args.threads, "repeats": args.repeats, "prompts": args.prompts,
                            "examples": args.examples, "models": {}, "totals": {}, "ratios": {}, "engine": {}}
    for name, (export, embedded) in exports.items():
        with Generator.from_dir(export, backend="ort-cpu", threads=args.threads) as gen:
            timing = Timing()
            gen.guides.wrap(lambda engine, timing=timing: _TimedEngine(engine, timing))
            data["engine_name"] = gen.guides.engine.name
            runs = run_model(gen, embedded, args.prompts, args.repeats, timing)
            if embedded:
                data["families"] = run_families(gen, args.examples, args.repeats)
                data["whole_set"] = whole_set(runs, data["families"])
        data["models"][name] = runs
        totals: dict[str, dict[str, Any]] = {}
        for method in ("refusion guided", "ar guided", "refusion unguided", "ar unguided", "refusion unforced",
                       "ar unforced"):
            parts = [r[method] for r in runs.values() if method in r]
            tokens, forwards = sum(p["tokens"] for p in parts), sum(p["forwards"] for p in parts)
            seconds = sum(p["tokens"] / p["tokens_per_second"] for p in parts if p["tokens_per_second"])
            totals[method] = {"tokens": tokens, "forwards": forwards, "tokens_per_forward": tokens / max(1, forwards),
                              "tokens_per_second": round(tokens / seconds, 1) if seconds else None}
        data["totals"][name] = totals
        data["ratios"][name] = {
            "tokens_per_second": totals["refusion guided"]["tokens_per_second"] / totals["ar guided"]["tokens_per_second"],
            "tokens_per_forward": totals["refusion guided"]["tokens_per_forward"] / totals["ar guided"]["tokens_per_forward"],
            "vs_unguided_tokens_per_forward": (totals["refusion guided"]["tokens_per_forward"]
                                               / totals["refusion unguided"]["tokens_per_forward"]),
            "forwards_saved_refusion": 1 - totals["refusion guided"]["forwards"] / totals["refusion unforced"]["forwards"],
            "forwards_saved_ar": 1 - totals["ar guided"]["forwards"] / totals["ar unforced"]["forwards"]}
        compiles = list(timing.compiles.values())
        data["engine"][name] = {"masks": len(timing.masks), "mask_us_p50": percentile(timing.masks, 50) * 1e6,
                                "mask_us_p99": percentile(timing.masks, 99) * 1e6, "guides": len(compiles),
                                "compile_ms_median": statistics.median(compiles) * 1e3 if compiles else 0.0,
                                "compile_ms_max": max(compiles, default=0.0) * 1e3}
    data["mask_cost"] = {
        "embedded model": mask_cost(exports["embedded model (models/refusion-tiny)"][0], args.work, 200 * args.repeats),
        "Qwen3's vocabulary (151936), hidden 256": mask_cost(large_vocabulary_export(args.work), args.work,
                                                             50 * args.repeats)}
    markdown = report(data)
    write_report(args.out, "structured", markdown, data, None, progress)
    print(markdown)


if __name__ == "__main__":
    main()
