"""`refusion-run bench-concurrency`: throughput and latency of one shared Generator under closed-loop clients.

    refusion-run bench-concurrency models/refusion-tiny [--concurrency 1,2,4,8,16] [--requests 256]
        [--threads 1] [--max-requests R] [--max-batch B] [--mode refusion|ar] [--profile 16] [--out results/concurrency]

At each concurrency level C, C client threads share one Generator (onnxruntime CPU), each submitting the
next held-out chat prompt when its request ends. Per level, in genai-perf's terms: output tokens/s,
requests/s, time to first text, inter-token latency, request latency, the speedup over concurrency 1 and
the requests whose tokens equal their tokens alone (docs/benchmark.md defines each); and where the
scheduler thread's time goes, from the runner's RunnerStats and the scheduler's own counters.

Writes OUT/<mode>-threads<T>[-batch<B>].md, .json and .png (needs matplotlib); with `--profile C`, level C
runs once more under cProfile on the scheduler thread: OUT/<stem>-profile.txt.
"""

from __future__ import annotations

import cProfile
import os
import tempfile
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click
import numpy as np

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.settings import MODES
from refusion.runtime.generator import Generator
from refusion.tools import tasks as T
from refusion.tools.bench.common import (
    LevelRun,
    Progress,
    check_sizes,
    closed_loop,
    finish_plot,
    format_percentiles,
    host_info,
    level_options,
    median_run,
    parse_levels,
    profile_report,
    prompts_digest,
    resolve_model,
    run_request,
    settings_label,
    summarize_timings,
    write_report,
)
from refusion.tools.cli_common import progress as echo_progress

DEFAULT_LEVELS = "1,2,4,8,16"
DEFAULT_REQUESTS = 256
DEFAULT_REPEATS = 5
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


# ----------------------------------------------------------------------------- measuring


def engine_counters(gen: Generator) -> dict[str, float]:
    """The Generator's counters now (its runner's RunnerStats, its scheduler's rounds); a level's are the
    difference over it."""
    runner, scheduler = gen.runner.stats, gen.scheduler.stats
    total = runner.total
    return {"calls": total.forwards, "rows": total.rows, "fed": total.fed, "padded": total.padded,
            "rounds": scheduler.rounds, "run": total.seconds, "session": total.backend_seconds,
            "moves": runner.move_seconds, "busy": scheduler.busy_seconds}


def run_level(gen: Generator, prompts: list[list[int]], settings: dict[str, Any], concurrency: int) -> LevelRun:
    """`concurrency` closed-loop clients over `prompts`, each taking the next prompt when its request ends."""
    before = engine_counters(gen)
    timings, wall = closed_loop(lambda i: run_request(gen, prompts[i], settings), len(prompts), concurrency)
    after = engine_counters(gen)
    return LevelRun(timings, wall, {k: after[k] - before[k] for k in after})


# ----------------------------------------------------------------------------- the run


def run_concurrency_bench(cfg: ConcurrencyConfig, progress: Progress = echo_progress) -> dict[str, Any]:
    """Run every level (and the profile); write the outputs into cfg.out (if set); return the report."""
    check_sizes(cfg, requests_per_client=8)
    if cfg.profile is not None and cfg.profile not in cfg.levels:
        raise RefusionError(f"--profile {cfg.profile} is not one of the levels {','.join(map(str, cfg.levels))}.")
    try:
        examples = T.held_out(cfg.requests + cfg.warmup)
    except ValueError as e:
        raise RefusionError(f"--requests + --warmup: {e}") from e
    with tempfile.TemporaryDirectory(prefix="refusion-concurrency-") as tmp:
        export_dir, _ = resolve_model(Path(cfg.model), Path(tmp), progress)
        with Generator.from_dir(export_dir, backend="ort-cpu", threads=cfg.threads, max_requests=cfg.max_requests,
                                max_batch=cfg.max_batch, prefix_cache_mb=0) as gen:  # decoding, every prompt prefilled
            if gen.tokenizer is None:
                raise RefusionError(f"{export_dir} carries no tokenizer: the bench needs one for its chat prompts "
                                    "and settled text; export the checkpoint with its tokenizer files.")
            settings = {"mode": cfg.mode}
            params = gen.params(**settings)
            prompts = [gen.prompt_ids(ex.prompt, chat=True) for ex in examples]
            load = [os.getloadavg()[0]]  # other work on the machine skews every number
            progress(f"{gen.runner.name}, {cfg.threads} thread(s), {gen.runner.max_requests} KV regions, forwards packed "
                     f"{gen.runner.max_batch} at most; {cfg.mode} {settings_label(asdict(params))}; "
                     f"{cfg.requests} requests per level x {cfg.repeats} passes, warm-up {cfg.warmup} at concurrency "
                     f"{max(cfg.levels)}")
            if cfg.warmup:
                run_level(gen, prompts[cfg.requests:], settings, min(max(cfg.levels), cfg.warmup))
            bench, bench_examples = prompts[: cfg.requests], examples[: cfg.requests]
            runs: dict[int, list[LevelRun]] = {c: [] for c in cfg.levels}
            for repeat in range(1, cfg.repeats + 1):  # levels interleaved, so slow spells of the machine spread out
                for c in cfg.levels:
                    run = run_level(gen, bench, settings, c)
                    for ex, t in zip(bench_examples, run.timings, strict=True):
                        t.correct = T.score(ex, gen.tokenizer.decode(t.token_ids))
                    runs[c].append(run)
                    progress(f"[{repeat}/{cfg.repeats}] " + _run_line(c, run, runs[1][0]))
            levels = [summarize_level(c, runs[c], runs[1]) for c in cfg.levels]
            for level in levels:
                progress(_level_line(level))
            profile = (profile_level(gen, bench, settings, cfg.profile) if cfg.profile is not None
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


def profile_level(gen: Generator, prompts: list[list[int]], settings: dict[str, Any], concurrency: int,
                  top: int = 30) -> str:
    """Level `concurrency` again, with cProfile on the scheduler thread's rounds (not in the tables)."""
    profiler = gen.scheduler.profiler = cProfile.Profile()
    try:
        run = run_level(gen, prompts, settings, concurrency)
    finally:
        gen.scheduler.profiler = None
    timings, wall, counters = run.timings, run.wall, run.counters
    tokens = sum(t.tokens for t in timings)
    return profile_report(profiler, f"concurrency {concurrency} under cProfile (engine thread, its rounds only): "
                          f"{len(timings)} requests, {tokens} tokens in {wall:.3f} s ({tokens / wall:.0f} tokens/s; the "
                          f"profiler slows the Python part); busy {counters['busy']:.3f} s, of which run_batch "
                          f"{counters['run']:.3f} s (onnxruntime session.run {counters['session']:.3f} s), "
                          f"{counters['calls']:.0f} forwards", top)


# ----------------------------------------------------------------------------- aggregation


def time_split(counters: dict[str, float], wall: float) -> dict[str, float]:
    """The scheduler thread's wall time, in seconds, by part (TIME_PARTS)."""
    return {"onnxruntime": counters["session"], "packing": counters["run"] - counters["session"],
            "kv_moves": counters["moves"], "engine_python": counters["busy"] - counters["run"] - counters["moves"],
            "idle": wall - counters["busy"]}


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
    }


def reproduce_command(cfg: ConcurrencyConfig) -> str:
    parts = [f"refusion-run bench-concurrency {cfg.model}", f"--concurrency {','.join(map(str, cfg.levels))}",
             f"--requests {cfg.requests}", f"--repeats {cfg.repeats}", f"--threads {cfg.threads}",
             f"--warmup {cfg.warmup}"]
    parts += [f"--max-requests {cfg.max_requests}"] if cfg.max_requests else []
    parts += [f"--max-batch {cfg.max_batch}"] if cfg.max_batch else []
    parts += [f"--mode {cfg.mode}"] if cfg.mode != ConcurrencyConfig.mode else []  # the default left out
    parts += [f"--profile {cfg.profile}"] if cfg.profile is not None else []
    parts += [f"--out {cfg.out}"] if cfg.out is not None else []
    return " ".join(parts)


# ----------------------------------------------------------------------------- outputs


def render_markdown(report: dict[str, Any]) -> str:
    meta, rows = report["meta"], report["levels"]
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
    ax1.set_ylim(0, max(tps) * 1.6)
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


def write_outputs(report: dict[str, Any], out: Path, stem: str, plot: bool, progress: Progress) -> None:
    extra = {"-profile.txt": report["profile"]} if "profile" in report else None
    write_report(out, stem, render_markdown(report), {k: v for k, v in report.items() if k != "profile"},
                 (lambda path: render_plot(report, path)) if plot else None, progress, extra)


# ----------------------------------------------------------------------------- CLI


@click.command("bench-concurrency")
@click.argument("model_dir", type=click.Path(path_type=Path))
@level_options(DEFAULT_LEVELS, DEFAULT_REPEATS)
@click.option("--requests", type=int, default=DEFAULT_REQUESTS, show_default=True,
              help="Requests per level: the first N held-out prompts, the same at every level.")
@click.option("--threads", type=int, default=1, show_default=True, help="onnxruntime intra-op threads.")
@click.option("--max-requests", type=int, default=None,
              help="KV regions: requests running at once, more wait (default: the CPU runner's 16).")
@click.option("--max-batch", type=int, default=None,
              help="Forwards packed into one onnxruntime call (default: min(16, max-requests)).")
@click.option("--mode", type=click.Choice(MODES), default="refusion", show_default=True,
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
