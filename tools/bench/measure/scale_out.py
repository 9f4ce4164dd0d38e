"""The OpenAI server scaled out with Ray Serve on this machine: what replicas buy against one process, and what
prefix-affinity routing buys against Serve's default. Writes results/scale-out/ (scale-out.json and .md).

    python -m refusion.tools.bench.measure.scale_out --work DIR [--model models/refusion-tiny]
        [--out results/scale-out] [--requests 256] [--concurrency 16] [--replicas 1,2,4]

Scale: --concurrency closed-loop clients stream --requests held-out chat prompts to one `refusion-run serve`
process (--threads 1), then to the Ray Serve application at each replica count (one thread a replica, Ray told
the machine has as many CPUs as the most replicas), then to the one process again (how much the machine drifted).
Requests/s, latency and time to first token p50 / p99; every answer must equal the Generator's alone.
Routing: 2 replicas, system prompts of about 200 tokens, each request one of them (at random) and a held-out
question, 4 clients; the prefix-affinity router against the same router without affinity (Serve's default
power of two choices): the share of requests whose system prompt came from a replica's prefix cache, TTFT.
With 4 system prompts and the default prefix cache (each replica's holds them all), and with 16 and a cache
that holds 10 (affinity splits them 8 and 8; without it, each replica sees all 16).
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import Generator
from refusion.tools import tasks as T
from refusion.tools.bench.common import closed_loop, cpu_flags, cpu_model, host_info, percentiles, resolve_model
from refusion.tools.bench.measure.prefix_cache import system_prompt

TIMEOUT_S = 300.0
SCENARIOS = {4: None, 16: 10}  # system prompts: what a replica's prefix cache holds of them (None: the default)
CLIENTS = 4  # of the routing runs


@dataclass(frozen=True)
class Answer:
    text: str
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    replica: str | None


def ask(port: int, messages: list[dict[str, str]]) -> Answer:
    """One streamed chat request, greedy, with its usage; its events read through [DONE]."""
    body = {"model": "refusion", "messages": messages, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    text, first, usage = "", None, None
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RefusionError(f"the server refused a request ({response.status}): {response.read()[:300]!r}")
        for line in response:
            data = line.removeprefix(b"data: ").strip()
            if not line.startswith(b"data: ") or data == b"[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                raise RefusionError(f"the server failed a request: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if choice["delta"].get("content"):
                    first = first if first is not None else time.perf_counter() - t0
                    text += choice["delta"]["content"]
        replica = response.getheader("x-refusion-replica")
    finally:
        conn.close()
    if usage is None:
        raise RefusionError("a stream ended without its usage chunk")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    latency = time.perf_counter() - t0
    return Answer(text, first if first is not None else latency, latency, usage["prompt_tokens"], cached, replica)


def load(port: int, conversations: list[list[dict[str, str]]], concurrency: int) -> tuple[list[Answer], float]:
    return closed_loop(lambda i: ask(port, conversations[i]), len(conversations), concurrency)


def summary(answers: list[Answer], wall: float, expected: list[str] | None = None) -> dict[str, Any]:
    if expected is not None:
        wrong = [i for i, (a, e) in enumerate(zip(answers, expected)) if a.text != e]
        if wrong:
            raise RefusionError(f"{len(wrong)} answers differ from the Generator's alone (first: request {wrong[0]}: "
                                f"{answers[wrong[0]].text!r} != {expected[wrong[0]]!r})")
    hits = [a for a in answers if a.cached_tokens > 0]
    return {"requests": len(answers), "requests_per_s": len(answers) / wall, "wall_s": wall,
            "latency_ms": percentiles([a.latency_s for a in answers]), "ttft_ms": percentiles([a.ttft_s for a in answers]),
            "cache_hit_share": len(hits) / len(answers),
            "cached_token_share": sum(a.cached_tokens for a in answers) / sum(a.prompt_tokens for a in answers),
            "replicas_used": len({a.replica for a in answers if a.replica})}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def one_process(export: Path) -> Iterator[int]:
    """`refusion-run serve` as a process of its own, one onnxruntime thread."""
    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).parent / "refusion-run"), "serve", str(export), "--backend",
                               "ort-cpu", "--threads", "1", "--http-port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert server.stdout is not None
        for line in server.stdout:
            if line.startswith("ready:"):
                break
        else:
            raise RefusionError("refusion-run serve did not start")
        yield port
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=TIMEOUT_S)


@contextmanager
def replicated(export: Path, port: int, **options: Any) -> Iterator[int]:
    from ray import serve

    from refusion.serve.rayserve.app import build_app

    serve.run(build_app({"model_dir": str(export), "backend": "ort-cpu", **options}), name="refusion", route_prefix="/")
    try:
        yield port
    finally:
        serve.delete("refusion")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--model", type=Path, default=Path("models/refusion-tiny"))
    parser.add_argument("--out", type=Path, default=Path("results/scale-out"))
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--replicas", default="1,2,4")
    parser.add_argument("--routing-requests", type=int, default=128)
    args = parser.parse_args(argv)
    levels = [int(n) for n in args.replicas.split(",")]
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    export, _ = resolve_model(args.model, args.work, progress)
    examples = T.held_out(args.requests + args.routing_requests)
    conversations = [[{"role": "user", "content": ex.prompt}] for ex in examples[:args.requests]]
    with Generator.from_dir(export, backend="ort-cpu", threads=1) as gen:
        rng = np.random.default_rng(0)
        systems = [system_prompt(gen, rng) for _ in range(max(SCENARIOS))]
        # One system prompt's KV in a prefix cache: what a cache that holds N of them takes
        gen.generate(messages=[{"role": "system", "content": systems[0]}, {"role": "user", "content": "hi"}],
                     chat=True, temperature=0)
        cache = gen.status().prefix_cache
        assert cache is not None and cache.blocks
        one_mb = cache.bytes / 2**20
        pick = random.Random(0)
        questions = examples[args.requests:]
        routed = {count: [[{"role": "system", "content": pick.choice(systems[:count])},
                           {"role": "user", "content": ex.prompt}] for ex in questions] for count in SCENARIOS}
        progress("the Generator's answers alone, for the check")
        expected = [gen.generate(messages=c, chat=True, temperature=0).text for c in conversations]
        expected_routed = {count: [gen.generate(messages=c, chat=True, temperature=0).text for c in conversations_]
                           for count, conversations_ in routed.items()}
    rows: dict[str, Any] = {}
    with one_process(export) as port:
        progress("one process")
        load(port, conversations[:32], args.concurrency)  # warm-up
        rows["one process"] = summary(*load(port, conversations, args.concurrency), expected)
    import ray
    from ray import serve

    ray.init(num_cpus=max(*levels, 2), include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    routing: dict[str, Any] = {}
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for n in levels:
            with replicated(export, port, replicas=n):
                progress(f"{n} replica(s)")
                load(port, conversations[:32], args.concurrency)
                rows[f"{n} replica(s)"] = summary(*load(port, conversations, args.concurrency), expected)
        for count, held in SCENARIOS.items():
            cache_mb = {} if held is None else {"prefix_cache_mb": held * one_mb}
            scenario = (f"{count} system prompts, " + ("the default prefix cache" if held is None else
                                                          f"a prefix cache for {held} of them"))
            for name, affinity in (("prefix affinity", True), ("power of two choices", False)):
                with replicated(export, port, replicas=2, prefix_routing=affinity, **cache_mb):
                    progress(f"routing: {name}; {scenario}")
                    routing[f"{name}; {scenario}"] = summary(*load(port, routed[count], CLIENTS), expected_routed[count])
    finally:
        serve.shutdown()
        ray.shutdown()
    with one_process(export) as port:
        progress("one process, again")
        load(port, conversations[:32], args.concurrency)
        rows["one process, again"] = summary(*load(port, conversations, args.concurrency), expected)
    data = {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "host": host_info(("ray", "onnxruntime")),
            "requests": args.requests, "concurrency": args.concurrency, "scale": rows, "routing": routing,
            "routing_requests": args.routing_requests, "routing_clients": CLIENTS}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale-out.json").write_text(json.dumps(data, indent=1) + "\n")
    (args.out / "scale-out.md").write_text(report(data, " ".join(sys.argv[1:] if argv is None else argv)))
    progress(f"wrote {args.out}/scale-out.md and .json")


def report(data: dict[str, Any], command: str) -> str:
    def p(d: dict[str, Any], key: str, q: str) -> str:
        return f"{d[key][q]:.0f}"

    lines = [f"# Scale-out through Ray Serve ({data['cores']} cores: {data['cpu']})", "",
             f"`python -m refusion.tools.bench.measure.scale_out {command}`; CPU flags: {', '.join(data['cpu_flags'])}; "
             f"{data['requests']} held-out chat prompts, streamed, {data['concurrency']} closed-loop clients; every "
             "answer equal to the Generator's alone.", "",
             "| server | requests/s | latency p50 / p99 ms | TTFT p50 / p99 ms | replicas that answered |",
             "|---|---|---|---|---|"]
    for name, row in data["scale"].items():
        lines.append(f"| {name} | {row['requests_per_s']:.1f} | {p(row, 'latency_ms', 'p50')} / "
                     f"{p(row, 'latency_ms', 'p99')} | {p(row, 'ttft_ms', 'p50')} / {p(row, 'ttft_ms', 'p99')} | "
                     f"{row['replicas_used'] or 1} |")
    lines += ["", f"Routing: 2 replicas, system prompts of about 200 tokens, each request one of them at random "
              f"and a held-out question, {data['routing_requests']} requests, {data['routing_clients']} clients.", "",
              "| router | requests with a cached system prompt | prompt tokens from a cache | TTFT p50 / p99 ms | "
              "requests/s |", "|---|---|---|---|---|"]
    for name, row in data["routing"].items():
        lines.append(f"| {name} | {100 * row['cache_hit_share']:.0f}% | {100 * row['cached_token_share']:.0f}% | "
                     f"{p(row, 'ttft_ms', 'p50')} / {p(row, 'ttft_ms', 'p99')} | {row['requests_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
