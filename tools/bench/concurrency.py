"""`refusion-run bench-concurrency`: throughput and latency of one shared Generator under closed-loop clients.

    refusion-run bench-concurrency models/refusion-tiny [--concurrency 1,2,4,8,16] [--requests 256]
        [--threads 1] [--max-requests R] [--max-batch B] [--mode refusion|ar] [--profile 16] [--out results/concurrency]

For each concurrency level C, C client threads share one Generator (onnxruntime CPU): each
takes the next of the same `--requests` held-out chat prompts, submits it, reads its settled
text as it grows, waits for its result and takes the next, until none is left. Decoding is
greedy with the export's recorded settings (ReFusion), or AR with `--mode ar`. Per level, in
genai-perf's terms:
  output tokens/s, requests/s  all requests' generated tokens (through the first EOS) and the
                               requests, over the level's wall time (first submit to last result);
  time to first text (TTFT)    submit() to the first piece of settled text, as iterating the
                               Request yields it (queueing included);
  inter-token latency (ITL)    per request: time from its first settled piece to its last, over
                               the tokens those later pieces carry (ReFusion settles tokens in
                               runs, so this is the mean gap per token; a request whose text
                               settles in one piece has none);
  request latency              submit() to result(); p50 / p90 / p99 over the level's requests;
  speedup                      output tokens/s over that of concurrency 1;
  identical                    requests whose token_ids equal those of the same prompt at
                               concurrency 1, where each request runs alone.
And where the engine thread's time goes: inside onnxruntime's session.run, the rest of
run_batch (packing rows, copying KV), KV moves, the engine's own Python (step machines,
policy, masks, commits), and idle (waiting for a submit).

Writes OUT/<mode>-threads<T>[-batch<B>].md, .json and .png (needs matplotlib); with
`--profile C`, level C runs once more under cProfile on the engine thread: OUT/<stem>-profile.txt.
"""

from __future__ import annotations

import cProfile
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click
import numpy as np

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import MANIFEST_NAME
from refusion.runtime.generator import Generator
from refusion.runtime.request import SettledText
from refusion.tools import tasks as T
from refusion.tools.bench.decoding import host_info, profile_report
from refusion.tools.cli_common import progress as echo_progress

Progress = Callable[[str], None]  # takes a line of text

DEFAULT_LEVELS = "1,2,4,8,16"
DEFAULT_REQUESTS = 256
DEFAULT_REPEATS = 5
TARGET_LEVEL = 16  # issue 11: aggregate tokens/s at 16 concurrent requests >= 3x single-stream, identical tokens
TARGET_SPEEDUP = 3.0
PERCENTILES = (50, 90, 99)
TIME_PARTS = ("onnxruntime", "packing", "kv_moves", "engine_python", "idle")


@dataclass
class ConcurrencyConfig:
    model: Path
    levels: tuple[int, ...] = (1, 2, 4, 8, 16)
    requests: int = DEFAULT_REQUESTS
    repeats: int = DEFAULT_REPEATS
    threads: int = 1
    max_requests: int | None = None
    max_batch: int | None = None
    mode: str = "refusion"
    warmup: int = 32
    out: Path | None = Path("results/concurrency")
    plot: bool = True
    profile: int | None = None  # a level to run again under cProfile

    @property
    def stem(self) -> str:
        return f"{self.mode}-threads{self.threads}" + (f"-batch{self.max_batch}" if self.max_batch else "")


def parse_levels(text: str) -> tuple[int, ...]:
    """"1,2,4" -> (1, 2, 4): sorted, distinct, and 1 among them (the baseline)."""
    try:
        levels = sorted({int(t) for t in text.replace(" ", "").split(",") if t})
    except ValueError as e:
        raise RefusionError(f"--concurrency {text!r} is not a comma-separated list of integers, "
                            "e.g. 1,2,4,8,16.") from e
    if not levels or levels[0] < 1:
        raise RefusionError(f"--concurrency {text!r}: every level must be a positive number of clients.")
    if levels[0] != 1:
        raise RefusionError(f"--concurrency {text!r} lacks 1: concurrency 1 is the baseline of the speedup and of the "
                            "identical-tokens check; add it, e.g. --concurrency 1," + text)
    return tuple(levels)


# ----------------------------------------------------------------------------- measuring


@dataclass
class Timing:
    """One request as its client saw it (seconds)."""

    token_ids: list[int]
    tokens: int  # generated tokens through the first EOS (GenerationStats.tokens)
    settled: int  # tokens of settled text (the EOS not counted)
    pieces: int  # pieces of settled text
    latency: float  # submit() -> result()
    ttft: float | None  # submit() -> first settled piece; None: no text
    itl: float | None  # (last piece - first piece) / tokens after the first piece; None: one piece or none
    correct: bool = False


def inter_token_latency(stamps: list[tuple[float, int]]) -> float | None:
    """`stamps`: (time, settled tokens so far) at each piece of text. The time from the first piece to
    the last over the tokens that came after the first; None when there is no gap to measure."""
    if len(stamps) < 2 or stamps[-1][1] == stamps[0][1]:
        return None
    return (stamps[-1][0] - stamps[0][0]) / (stamps[-1][1] - stamps[0][1])


def run_request(gen: Generator, ids: list[int], settings: dict[str, Any]) -> Timing:
    """Submit, read the settled text as iterating the Request does (SettledText over its commits,
    here with the token count of each piece), wait for the result."""
    assert gen.tokenizer is not None
    t0 = time.perf_counter()
    request = gen.submit(prompt_ids=ids, **settings)
    text = SettledText(len(ids), gen.manifest.eos_token_id, gen.tokenizer.decode)
    stamps: list[tuple[float, int]] = []
    for commit in request.events():
        if text.add(commit):
            stamps.append((time.perf_counter() - t0, len(text.settled)))
    result = request.result()
    latency = time.perf_counter() - t0
    return Timing(result.token_ids, result.stats.tokens, len(text.settled), len(stamps), latency,
                  stamps[0][0] if stamps else None, inter_token_latency(stamps))


class EngineMeter:
    """Where the engine thread's time goes, by wrapping its runner's run_batch and _session_run
    and its rounds (instance attributes: the Generator's classes are untouched). Optionally
    cProfiles the rounds, which run on the engine thread."""

    def __init__(self, gen: Generator):
        self.runner = gen.runner
        self.calls = self.rows = self.fed = self.padded = self.rounds = 0
        self.run_seconds = self.session_seconds = self.move_seconds = self.busy_seconds = 0.0
        self.profiler: cProfile.Profile | None = None
        run_batch, session_run = gen.runner.run_batch, gen.runner._session_run  # type: ignore[attr-defined]
        move_kv, do_round = gen.runner.move_kv, gen.scheduler._round

        def metered_run_batch(graph, rows):
            t0 = time.perf_counter()
            try:
                return run_batch(graph, rows)
            finally:
                self.run_seconds += time.perf_counter() - t0
                self.calls += 1
                self.rows += len(rows)
                self.fed += sum(r.input_ids.shape[1] for r in rows)
                self.padded += len(rows) * max(r.input_ids.shape[1] for r in rows)  # rows padded to the longest

        def metered_move_kv(*args):
            t0 = time.perf_counter()
            try:
                return move_kv(*args)
            finally:
                self.move_seconds += time.perf_counter() - t0

        def metered_session_run(*args):
            t0 = time.perf_counter()
            try:
                return session_run(*args)
            finally:
                self.session_seconds += time.perf_counter() - t0

        def metered_round():
            profiler = self.profiler
            t0 = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            try:
                do_round()
            finally:
                if profiler is not None:
                    profiler.disable()
                self.busy_seconds += time.perf_counter() - t0
                self.rounds += 1

        gen.runner.run_batch = metered_run_batch  # type: ignore[method-assign]
        gen.runner._session_run = metered_session_run  # type: ignore[attr-defined]
        gen.runner.move_kv = metered_move_kv  # type: ignore[method-assign]
        gen.scheduler._round = metered_round  # type: ignore[method-assign]

    def snapshot(self) -> dict[str, float]:
        return {"calls": self.calls, "rows": self.rows, "fed": self.fed, "padded": self.padded, "rounds": self.rounds,
                "run": self.run_seconds, "session": self.session_seconds, "moves": self.move_seconds,
                "busy": self.busy_seconds}


@dataclass
class LevelRun:
    """One pass of a level: timings in prompt order, wall seconds, the engine's counters (EngineMeter)."""

    timings: list[Timing]
    wall: float
    counters: dict[str, float]

    @property
    def tokens_per_second(self) -> float:
        return sum(t.tokens for t in self.timings) / self.wall


def run_level(gen: Generator, prompts: list[list[int]], settings: dict[str, Any], concurrency: int,
              meter: EngineMeter) -> LevelRun:
    """`concurrency` closed-loop clients over `prompts`, each taking the next prompt when its request ends."""
    timings: list[Timing | None] = [None] * len(prompts)
    errors: list[BaseException] = []
    queue = iter(range(len(prompts)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(queue, None)
            if i is None:
                return
            try:
                timings[i] = run_request(gen, prompts[i], settings)
            except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
                errors.append(e)
                return

    before = meter.snapshot()
    t0 = time.perf_counter()
    clients = [threading.Thread(target=client, name=f"client-{c}") for c in range(concurrency)]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    after = meter.snapshot()
    return LevelRun([t for t in timings if t is not None], wall, {k: after[k] - before[k] for k in after})


# ----------------------------------------------------------------------------- the run


def resolve_model(model: Path, work: Path, progress: Progress) -> Path:
    """The export directory: `model` itself, or `model` (a checkpoint) exported into `work`."""
    if (model / MANIFEST_NAME).is_file():
        return model
    if (model / "config.json").is_file():
        from refusion.export.exporter import export_onnx

        progress(f"exporting {model} -> {work / 'onnx'}")
        return export_onnx(model, work / "onnx", force=True, validate=False)
    raise RefusionError(f"{model} is neither an export ({MANIFEST_NAME}) nor a checkpoint (config.json).")


def run_concurrency_bench(cfg: ConcurrencyConfig, progress: Progress = echo_progress) -> dict[str, Any]:
    """Run every level (and the profile); write the outputs into cfg.out (if set); return the report."""
    for name in ("threads", "requests", "repeats"):
        if getattr(cfg, name) < 1:
            raise RefusionError(f"--{name} {getattr(cfg, name)} must be at least 1.")
    if cfg.warmup < 0:
        raise RefusionError(f"--warmup {cfg.warmup} must be 0 or more.")
    if cfg.requests < max(cfg.levels):
        raise RefusionError(f"--requests {cfg.requests} is fewer than concurrency {max(cfg.levels)}: every client "
                            f"needs requests; give --requests {8 * max(cfg.levels)} or more for a steady state.")
    if cfg.profile is not None and cfg.profile not in cfg.levels:
        raise RefusionError(f"--profile {cfg.profile} is not one of the levels {','.join(map(str, cfg.levels))}.")
    try:
        examples = T.held_out(cfg.requests + cfg.warmup)
    except ValueError as e:
        raise RefusionError(f"--requests + --warmup: {e}") from e
    with tempfile.TemporaryDirectory(prefix="refusion-concurrency-") as tmp:
        export_dir = resolve_model(Path(cfg.model), Path(tmp), progress)
        with Generator.from_dir(export_dir, backend="ort-cpu", threads=cfg.threads, max_requests=cfg.max_requests,
                                max_batch=cfg.max_batch) as gen:
            if gen.tokenizer is None:
                raise RefusionError(f"{export_dir} carries no tokenizer: the bench needs one for its chat prompts "
                                    "and settled text; export the checkpoint with its tokenizer files.")
            settings = {"mode": cfg.mode}
            params = gen.params(**settings)
            prompts = [gen.prompt_ids(ex.prompt, chat=True) for ex in examples]
            meter = EngineMeter(gen)
            load = [os.getloadavg()[0]]  # other work on the machine skews every number
            progress(f"{gen.runner.name}, {cfg.threads} thread(s), {gen.runner.max_requests} KV regions, forwards packed "
                     f"{gen.runner.max_batch} at most; {cfg.mode} {settings_label(asdict(params))}; "
                     f"{cfg.requests} requests per level x {cfg.repeats} passes, warm-up {cfg.warmup} at concurrency "
                     f"{max(cfg.levels)}")
            if cfg.warmup:
                run_level(gen, prompts[cfg.requests:], settings, min(max(cfg.levels), cfg.warmup), meter)
            bench, bench_examples = prompts[: cfg.requests], examples[: cfg.requests]
            runs: dict[int, list[LevelRun]] = {c: [] for c in cfg.levels}
            for repeat in range(1, cfg.repeats + 1):  # levels interleaved, so slow spells of the machine spread out
                for c in cfg.levels:
                    run = run_level(gen, bench, settings, c, meter)
                    for ex, t in zip(bench_examples, run.timings, strict=True):
                        t.correct = T.score(ex, gen.tokenizer.decode(_answer(t.token_ids, gen.manifest.eos_token_id)))
                    runs[c].append(run)
                    progress(f"[{repeat}/{cfg.repeats}] " + _run_line(c, run, runs[1][0]))
            levels = [summarize_level(c, runs[c], runs[1]) for c in cfg.levels]
            for level in levels:
                progress(_level_line(level))
            profile = (profile_level(gen, bench, settings, cfg.profile, meter) if cfg.profile is not None
                       else None)
            load.append(os.getloadavg()[0])
            runner_info = {"backend": gen.runner.name, "max_requests": gen.runner.max_requests,
                           "max_batch": gen.runner.max_batch}
        report = make_report(cfg, export_dir, runner_info, asdict(params), levels, examples[: cfg.requests], load)
    if profile is not None:
        report["profile"] = profile
    if cfg.out is not None:
        write_outputs(report, Path(cfg.out), cfg.stem, cfg.plot, progress)
    return report


def _answer(token_ids: list[int], eos: int) -> list[int]:
    return token_ids[: token_ids.index(eos)] if eos in token_ids else token_ids


def profile_level(gen: Generator, prompts: list[list[int]], settings: dict[str, Any], concurrency: int,
                  meter: EngineMeter, top: int = 30) -> str:
    """Level `concurrency` again, with cProfile on the engine thread's rounds (not in the tables)."""
    meter.profiler = cProfile.Profile()
    try:
        run = run_level(gen, prompts, settings, concurrency, meter)
    finally:
        profiler, meter.profiler = meter.profiler, None
    timings, wall, counters = run.timings, run.wall, run.counters
    tokens = sum(t.tokens for t in timings)
    return profile_report(profiler, f"concurrency {concurrency} under cProfile (engine thread, its rounds only): "
                          f"{len(timings)} requests, {tokens} tokens in {wall:.3f} s ({tokens / wall:.0f} tokens/s; the "
                          f"profiler slows the Python part); busy {counters['busy']:.3f} s, of which run_batch "
                          f"{counters['run']:.3f} s (onnxruntime session.run {counters['session']:.3f} s), "
                          f"{counters['calls']:.0f} forwards", top)


# ----------------------------------------------------------------------------- aggregation


def percentiles(values: list[float]) -> dict[str, float] | None:
    """p50 / p90 / p99 and the mean, in milliseconds (None for no values)."""
    if not values:
        return None
    ms = 1000 * np.asarray(values)
    return {**{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}, "mean": float(ms.mean())}


def time_split(counters: dict[str, float], wall: float) -> dict[str, float]:
    """The engine thread's wall time, in seconds, by part (TIME_PARTS)."""
    return {"onnxruntime": counters["session"], "packing": counters["run"] - counters["session"],
            "kv_moves": counters["moves"], "engine_python": counters["busy"] - counters["run"] - counters["moves"],
            "idle": wall - counters["busy"]}


def median_run(runs: list[LevelRun]) -> LevelRun:
    return sorted(runs, key=lambda run: run.tokens_per_second)[len(runs) // 2]


def summarize_timings(concurrency: int, runs: list[LevelRun], baseline: list[LevelRun],
                      oracle: list[Timing]) -> dict[str, Any]:
    """A level over its repeats as its clients saw it: throughput from the median repeat (its range beside
    it), latencies over every request of every repeat, identical tokens against `oracle` (each request
    alone), and the median repeat's requests. bench-serve summarizes each side's levels with it too."""
    timings = [t for run in runs for t in run.timings]
    tps = [run.tokens_per_second for run in runs]
    median = median_run(runs)
    base = float(np.median([run.tokens_per_second for run in baseline]))
    return {
        "concurrency": concurrency,
        "requests": len(median.timings),
        "repeats": len(runs),
        "wall_seconds": median.wall,
        "tokens": sum(t.tokens for t in median.timings),
        "output_tokens_per_second": median.tokens_per_second,
        "output_tokens_per_second_range": [min(tps), max(tps)],
        "requests_per_second": len(median.timings) / median.wall,
        "speedup": float(np.median(tps)) / base,
        "identical": sum(t.token_ids == o.token_ids for run in runs for t, o in zip(run.timings, oracle, strict=True)),
        "compared": len(timings),
        "ttft_ms": percentiles([t.ttft for t in timings if t.ttft is not None]),
        "itl_ms": percentiles([t.itl for t in timings if t.itl is not None]),
        "itl_requests": sum(t.itl is not None for t in timings),
        "latency_ms": percentiles([t.latency for t in timings]),
        "tokens_per_piece": sum(t.settled for t in timings) / max(1, sum(t.pieces for t in timings)),
        "per_request": {  # the median repeat's
            "tokens": [t.tokens for t in median.timings],
            "latency_ms": [round(1000 * t.latency, 3) for t in median.timings],
            "ttft_ms": [None if t.ttft is None else round(1000 * t.ttft, 3) for t in median.timings]},
    }


def summarize_level(concurrency: int, runs: list[LevelRun], baseline: list[LevelRun]) -> dict[str, Any]:
    """summarize_timings against the first pass at concurrency 1 (each request alone), with the median
    repeat's correct answers and ITLs, and the engine's time pooled."""
    level = summarize_timings(concurrency, runs, baseline, baseline[0].timings)
    median = median_run(runs)
    level["per_request"]["itl_ms"] = [None if t.itl is None else round(1000 * t.itl, 4) for t in median.timings]
    wall = sum(run.wall for run in runs)
    counters = {k: sum(run.counters[k] for run in runs) for k in runs[0].counters}
    tokens = sum(t.tokens for run in runs for t in run.timings)
    split = time_split(counters, wall)
    calls = counters["calls"]
    return {
        **level,
        "correct": sum(t.correct for t in median.timings),
        "engine": {
            "forwards": int(calls),
            "rows_per_forward": counters["rows"] / calls if calls else 0.0,
            "fed_tokens_per_forward": counters["fed"] / calls if calls else 0.0,
            "padded_tokens_per_forward": counters["padded"] / calls if calls else 0.0,
            "onnxruntime_us_per_fed_token": 1e6 * counters["session"] / counters["padded"] if calls else 0.0,
            "onnxruntime_ms_per_forward": 1000 * counters["session"] / calls if calls else 0.0,
            "counters": counters,
            "seconds": split,
            "share": {k: v / wall for k, v in split.items()},
            "ms_per_token": {k: 1000 * v / tokens for k, v in split.items()} if tokens else {},
        },
    }


def _run_line(concurrency: int, run: LevelRun, alone: LevelRun) -> str:
    same = sum(t.token_ids == a.token_ids for t, a in zip(run.timings, alone.timings, strict=True))
    return (f"concurrency {concurrency:>3}: {len(run.timings)} requests in {run.wall:.2f} s, "
            f"{run.tokens_per_second:.0f} tokens/s, identical {same}/{len(run.timings)}")


def _level_line(level: dict[str, Any]) -> str:
    lat, share = level["latency_ms"], level["engine"]["share"]
    return (f"concurrency {level['concurrency']:>3}: {level['output_tokens_per_second']:.0f} tokens/s "
            f"({level['speedup']:.2f}x), {level['requests_per_second']:.1f} requests/s, "
            f"latency p50 {lat['p50']:.1f} ms p99 {lat['p99']:.1f} ms, "
            f"identical {level['identical']}/{level['compared']}; engine thread: "
            f"onnxruntime {100 * share['onnxruntime']:.0f}%, Python {100 * share['engine_python']:.0f}%, "
            f"idle {100 * share['idle']:.0f}%")


def make_report(cfg: ConcurrencyConfig, export_dir: Path, runner_info: dict[str, Any], params: dict[str, Any],
                levels: list[dict[str, Any]], examples: list[T.Example], load: list[float]) -> dict[str, Any]:
    return {
        "meta": {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model": str(cfg.model), "export_dir": str(export_dir) if export_dir == Path(cfg.model) else None,
            "threads": cfg.threads, **runner_info, "mode": cfg.mode, "params": params, "requests": cfg.requests,
            "repeats": cfg.repeats, "warmup": cfg.warmup, "held_out_seed": T.HELD_OUT_SEED,
            "prompts": "held_out chat prompts", "held_out_sha256": prompts_digest(examples),
            "decoding": "greedy (temperature 0)", "tokens": "generated tokens in position order through the first EOS",
            "host": host_info(("onnxruntime", "numpy")), "load_average": load, "command": reproduce_command(cfg),
        },
        "levels": levels,
        "target": target(levels),
    }


def target(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 11's target: aggregate tokens/s at 16 concurrent requests >= 3x single-stream, identical tokens."""
    goal = (f"aggregate tokens/s at {TARGET_LEVEL} concurrent requests >= {TARGET_SPEEDUP:g}x single-stream, "
            "identical tokens")
    row = next((r for r in rows if r["concurrency"] == TARGET_LEVEL), None)
    if row is None:
        return {"target": goal, "measured": False}
    return {"target": goal, "measured": True, "speedup": row["speedup"],
            "identical": f"{row['identical']}/{row['compared']}",
            "met": bool(row["speedup"] >= TARGET_SPEEDUP and row["identical"] == row["compared"])}


def prompts_digest(examples: list[T.Example]) -> str:
    import hashlib

    return hashlib.sha256("\n".join(f"{e.task}\t{e.prompt}\t{e.answer}" for e in examples).encode()).hexdigest()[:16]


def reproduce_command(cfg: ConcurrencyConfig) -> str:
    parts = [f"refusion-run bench-concurrency {cfg.model}", f"--concurrency {','.join(map(str, cfg.levels))}",
             f"--requests {cfg.requests}", f"--repeats {cfg.repeats}", f"--threads {cfg.threads}",
             f"--warmup {cfg.warmup}"]
    parts += [f"--max-requests {cfg.max_requests}"] if cfg.max_requests else []
    parts += [f"--max-batch {cfg.max_batch}"] if cfg.max_batch else []
    parts += [f"--mode {cfg.mode}"] if cfg.mode != "refusion" else []
    parts += [f"--profile {cfg.profile}"] if cfg.profile is not None else []
    parts += [f"--out {cfg.out}"] if cfg.out is not None else []
    return " ".join(parts)


def settings_label(p: dict[str, Any]) -> str:
    if p["mode"] == "ar":
        return f"gen_length {p['gen_length']}"
    return (f"gen_length {p['gen_length']}, slot_size {p['slot_size']}, {p['serial_num_blocks']} blocks, "
            f"slot_threshold {p['slot_threshold']:g}, token_threshold {p['token_threshold']:g}")


# ----------------------------------------------------------------------------- outputs


def format_percentiles(d: dict[str, float] | None) -> str:
    return " / ".join(f"{d[f'p{p}']:.1f}" for p in PERCENTILES) if d else "-"


def render_markdown(report: dict[str, Any]) -> str:
    meta, rows, t = report["meta"], report["levels"], report["target"]
    host = meta["host"]
    lines = [
        f"# refusion-run bench-concurrency: {meta['mode']}, {meta['threads']} thread(s)",
        "",
        (f"Model `{meta['model']}`, {meta['backend']} ({meta['threads']} intra-op thread(s), {meta['max_requests']} KV "
        f"slots, forwards packed {meta['max_batch']} at most), one shared Generator; {meta['requests']} held-out chat "
        f"prompts per level (seed {meta['held_out_seed']}, sha256 {meta['held_out_sha256']}), {meta['mode']} "
        f"{settings_label(meta['params'])}, greedy. Closed loop: C client threads, each submits, reads the settled "
        f"text, waits for the result and submits the next. {meta['repeats']} passes over the levels, interleaved, "
        f"after a warm-up of {meta['warmup']} requests. {host['processor']}, {host['cpu_count']} CPUs (load average "
        f"{meta['load_average'][0]:.2f} before, {meta['load_average'][1]:.2f} after), onnxruntime "
        f"{host['onnxruntime']}; {meta['date']}."),
        "",
        ("Tokens = generated tokens through the first EOS. tokens/s, requests/s: the median pass (range of the passes "
        "in brackets); speedup = median tokens/s over that of concurrency 1. TTFT = submit to the first piece of "
        "settled text; ITL = per request, first to last settled piece over the tokens after the first piece "
        "(requests whose text settles in one piece have none); latency = submit to result; p50 / p90 / p99 in ms over "
        "every pass. Identical = token_ids equal to the same prompt's in the first pass at concurrency 1, where it "
        "ran alone."),
        "",
        "| concurrency | tokens/s | requests/s | speedup | TTFT ms | ITL ms | latency ms | tokens/piece | identical "
        "| accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["output_tokens_per_second_range"]
        lines.append(f"| {r['concurrency']} | {r['output_tokens_per_second']:.0f} ({lo:.0f}-{hi:.0f}) | "
                     f"{r['requests_per_second']:.1f} | {r['speedup']:.2f}x | {format_percentiles(r['ttft_ms'])} | "
                     f"{format_percentiles(r['itl_ms'])} | {format_percentiles(r['latency_ms'])} | {r['tokens_per_piece']:.1f} | "
                     f"{r['identical']}/{r['compared']} | "
                     f"{100 * r['correct'] / r['requests']:.1f}% |")
    lines += [
        "",
        ("Where the engine thread's time goes, over every pass: share of the wall time and ms per generated token. "
        "onnxruntime = inside session.run; packing = the rest of run_batch (rows padded into one batch, pasts copied "
        "in, presents copied out); engine Python = step machines, policy, masks, commits, grouping; idle = waiting "
        "for a submit. Fed tokens = tokens of the forwards' inputs, padded to the longest row of each batch."),
        "",
        "| concurrency | rows/forward | fed tokens/forward | onnxruntime ms/forward | onnxruntime µs/fed token | "
        + " | ".join(p.replace("_", " ") for p in TIME_PARTS) + " | ms/token: onnxruntime | engine Python | wall |",
        "|---|---|---|---|---|" + "---|" * len(TIME_PARTS) + "---|---|---|",
    ]
    for r in rows:
        e = r["engine"]
        ms = e["ms_per_token"]
        lines.append(f"| {r['concurrency']} | {e['rows_per_forward']:.2f} | {e['padded_tokens_per_forward']:.1f} | "
                     f"{e['onnxruntime_ms_per_forward']:.2f} | {e['onnxruntime_us_per_fed_token']:.1f} | "
                     + " | ".join(f"{100 * e['share'][p]:.0f}%" for p in TIME_PARTS)
                     + f" | {ms.get('onnxruntime', 0):.3f} | {ms.get('engine_python', 0):.3f} | "
                     f"{1000 / r['output_tokens_per_second']:.3f} |")
    lines += ["", "## Target", ""]
    if t["measured"]:
        lines.append(f"- {t['target']}: **{'met' if t['met'] else 'missed'}**: {t['speedup']:.2f}x, identical "
                     f"{t['identical']}.")
    else:
        lines.append(f"- {t['target']}: not measured (no level {TARGET_LEVEL}).")
    lines += ["", f"Reproduce: `{meta['command']}`", ""]
    return "\n".join(lines)


def render_plot(report: dict[str, Any], path: Path) -> None:
    """Tokens/s against concurrency (with linear scaling), latencies, and the engine thread's time per token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, rows = report["meta"], report["levels"]
    cs = [r["concurrency"] for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 5), dpi=110)
    tps = [r["output_tokens_per_second"] for r in rows]
    spread = np.array([[t - r["output_tokens_per_second_range"][0], r["output_tokens_per_second_range"][1] - t]
                       for t, r in zip(tps, rows)]).T
    ax1.errorbar(cs, tps, yerr=spread, fmt="o-", color="tab:red", capsize=3, label="measured (median pass, range)")
    ax1.plot(cs, [tps[0] * c for c in cs], "--", color="gray", label="linear in concurrency")
    if TARGET_LEVEL in cs:
        ax1.scatter([TARGET_LEVEL], [TARGET_SPEEDUP * tps[0]], marker="*", s=150, color="tab:green", zorder=3,
                    label=f"target: {TARGET_SPEEDUP:g}x at {TARGET_LEVEL}")
    ax1.set_ylim(0, max(tps) * 1.6 if TARGET_LEVEL not in cs else max(max(tps), TARGET_SPEEDUP * tps[0]) * 1.3)
    ax1.set_ylabel("aggregate output tokens / s")
    ax1.set_title("throughput")
    for key, style, label in (("latency_ms", "o-", "request latency"), ("ttft_ms", "s-", "TTFT")):
        for p, alpha in (("p50", 1.0), ("p99", 0.5)):
            ax2.plot(cs, [r[key][p] if r[key] else np.nan for r in rows], style, alpha=alpha, label=f"{label} {p}")
    ax2.set_yscale("log")
    ax2.set_ylabel("ms")
    ax2.set_title("latency")
    bottom = np.zeros(len(rows))
    colors = ("tab:blue", "tab:cyan", "tab:purple", "tab:orange", "lightgray")
    for part, color in zip(TIME_PARTS, colors):
        values = np.array([r["engine"]["ms_per_token"].get(part, 0.0) for r in rows])
        ax3.bar([str(c) for c in cs], values, bottom=bottom, color=color, label=part.replace("_", " "))
        bottom += values
    ax3.set_ylabel("engine thread ms per generated token")
    ax3.set_title("where the time goes")
    finish_plot(fig, (ax1, ax2, ax3), cs, f"{Path(meta['model']).name}: {meta['mode']}, {meta['backend']}, "
                f"{meta['threads']} thread(s), {meta['requests']} requests per level x {meta['repeats']} passes", path)


def finish_plot(fig: Any, axes: tuple[Any, Any, Any], levels: list[int], title: str, path: Path) -> None:
    """The concurrency plots' common frame: the first two panels over log2 concurrency with a grid, every
    panel labelled, the title; written to `path`."""
    import matplotlib.pyplot as plt

    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes:
        ax.set_xlabel("concurrent clients")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(out: Path, stem: str, markdown: str, data: dict[str, Any], plot: Callable[[Path], None] | None,
                 progress: Progress, extra: dict[str, str] | None = None) -> None:
    """OUT/<stem>.md and .json, the `extra` files (suffix -> text), and <stem>.png by `plot` when given
    (a warning instead where matplotlib is missing). bench-serve writes its reports with it too."""
    out.mkdir(parents=True, exist_ok=True)
    files = {".md": markdown, ".json": json.dumps(data, indent=1) + "\n", **(extra or {})}
    written = [out / f"{stem}{suffix}" for suffix in files]
    for path, text in zip(written, files.values()):
        path.write_text(text)
    if plot is not None:
        try:
            plot(out / f"{stem}.png")
            written.append(out / f"{stem}.png")
        except ImportError:
            progress(f"warning: matplotlib is not installed; {stem}.png not written (pip install matplotlib)")
    progress(f"wrote {', '.join(map(str, written))}")


def write_outputs(report: dict[str, Any], out: Path, stem: str, plot: bool, progress: Progress) -> None:
    extra = {"-profile.txt": report["profile"]} if "profile" in report else None
    write_report(out, stem, render_markdown(report), {k: v for k, v in report.items() if k != "profile"},
                 (lambda path: render_plot(report, path)) if plot else None, progress, extra)


# ----------------------------------------------------------------------------- CLI


@click.command("bench-concurrency")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--concurrency", "levels", default=DEFAULT_LEVELS, show_default=True,
              help="Concurrency levels (client threads), comma-separated; 1 is the baseline and must be among them.")
@click.option("--requests", type=int, default=DEFAULT_REQUESTS, show_default=True,
              help="Requests per level: the first N held-out prompts, the same at every level.")
@click.option("--repeats", type=int, default=DEFAULT_REPEATS, show_default=True,
              help="Passes over the levels, interleaved; tokens/s is the median pass's, latencies pool them all.")
@click.option("--threads", type=int, default=1, show_default=True, help="onnxruntime intra-op threads.")
@click.option("--max-requests", type=int, default=None,
              help="KV regions: requests running at once, more wait (default: the CPU runner's 16).")
@click.option("--max-batch", type=int, default=None,
              help="Forwards packed into one onnxruntime call (default: min(16, max-requests)).")
@click.option("--mode", type=click.Choice(["refusion", "ar"]), default="refusion", show_default=True,
              help="Decoding; ReFusion takes the export's recorded settings.")
@click.option("--warmup", type=int, default=32, show_default=True,
              help="Warm-up requests (other held-out prompts) at the highest level, not measured.")
@click.option("--profile", type=int, default=None,
              help="Run this level once more under cProfile (engine thread): OUT/<stem>-profile.txt.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/concurrency"), show_default=True)
@click.option("--no-plot", is_flag=True, help="Skip the .png.")
def bench_concurrency(model_dir: Path, levels: str, requests: int, repeats: int, threads: int, max_requests: int | None,
                      max_batch: int | None, mode: str, warmup: int, profile: int | None, out: Path,
                      no_plot: bool) -> None:
    """Aggregate tokens/s, requests/s, TTFT, inter-token latency and request latency of closed-loop clients
    sharing one Generator (onnxruntime CPU) on MODEL_DIR (an export, or a checkpoint exported to a temporary
    directory), at each --concurrency level."""
    report = run_concurrency_bench(ConcurrencyConfig(
        model=model_dir, levels=parse_levels(levels), requests=requests, repeats=repeats, threads=threads,
        max_requests=max_requests, max_batch=max_batch, mode=mode, warmup=warmup, out=out, plot=not no_plot,
        profile=profile))
    click.echo(render_markdown(report))
