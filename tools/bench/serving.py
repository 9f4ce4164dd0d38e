"""`refusion-run bench-serve`: load bench over the real servers (NVIDIA Triton, and the OpenAI-compatible
server, both over HTTP), in genai-perf's shape, beside the same requests in-process.

    refusion-run bench-serve models/refusion-tiny [--concurrency 1,2,4,8,16,32] [--requests 256] [--repeats 3]
        [--threads 1] [--max-requests R] [--max-batch B] [--warmup 32] [--out results/serving] [--no-plot]

It starts tritonserver and `refusion-run serve --api openai` on the export (ort-cpu, free loopback ports,
each its own process) and opens one Generator in this process with the same settings. At each concurrency
level C, C closed-loop clients send the same held-out chat prompts to all three: Triton's generate_stream
and OpenAI's streaming /v1/chat/completions (server-sent events, the export's recorded decode settings), and
in-process (Generator.submit). The metrics are bench-concurrency's, per side, with each server's overhead per
request at concurrency 1 and the CPU cores each process used (tritonserver, its Python-backend stub, the
OpenAI server, this process), from /proc. Writes OUT/serve-threads<T>[-batch<B>].md, .json and .png (needs matplotlib).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import click
import numpy as np

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import Generator
from refusion.serve.triton.client import request_body, stream_events
from refusion.tools import tasks as T
from refusion.tools.bench.common import (
    LevelRun,
    Progress,
    Timing,
    check_sizes,
    closed_loop,
    finish_plot,
    format_percentiles,
    host_info,
    inter_token_latency,
    level_options,
    parse_levels,
    percentiles,
    prompts_digest,
    resolve_model,
    run_request,
    settings_label,
    summarize_timings,
    write_report,
)
from refusion.tools.cli_common import progress as echo_progress

DEFAULT_LEVELS = "1,2,4,8,16,32"
DEFAULT_REQUESTS = 256
DEFAULT_REPEATS = 3
MODEL_NAME = "refusion"
SERVERS = ("triton", "openai")
SIDES = (*SERVERS, "in_process")
SERVER_NAMES = {"triton": "Triton (HTTP generate_stream)", "openai": "the OpenAI server (HTTP /v1/chat/completions)"}
SHORT_NAMES = {"triton": "Triton", "openai": "the OpenAI server", "in_process": "in-process"}
SATURATION = 0.9  # throughput saturates at the first level within 10% of the best level's tokens/s
REQUEST_TIMEOUT_S = 120.0
PROCESSES = {"triton": ("tritonserver", "python_backend", "clients"), "openai": ("openai_server", "clients"),
             "in_process": ("clients",)}  # whose CPU each side's passes count
_READY_S = 600.0  # for a server to load the export: a hang guard


@dataclass
class ServeBenchConfig:
    model: Path
    levels: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    requests: int = DEFAULT_REQUESTS
    repeats: int = DEFAULT_REPEATS
    threads: int = 1
    max_requests: int | None = None
    max_batch: int | None = None
    warmup: int = 32
    out: Path | None = Path("results/serving")
    plot: bool = True

    @property
    def stem(self) -> str:
        return f"serve-threads{self.threads}" + (f"-batch{self.max_batch}" if self.max_batch else "")


# ----------------------------------------------------------------------------- one request over HTTP


@dataclass
class Streamed:
    """One generate_stream request as its client saw it; token counts per piece come later (to_timing)."""

    token_ids: list[int]
    finish_reason: str
    latency: float  # send -> the final event
    stamps: list[tuple[float, int]]  # (seconds since send, characters of text so far) at each piece


def stream_request(port: int, prompt: str, timeout_s: float = REQUEST_TIMEOUT_S) -> Streamed:
    """POST one chat prompt to generate_stream at the server's decode defaults; read its events."""
    t0 = time.perf_counter()
    chars, stamps = 0, []
    for event in stream_events(f"http://127.0.0.1:{port}", MODEL_NAME, request_body(prompt, {}, stream=True, chat=True),
                               timeout_s):
        now = time.perf_counter() - t0
        if event.get("text_output"):
            chars += len(event["text_output"])
            stamps.append((now, chars))
        if "finish_reason" in event:
            return Streamed(list(event["token_ids"]), event["finish_reason"], now, stamps)
    raise AssertionError("stream_events ends at the final event or raises")


def openai_stream_request(port: int, prompt: str, timeout_s: float = REQUEST_TIMEOUT_S) -> Streamed:
    """POST one chat prompt, as a user message, to the OpenAI server's streaming /v1/chat/completions at its
    decode defaults (return_token_ids: the finish chunk carries the ids); read its events through [DONE]."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "return_token_ids": True}
    t0 = time.perf_counter()
    chars, stamps, final = 0, [], None
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RefusionError(f"the OpenAI server refused the request ({response.status}): "
                                f"{response.read().decode(errors='replace')[:300]}")
        for line in response:
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RefusionError(f"the OpenAI server failed the request: {event['error']}")
            now, choice = time.perf_counter() - t0, event["choices"][0]
            if choice.get("delta", {}).get("content"):
                chars += len(choice["delta"]["content"])
                stamps.append((now, chars))
            if choice["finish_reason"]:
                final = Streamed(list(choice["token_ids"]), choice["finish_reason"], now, stamps)
    finally:
        conn.close()
    if final is None:
        raise RefusionError("the OpenAI server closed the stream before its finish chunk")
    return final


def token_counts(answer: list[int], chars: list[int], decode: Callable[[list[int]], str]) -> list[int]:
    """For each piece's running character count, the answer tokens it took to show that much text:
    HTTP carries text, the in-process bench counts tokens; for a byte/char tokenizer the two agree."""
    lengths = [len(decode(answer[:n])) for n in range(len(answer) + 1)]
    counts, n = [], 0
    for c in chars:
        while n < len(answer) and lengths[n] < c:
            n += 1
        counts.append(n)
    return counts


def to_timing(s: Streamed, decode: Callable[[list[int]], str]) -> Timing:
    """A Streamed request in bench-concurrency's terms: its token_ids are the answer's, and the EOS that ended
    it counts as GenerationStats counts it (finish_reason eos on Triton, stop on the OpenAI server: these
    requests have no stop sequences)."""
    tokens = len(s.token_ids) + (s.finish_reason in ("eos", "stop"))
    counts = token_counts(s.token_ids, [c for _, c in s.stamps], decode)
    stamps = [(t, n) for (t, _), n in zip(s.stamps, counts, strict=True)]
    return Timing(s.token_ids, tokens, len(s.token_ids), len(stamps), s.latency, stamps[0][0] if stamps else None,
                  inter_token_latency(stamps))


# ----------------------------------------------------------------------------- closed loop and CPU


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (0 where /proc cannot tell)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime: fields 14 and 15 of stat(5)


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (tritonserver's: the Python-backend stub)."""
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rpartition(")")[2].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


class CpuMeter:
    """CPU seconds of a side's server processes (by name: their pids) and of this one, which runs the clients
    (and, for in-process levels, the Generator: its engine is idle while a server side runs)."""

    def __init__(self, processes: dict[str, list[int]]):
        self.processes = processes

    def snapshot(self) -> dict[str, float]:
        return {**{name: sum(process_cpu(p) for p in pids) for name, pids in self.processes.items()},
                "clients": time.process_time()}


# ----------------------------------------------------------------------------- the run


@dataclass
class Bench:
    """What a pass needs: the Generator (in-process side and tokenizer), the servers' ports, each side's CPU
    meter, the prompts."""

    gen: Generator
    ports: dict[str, int]  # by server side
    meters: dict[str, CpuMeter]  # by side
    texts: list[str]  # chat prompts as sent to the server
    ids: list[list[int]]  # the same through the chat template, as submitted in-process

    def run(self, side: str, concurrency: int, count: int, offset: int = 0) -> LevelRun:
        """One pass of `side` over the prompts [offset, offset + count); counters: CPU seconds by process."""
        job = {"triton": self._over_triton, "openai": self._over_openai, "in_process": self._in_process}[side]
        meter = self.meters[side]
        before = meter.snapshot()
        results, wall = closed_loop(lambda i: job(offset + i), count, concurrency)
        after = meter.snapshot()
        timings = [self._timing(r) for r in results]  # off the clock: detokenizing prefixes for ITL
        return LevelRun(timings, wall, {k: after[k] - before[k] for k in after})

    def _over_triton(self, i: int) -> Streamed:
        return stream_request(self.ports["triton"], self.texts[i])

    def _over_openai(self, i: int) -> Streamed:
        return openai_stream_request(self.ports["openai"], self.texts[i])

    def _in_process(self, i: int) -> Timing:
        return run_request(self.gen, self.ids[i], {})  # no settings: the export's recorded ones, as the server

    def _timing(self, result: Streamed | Timing) -> Timing:
        if isinstance(result, Timing):
            return result
        assert self.gen.tokenizer is not None
        return to_timing(result, self.gen.tokenizer.decode)


def run_serve_bench(cfg: ServeBenchConfig, progress: Progress = echo_progress) -> dict[str, Any]:
    """Start the server, run every level on both sides, write the outputs into cfg.out (if set); the report."""
    check_sizes(cfg, requests_per_client=4)
    try:
        examples = T.held_out(cfg.requests + cfg.warmup)
    except ValueError as e:
        raise RefusionError(f"--requests + --warmup: {e}") from e
    prompts = [ex.prompt for ex in examples]
    with tempfile.TemporaryDirectory(prefix="refusion-serve-bench-") as tmp:
        export_dir, _ = resolve_model(Path(cfg.model), Path(tmp), progress)
        load = [os.getloadavg()[0]]
        with Generator.from_dir(export_dir, backend="ort-cpu", threads=cfg.threads, max_requests=cfg.max_requests,
                                max_batch=cfg.max_batch, prefix_cache_mb=0) as gen, \
                serving(export_dir, cfg, Path(tmp) / "triton.log", progress) as (port, pid), \
                openai_serving(export_dir, cfg, Path(tmp) / "openai.log", progress) as (openai_port, openai_pid):
            if gen.tokenizer is None:
                raise RefusionError(f"{export_dir} carries no tokenizer: the bench sends chat text; export the "
                                    "checkpoint with its tokenizer files.")
            meters = {"triton": CpuMeter({"tritonserver": [pid], "python_backend": children(pid)}),
                      "openai": CpuMeter({"openai_server": [openai_pid]}), "in_process": CpuMeter({})}
            bench = Bench(gen, {"triton": port, "openai": openai_port}, meters, prompts,
                          [gen.prompt_ids(p, chat=True) for p in prompts])
            params = asdict(gen.params())
            runner = {"backend": gen.runner.name, "max_requests": gen.runner.max_requests,
                      "max_batch": gen.runner.max_batch}
            progress(f"tritonserver (pid {pid}, Python-backend stub {meters['triton'].processes['python_backend']}) "
                     f"on :{port}, the OpenAI server (pid {openai_pid}) on :{openai_port} and an in-process "
                     f"Generator: {runner['backend']}, {cfg.threads} thread(s), {runner['max_requests']} KV regions; "
                     f"refusion {settings_label(params)}; {cfg.requests} requests per level x {cfg.repeats} passes")
            runs = run_levels(bench, cfg, progress)
            load.append(os.getloadavg()[0])
    report = make_report(cfg, export_dir, runner, params, runs, examples[: cfg.requests], load)
    if cfg.out is not None:
        write_outputs(report, Path(cfg.out), cfg.stem, cfg.plot, progress)
    return report


@contextmanager
def serving(export_dir: Path, cfg: ServeBenchConfig, log_path: Path, progress: Progress) -> Iterator[tuple[int, int]]:
    """tritonserver on free loopback ports with the bench's settings: (HTTP port, its pid)."""
    from refusion.serve.triton.launcher import Ports, TritonServer, free_ports
    from refusion.serve.triton.settings import ServeSettings

    # Room for every client: none may be refused for the queue limit.
    settings = ServeSettings(str(export_dir), backend="ort-cpu", threads=cfg.threads, max_requests=cfg.max_requests,
                             max_batch=cfg.max_batch, max_queue=max(ServeSettings.max_queue, max(cfg.levels)),
                             prefix_cache_mb=0)  # decoding as in-process: every prompt prefilled
    http_port, grpc_port, metrics_port = free_ports(3)
    progress(f"starting tritonserver on {export_dir}")
    with open(log_path, "wb") as log:
        server = TritonServer(export_dir, Ports(http_port, grpc_port, metrics_port, "127.0.0.1"), settings,
                              MODEL_NAME, drain_timeout_s=5, log=log)
        try:
            server.start()
        except RefusionError as e:
            raise RefusionError(f"{e}\ntritonserver's log:\n{log_path.read_text(errors='replace')[-2000:]}") from e
        assert server.process is not None
        try:
            yield http_port, server.process.pid
        except (OSError, http.client.HTTPException, RefusionError) as e:  # a request failed: say what the server did
            code = server.process.poll()
            state = "is still running" if code is None else f"exited with code {code}"
            raise RefusionError(f"a request to tritonserver failed ({type(e).__name__}: {e}) and the server {state}; "
                                f"its log:\n{log_path.read_text(errors='replace')[-2000:]}") from e
        finally:
            server.stop()


@contextmanager
def openai_serving(export_dir: Path, cfg: ServeBenchConfig, log_path: Path, progress: Progress
                   ) -> Iterator[tuple[int, int]]:
    """`refusion-run serve --api openai` on a free loopback port with the bench's settings, a process of its own
    as Triton is: (its port, its pid)."""
    command = [sys.executable, "-m", "refusion.tools.run_cli", "serve", str(export_dir), "--api", "openai",
               "--address", "127.0.0.1", "--http-port", "0", "--model-name", MODEL_NAME, "--backend", "ort-cpu",
               "--threads", str(cfg.threads), "--max-queue", str(max(64, max(cfg.levels))), "--prefix-cache-mb", "0"]
    command += ["--max-requests", str(cfg.max_requests)] if cfg.max_requests else []
    command += ["--max-batch", str(cfg.max_batch)] if cfg.max_batch else []
    progress(f"starting the OpenAI server on {export_dir}")
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            port = _ready_port(server, log_path)
            yield port, server.pid
        except (OSError, http.client.HTTPException, RefusionError) as e:
            code = server.poll()
            state = "is still running" if code is None else f"exited with code {code}"
            raise RefusionError(f"a request to the OpenAI server failed ({type(e).__name__}: {e}) and the server "
                                f"{state}; its log:\n{log_path.read_text(errors='replace')[-2000:]}") from e
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(_READY_S)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _ready_port(server: subprocess.Popen[bytes], log_path: Path) -> int:
    """The port the server's `ready:` line names, once it prints it."""
    deadline = time.monotonic() + _READY_S
    while time.monotonic() < deadline:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith("ready: http://"):
                return int(line.split()[1].split(":")[2].split("/")[0])
        if server.poll() is not None:
            raise RefusionError(f"the OpenAI server exited with code {server.returncode} before it was ready:\n"
                                f"{log_path.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)
    raise RefusionError(f"the OpenAI server was not ready after {_READY_S:.0f} s.")


def run_levels(bench: Bench, cfg: ServeBenchConfig, progress: Progress) -> dict[str, dict[int, list[LevelRun]]]:
    """Warm both sides up on other prompts, then every level on both sides, passes interleaved so that
    slow spells of the machine spread over the levels and the two sides alike."""
    if cfg.warmup:
        for side in SIDES:
            bench.run(side, min(max(cfg.levels), cfg.warmup), cfg.warmup, offset=cfg.requests)
    runs: dict[str, dict[int, list[LevelRun]]] = {side: {c: [] for c in cfg.levels} for side in SIDES}
    for repeat in range(1, cfg.repeats + 1):
        for c in cfg.levels:
            for side in ("in_process", *SERVERS):  # in-process first: its first c=1 pass is the oracle
                runs[side][c].append(bench.run(side, c, cfg.requests))
            oracle = runs["in_process"][1][0].timings
            progress(f"[{repeat}/{cfg.repeats}] " + _pass_line(c, {side: runs[side][c][-1] for side in SIDES}, oracle))
    return runs


def _pass_line(concurrency: int, runs: dict[str, LevelRun], oracle: list[Timing]) -> str:
    def same(run: LevelRun) -> str:
        return f"{sum(t.token_ids == o.token_ids for t, o in zip(run.timings, oracle, strict=True))}/{len(run.timings)}"

    servers = ", ".join(f"{side} {runs[side].tokens_per_second:.0f} tokens/s "
                        f"({len(runs[side].timings) / runs[side].wall:.1f} requests/s, identical {same(runs[side])})"
                        for side in SERVERS)
    return f"concurrency {concurrency:>3}: {servers}; in-process {runs['in_process'].tokens_per_second:.0f} tokens/s"


# ----------------------------------------------------------------------------- aggregation


def summarize(concurrency: int, runs: list[LevelRun], base: list[LevelRun], oracle: list[Timing]) -> dict[str, Any]:
    """A side's level over its passes (bench-concurrency's summarize_timings), with the cores each process used."""
    wall = sum(run.wall for run in runs)
    return {**summarize_timings(concurrency, runs, base, oracle),
            "cpu_cores": {k: sum(run.counters[k] for run in runs) / wall for k in runs[0].counters}}


def overhead(server: list[LevelRun], local: list[LevelRun]) -> dict[str, Any]:
    """What the server adds to a request on its own (concurrency 1): server minus in-process, in ms."""
    pairs = [(s, i) for srun, irun in zip(server, local, strict=True)
             for s, i in zip(srun.timings, irun.timings, strict=True)]

    def diff(key: str) -> dict[str, Any]:
        both = [(getattr(s, key), getattr(i, key)) for s, i in pairs
                if getattr(s, key) is not None and getattr(i, key) is not None]
        srv, loc = percentiles([s for s, _ in both]), percentiles([i for _, i in both])
        if srv is None or loc is None:
            return {"server": None, "in_process": None}
        return {"server": srv, "in_process": loc, "mean": srv["mean"] - loc["mean"], "p50": srv["p50"] - loc["p50"],
                "paired_median": float(np.median([1000 * (s - i) for s, i in both])), "requests": len(both)}

    return {"concurrency": 1, "latency_ms": diff("latency"), "ttft_ms": diff("ttft")}


def saturation(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The first level whose tokens/s is within SATURATION of the best level's."""
    best = max(rows, key=lambda r: r["output_tokens_per_second"])
    level = next(r for r in rows if r["output_tokens_per_second"] >= SATURATION * best["output_tokens_per_second"])
    return {"level": level["concurrency"], "best_level": best["concurrency"],
            "best_tokens_per_second": best["output_tokens_per_second"], "threshold": SATURATION,
            "cpu_cores": level["cpu_cores"]}


def make_report(cfg: ServeBenchConfig, export_dir: Path, runner: dict[str, Any], params: dict[str, Any],
                runs: dict[str, dict[int, list[LevelRun]]], examples: list[T.Example],
                load: list[float]) -> dict[str, Any]:
    oracle = runs["in_process"][1][0].timings
    levels = {side: [summarize(c, runs[side][c], runs[side][1], oracle) for c in cfg.levels] for side in SIDES}
    return {
        "meta": {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model": str(cfg.model), "export_dir": str(export_dir) if export_dir == Path(cfg.model) else None,
            "threads": cfg.threads, **runner, "mode": params["mode"], "params": params, "requests": cfg.requests,
            "repeats": cfg.repeats, "warmup": cfg.warmup, "held_out_seed": T.HELD_OUT_SEED,
            "prompts": "held_out chat prompts", "held_out_sha256": prompts_digest(examples),
            "decoding": "the export's recorded settings (no decode settings sent), greedy",
            "transport": {"triton": "HTTP POST generate_stream (server-sent events)",
                          "openai": "HTTP POST /v1/chat/completions, stream=true (server-sent events)",
                          "both": "a connection per request, http.client"},
            "tokens": "generated tokens in position order through the first EOS",
            "host": {**host_info(("onnxruntime", "numpy")), "nvidia_pytriton": _version("nvidia-pytriton"),
                     "fastapi": _version("fastapi"), "uvicorn": _version("uvicorn")},
            "load_average": load, "command": reproduce_command(cfg),
        },
        "levels": [{"concurrency": c, **{side: levels[side][i] for side in SIDES},
                    **{f"{server}_over_in_process_tokens_per_second":
                       levels[server][i]["output_tokens_per_second"] / levels["in_process"][i]["output_tokens_per_second"]
                       for server in SERVERS}}
                   for i, c in enumerate(cfg.levels)],
        "overhead": {server: overhead(runs[server][1], runs["in_process"][1]) for server in SERVERS},
        "saturation": {side: saturation(levels[side]) for side in SIDES},
    }


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def reproduce_command(cfg: ServeBenchConfig) -> str:
    parts = [f"refusion-run bench-serve {cfg.model}", f"--concurrency {','.join(map(str, cfg.levels))}",
             f"--requests {cfg.requests}", f"--repeats {cfg.repeats}", f"--threads {cfg.threads}",
             f"--warmup {cfg.warmup}"]
    parts += [f"--max-requests {cfg.max_requests}"] if cfg.max_requests else []
    parts += [f"--max-batch {cfg.max_batch}"] if cfg.max_batch else []
    parts += [f"--out {cfg.out}"] if cfg.out is not None else []
    return " ".join(parts)


# ----------------------------------------------------------------------------- outputs


def _cores(cpu: dict[str, float], side: str) -> str:
    return " / ".join(f"{cpu.get(p, 0.0):.2f}" for p in PROCESSES[side])


def render_markdown(report: dict[str, Any]) -> str:
    meta, rows = report["meta"], report["levels"]
    return "\n".join([*_intro(meta), *(line for server in SERVERS for line in _server_table(rows, server)),
                      *_side_by_side(rows),
                      *(line for server in SERVERS for line in _overhead_lines(report["overhead"][server], server)),
                      *_saturation_lines(report, meta), "", f"Reproduce: `{meta['command']}`", ""])


def _intro(meta: dict[str, Any]) -> list[str]:
    host = meta["host"]
    return [
        f"# refusion-run bench-serve: Triton and the OpenAI server over HTTP vs in-process, {meta['mode']}, "
        f"{meta['threads']} thread(s)",
        "",
        (f"Model `{meta['model']}`, served on loopback by NVIDIA Triton (nvidia-pytriton {host['nvidia_pytriton']}, our "
         f"decoupled Python-backend model) and by `refusion-run serve --api openai` (FastAPI {host.get('fastapi')} on "
         f"uvicorn {host.get('uvicorn')}, a process of its own), and the same Generator in the bench's process: "
         f"{meta['backend']} "
         f"({meta['threads']} intra-op thread(s), {meta['max_requests']} KV regions, forwards packed {meta['max_batch']} "
         f"at most). {meta['requests']} held-out chat prompts per level (seed {meta['held_out_seed']}, sha256 "
         f"{meta['held_out_sha256']}), {meta['mode']} {settings_label(meta['params'])} (the export's recorded "
         f"settings: Triton gets chat=true, the OpenAI server the prompt as a user message, and no decode settings), "
         f"greedy, both servers with the prefix cache off (every prompt prefilled, as in-process). Closed loop: C "
         f"client threads, each sends a request, reads its stream and sends the next; server requests are HTTP POST "
         f"generate_stream (Triton) or streaming /v1/chat/completions (OpenAI), one connection each (stdlib "
         f"http.client); in-process ones are Generator.submit. {meta['repeats']} passes over the levels, the three "
         f"sides interleaved, after a warm-up of {meta['warmup']} requests on each. "
         f"{host['processor']}, {host['cpu_count']} CPUs shared by the servers' processes and the "
         f"clients (load average {meta['load_average'][0]:.2f} before, {meta['load_average'][1]:.2f} after), "
         f"onnxruntime {host['onnxruntime']}; {meta['date']}."),
        "",
        ("Tokens = generated tokens through the first EOS. tokens/s, requests/s: the median pass (range of the passes "
         "in brackets); speedup = over concurrency 1 of the same side. TTFT = send to the first piece of text; ITL = "
         "per request, first to last piece over the tokens after the first (over HTTP, each piece's tokens are "
         "recovered by detokenizing prefixes of the final token_ids); latency = send to the final event; p50 / p90 / "
         "p99 in ms over every pass. Identical = token_ids equal to the in-process Generator's for the same prompt "
         "run alone (first pass at concurrency 1)."),
    ]


def _server_table(rows: list[dict[str, Any]], server: str) -> list[str]:
    lines = ["", f"## Over {SERVER_NAMES[server]}", "",
             "| concurrency | tokens/s | requests/s | speedup | TTFT ms | ITL ms | latency ms | tokens/piece "
             "| identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        r = row[server]
        lo, hi = r["output_tokens_per_second_range"]
        lines.append(f"| {r['concurrency']} | {r['output_tokens_per_second']:.0f} ({lo:.0f}-{hi:.0f}) | "
                     f"{r['requests_per_second']:.1f} | {r['speedup']:.2f}x | {format_percentiles(r['ttft_ms'])} | "
                     f"{format_percentiles(r['itl_ms'])} | {format_percentiles(r['latency_ms'])} | {r['tokens_per_piece']:.1f} | "
                     f"{r['identical']}/{r['compared']} |")
    return lines


def _side_by_side(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["", "## Beside the in-process Generator (same run, same prompts)", "",
             ("Per level, Triton / the OpenAI server / in-process. CPU cores = CPU seconds over wall seconds, over "
              "every pass: Triton's tritonserver (HTTP front end, request routing) / its Python-backend stub (our "
              "model: the Generator's engine thread and a responder thread per request) / the bench's process (the "
              "client threads); the OpenAI server's process (uvicorn's event loop and the Generator's engine thread) "
              "/ the bench's process; in-process, the bench's process (clients and Generator)."),
             "",
             "| concurrency | tokens/s | over in-process | latency p50 ms | TTFT p50 ms | ITL p50 ms | identical | "
             "CPU cores Triton: triton / stub / clients | OpenAI: server / clients | in-process |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def each(key: str, form: Any) -> str:
        return " / ".join(form(row_side[key]) for row_side in sides)

    for row in rows:
        sides = [row[side] for side in SIDES]
        ratios = " / ".join(f"{row[f'{server}_over_in_process_tokens_per_second']:.2f}" for server in SERVERS)
        identical = " / ".join(f"{row[side]['identical']}/{row[side]['compared']}" for side in SERVERS)
        lines.append(f"| {row['concurrency']} | {each('output_tokens_per_second', lambda v: f'{v:.0f}')} | {ratios} | "
                     f"{each('latency_ms', _p50)} | {each('ttft_ms', _p50)} | {each('itl_ms', _p50)} | "
                     f"{identical} | "
                     f"{_cores(row['triton']['cpu_cores'], 'triton')} | {_cores(row['openai']['cpu_cores'], 'openai')} | "
                     f"{row['in_process']['cpu_cores']['clients']:.2f} |")
    return lines


def _p50(d: dict[str, float] | None) -> str:
    return f"{d['p50']:.2f}" if d else "-"


_WHAT_IT_ADDS = {
    "triton": ("HTTP and JSON both ways, Triton's routing, the chat template and tokenization in the backend, and the "
               "thread hops that send each piece"),
    "openai": ("HTTP and JSON both ways (a chunk object per piece), FastAPI's routing and the body checks, the chat "
               "template and tokenization on the event loop, and the event loop's wake-up at each commit"),
}


def _overhead_lines(o: dict[str, Any], server: str) -> list[str]:
    lat, ttft = o["latency_ms"], o["ttft_ms"]
    name = SHORT_NAMES[server]
    lines = ["", f"## {name[0].upper() + name[1:]}: overhead per request (concurrency 1)", ""]
    if lat["server"] is None:
        return lines + ["Not measured: no request finished on both sides."]
    lines += [
        (f"The same {lat['requests']} requests (every pass), one client, each request alone: through the server "
         f"vs through Generator.submit in the bench's process. The server's share includes {_WHAT_IT_ADDS[server]}."),
        "",
        "| per request, ms | server | in-process | server overhead |",
        "|---|---|---|---|",
        f"| latency mean | {lat['server']['mean']:.2f} | {lat['in_process']['mean']:.2f} | **{lat['mean']:+.2f}** |",
        f"| latency p50 | {lat['server']['p50']:.2f} | {lat['in_process']['p50']:.2f} | **{lat['p50']:+.2f}** |",
        f"| latency, median of per-prompt differences | | | {lat['paired_median']:+.2f} |",
    ]
    if ttft["server"] is not None:
        lines += [f"| TTFT mean | {ttft['server']['mean']:.2f} | {ttft['in_process']['mean']:.2f} | "
                  f"{ttft['mean']:+.2f} |",
                  f"| TTFT p50 | {ttft['server']['p50']:.2f} | {ttft['in_process']['p50']:.2f} | {ttft['p50']:+.2f} |"]
    return lines


def _saturation_lines(report: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    sat = report["saturation"]
    lines = ["", "## Where throughput saturates", ""]
    for side in SIDES:
        s = sat[side]
        level = next(r for r in report["levels"] if r["concurrency"] == s["level"])[side]
        name = SHORT_NAMES[side] if side == "in_process" else f"over {SHORT_NAMES[side]}"
        lines.append(f"- {name[0].upper() + name[1:]}: tokens/s is within {100 * (1 - SATURATION):.0f}% of its best "
                     f"({s['best_tokens_per_second']:.0f} tokens/s at concurrency {s['best_level']}) from concurrency "
                     f"**{s['level']}** on ({level['output_tokens_per_second']:.0f} tokens/s, {level['speedup']:.2f}x "
                     "concurrency 1).")
    return lines + [
        "", ("bench-concurrency's own figures for this model are in results/concurrency/ (measured with its engine "
             "meter); the in-process column here is measured again in the same run, so that every side sees the "
             "same machine."),
        "", _why(sat["triton"]["level"], sat["triton"]["cpu_cores"], meta),
        "", _why_openai(sat["openai"]["level"], sat["openai"]["cpu_cores"], meta),
    ]


def _why(level: int, cores: dict[str, float], meta: dict[str, Any]) -> str:
    """Triton's saturation's cause, from the CPU each process used at the saturating level."""
    n, stub = meta["host"]["cpu_count"], cores.get("python_backend", 0.0)
    busy = stub + cores.get("tritonserver", 0.0) + cores.get("clients", 0.0)
    text = (f"Why (Triton): {n} CPU cores are shared by tritonserver, the Python-backend stub and the clients. At "
            f"concurrency {level} tritonserver uses {cores.get('tritonserver', 0.0):.2f} cores, the stub {stub:.2f} and "
            f"the clients {cores.get('clients', 0.0):.2f} ({busy:.2f} of {n}). The stub is one Python process whose "
            f"single engine thread runs every request's forwards one after another (onnxruntime with "
            f"{meta['threads']} intra-op thread(s)) and whose responder threads, one per request, send each piece "
            "under the same GIL: once that thread is never idle, batching more rows per forward is all that is left, "
            "and on this small CPU model a batched forward costs nearly as much per row as separate ones "
            "(bench-concurrency's engine split). Past that point more clients only queue: TTFT and request latency "
            "grow with concurrency while tokens/s stays flat. ")
    if busy >= 0.9 * n:
        text += ("Every core is busy: the HTTP front end and the clients take CPU the engine would otherwise use, "
                 "which is the gap to the in-process Generator.")
    else:
        text += (f"The cores are not the limit ({n - busy:.2f} stay idle); the stub's one core is, and the gap to the "
                 "in-process Generator (also at one core) is the share of that core the stub spends on Triton's side: "
                 "taking requests, sending responses, the responder threads' turns at the GIL.")
    before = meta["load_average"][0]  # taken before the first request: other work on the machine
    if before > 0.5 * n:
        text += (f" Other work on the machine (load average {before:.2f} before the bench began) took CPU from all "
                 "the processes as well, which widens the ranges of the passes.")
    return text


def _why_openai(level: int, cores: dict[str, float], meta: dict[str, Any]) -> str:
    """The OpenAI server's saturation's cause, from the CPU its process and the clients used."""
    n, server = meta["host"]["cpu_count"], cores.get("openai_server", 0.0)
    busy = server + cores.get("clients", 0.0)
    return (f"Why (OpenAI): at concurrency {level} the server's one process uses {server:.2f} cores and the clients "
            f"{cores.get('clients', 0.0):.2f} ({busy:.2f} of {n}). Its engine thread runs every forward, as the stub "
            "does; the HTTP side is one asyncio event loop in the same process (no second server process, no responder "
            "thread per request). Where the process uses well under a core while its requests wait, the time goes to "
            "neither: the suspect, not yet measured, is the hand-over of the GIL between the event loop and the engine "
            "thread.")


_COLORS = {"triton": "tab:red", "openai": "tab:green", "in_process": "tab:blue"}


def render_plot(report: dict[str, Any], path: Path) -> None:
    """Tokens/s of every side against concurrency, their latencies, and the servers' CPU by process."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, rows = report["meta"], report["levels"]
    cs = [r["concurrency"] for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 5), dpi=110)
    for side in SIDES:
        color = _COLORS[side]
        tps = [r[side]["output_tokens_per_second"] for r in rows]
        ranges = [r[side]["output_tokens_per_second_range"] for r in rows]
        spread = np.array([[t - lo, hi - t] for t, (lo, hi) in zip(tps, ranges, strict=True)]).T
        ax1.errorbar(cs, tps, yerr=spread, fmt="o-", color=color, capsize=3, label=side.replace("_", "-"))
        for key, style, name in (("latency_ms", "o-", "latency"), ("ttft_ms", "s--", "TTFT")):
            ax2.plot(cs, [r[side][key]["p50"] if r[side][key] else np.nan for r in rows], style, color=color,
                     label=f"{side.replace('_', '-')} {name} p50")
    ax1.set_ylim(bottom=0)
    ax1.set_ylabel("aggregate output tokens / s")
    ax1.set_title("throughput (median pass, range)")
    ax2.set_yscale("log")
    ax2.set_ylabel("ms")
    ax2.set_title("latency")
    x, width = np.arange(len(rows)), 0.4
    parts = {"triton": (("tritonserver", "tab:orange"), ("python_backend", "tab:purple"), ("clients", "tab:gray")),
             "openai": (("openai_server", "tab:green"), ("clients", "silver"))}
    for offset, server in zip((-width / 2, width / 2), SERVERS, strict=True):
        bottom = np.zeros(len(rows))
        for part, color in parts[server]:
            values = np.array([r[server]["cpu_cores"].get(part, 0.0) for r in rows])
            ax3.bar(x + offset, values, width, bottom=bottom, color=color, label=f"{server}: {part.replace('_', ' ')}")
            bottom += values
    ax3.set_xticks(x, [str(c) for c in cs])
    ax3.axhline(meta["host"]["cpu_count"], color="black", linestyle=":", label="CPU cores")
    ax3.set_ylabel("CPU cores busy (left: Triton, right: OpenAI)")
    ax3.set_title("where the CPU goes")
    finish_plot(fig, (ax1, ax2, ax3), cs, f"{Path(meta['model']).name}: Triton and the OpenAI server over HTTP vs "
                f"in-process, {meta['backend']}, {meta['threads']} thread(s), {meta['requests']} requests per level x "
                f"{meta['repeats']} passes", path)


def write_outputs(report: dict[str, Any], out: Path, stem: str, plot: bool, progress: Progress) -> None:
    write_report(out, stem, render_markdown(report), report, (lambda path: render_plot(report, path)) if plot else None,
                 progress)


# ----------------------------------------------------------------------------- CLI


@click.command("bench-serve")
@click.argument("model_dir", type=click.Path(path_type=Path))
@level_options(DEFAULT_LEVELS, DEFAULT_REPEATS)
@click.option("--requests", type=int, default=DEFAULT_REQUESTS, show_default=True,
              help="Requests per level and side: the first N held-out prompts, the same at every level.")
@click.option("--threads", type=int, default=1, show_default=True, help="onnxruntime intra-op threads, every side.")
@click.option("--max-requests", type=int, default=None, help="KV regions, every side (default: the CPU runner's).")
@click.option("--max-batch", type=int, default=None,
              help="Forwards packed per call, every side (default: the runner's).")
@click.option("--warmup", type=int, default=32, show_default=True,
              help="Warm-up requests (other held-out prompts) per side at the highest level, not measured.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/serving"), show_default=True)
@click.option("--no-plot", is_flag=True, help="Skip the .png.")
def bench_serve(model_dir: Path, levels: str, requests: int, repeats: int, threads: int, max_requests: int | None,
                max_batch: int | None, warmup: int, out: Path, no_plot: bool) -> None:
    """Tokens/s, requests/s, TTFT, inter-token latency and request latency of closed-loop HTTP clients of
    the Triton server and of the OpenAI-compatible server on MODEL_DIR (an export, or a checkpoint exported
    to a temporary directory), beside the same requests in-process, and each server's overhead per request at
    concurrency 1."""
    report = run_serve_bench(ServeBenchConfig(
        model=model_dir, levels=parse_levels(levels), requests=requests, repeats=repeats, threads=threads,
        max_requests=max_requests, max_batch=max_batch, warmup=warmup, out=out, plot=not no_plot))
    click.echo(render_markdown(report))
