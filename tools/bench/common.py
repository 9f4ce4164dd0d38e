"""What the benches share: the model they measure, the machine they ran on, closed-loop clients and what
each request's client saw, percentiles, profiles, the reports' files and plots."""

from __future__ import annotations

import cProfile
import hashlib
import io
import json
import os
import platform
import pstats
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click
import numpy as np

from refusion.export.progress import line
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import MANIFEST_NAME, ExportManifest
from refusion.runtime.decode import STRATEGIES
from refusion.runtime.generator import Generator
from refusion.runtime.text import SettledText
from refusion.tools import tasks as T

Progress = Callable[[str], None]  # takes a line of text (a ProgressEvent is one)
PERCENTILES = (50, 90, 99)
Job = TypeVar("Job")


# ----------------------------------------------------------------------------- what is measured


def resolve_model(model: Path, work: Path, progress: Progress) -> tuple[Path, Path | None]:
    """(export dir, its checkpoint dir or None) for an export directory, or for a checkpoint directory
    exported into `work`."""
    model = Path(model)
    if (model / MANIFEST_NAME).is_file():
        source = ExportManifest.read(model).source.get("checkpoint")
        ckpt = Path(source) if isinstance(source, str) and (Path(source) / "config.json").is_file() else None
        return model, ckpt
    if (model / "config.json").is_file():
        from refusion.export.exporter import export_onnx

        out = work / "onnx"
        line(progress, f"exporting {model} -> {out}")
        return export_onnx(model, out, force=True, validate=False, progress=progress), model
    raise RefusionError(f"{model} is neither an export ({MANIFEST_NAME}) nor a checkpoint (config.json).")


def prompts_digest(examples: list[T.Example]) -> str:
    """Fingerprint of the prompts and answers benchmarked: runs compare only when it matches
    (the held-out set follows tasks.py, which may change)."""
    text = "\n".join(f"{ex.task}\t{ex.prompt}\t{ex.answer}" for ex in examples)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def through_eos(ids: list[int], eos_id: int) -> list[int]:
    """Of every committed token (the PyTorch reference's output, GenerationResult.committed_ids), those counted for
    speed and read as the answer's: through the first EOS (all of them when there is none)."""
    return ids[: ids.index(eos_id) + 1] if eos_id in ids else list(ids)


def cpu_model() -> str:
    """lscpu's model name (what a report names the CPU by), else the platform's processor."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_tile")  # what a report names


def cpu_flags() -> list[str]:
    """The SIMD extensions of SIMD_FLAGS the CPU has (/proc/cpuinfo's flags; [] where there is none to read):
    onnxruntime picks its kernels by them, so a CPU's figures hold only beside its flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return [f for f in SIMD_FLAGS if f in flags]


def host_info(modules: tuple[str, ...] = ("onnxruntime", "torch", "transformers", "numpy")) -> dict[str, Any]:
    """The machine and the versions of `modules` (those installed), for a report's header."""
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine()}
    for mod in modules:
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - version reporting only
            pass
    return info


_LABELS = {"gen_length": "gen_length {}", "slot_size": "slot_size {}", "serial_num_blocks": "{} blocks",
           "slot_threshold": "slot_threshold {:g}", "token_threshold": "token_threshold {:g}"}


def settings_label(p: dict[str, Any]) -> str:
    """The decode settings (DecodeParams as a dict) its mode reads, sampling aside: "gen_length 64, ..."."""
    return ", ".join(_LABELS[name].format(p[name]) for name in STRATEGIES[p["mode"]].settings if name in _LABELS)


# ----------------------------------------------------------------------------- closed-loop clients


def check_sizes(cfg: Any, requests_per_client: int) -> None:
    """A closed-loop bench's sizes (its config's threads, requests, repeats, warmup and levels), before any work;
    `requests_per_client`: what the message suggests for a steady state."""
    for name in ("threads", "requests", "repeats"):
        if getattr(cfg, name) < 1:
            raise RefusionError(f"--{name} {getattr(cfg, name)} must be at least 1.")
    if cfg.warmup < 0:
        raise RefusionError(f"--warmup {cfg.warmup} must be 0 or more.")
    if cfg.requests < max(cfg.levels):
        raise RefusionError(f"--requests {cfg.requests} is fewer than concurrency {max(cfg.levels)}: every client "
                            f"needs requests; give --requests {requests_per_client * max(cfg.levels)} or more for a "
                            "steady state.")


def level_options(default_levels: str, default_repeats: int) -> Callable[[Any], Any]:
    """--concurrency and --repeats, as every closed-loop bench takes them."""
    def decorate(f: Any) -> Any:
        f = click.option("--repeats", type=int, default=default_repeats, show_default=True,
                         help="Passes over the levels, interleaved; tokens/s is the median pass's, latencies pool "
                              "them all.")(f)
        return click.option("--concurrency", "levels", default=default_levels, show_default=True,
                            help="Concurrency levels (client threads), comma-separated; 1 is the baseline and must "
                                 "be among them.")(f)
    return decorate


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


def closed_loop(job: Callable[[int], Job], count: int, concurrency: int) -> tuple[list[Job], float]:
    """`concurrency` client threads, each running job(i) for the next i until `count` are done:
    (results in order of i, wall seconds). The first error is raised in the caller's thread."""
    results: list[Job | None] = [None] * count
    errors: list[BaseException] = []
    queue = iter(range(count))
    lock = threading.Lock()

    def client() -> None:
        while not errors:
            with lock:
                i = next(queue, None)
            if i is None:
                return
            try:
                results[i] = job(i)
            except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
                errors.append(e)

    clients = [threading.Thread(target=client, name=f"client-{c}") for c in range(concurrency)]
    t0 = time.perf_counter()
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return [r for r in results if r is not None], wall


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


@dataclass
class LevelRun:
    """One pass of a level: timings in prompt order, wall seconds, the side's counters (the bench's own)."""

    timings: list[Timing]
    wall: float
    counters: dict[str, float]

    @property
    def tokens_per_second(self) -> float:
        return sum(t.tokens for t in self.timings) / self.wall


# ----------------------------------------------------------------------------- aggregation


def percentiles(values: list[float]) -> dict[str, float] | None:
    """p50 / p90 / p99 and the mean, in milliseconds (None for no values)."""
    if not values:
        return None
    ms = 1000 * np.asarray(values)
    return {**{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}, "mean": float(ms.mean())}


def format_percentiles(d: dict[str, float] | None) -> str:
    return " / ".join(f"{d[f'p{p}']:.1f}" for p in PERCENTILES) if d else "-"


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


# ----------------------------------------------------------------------------- outputs


def profile_report(profiler: cProfile.Profile, header: str, top: int) -> str:
    """`header`, then the `top` functions by own time and by cumulative time."""
    buf = io.StringIO()
    buf.write(header + "\n\n")
    stats = pstats.Stats(profiler, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


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
