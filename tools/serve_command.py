"""`refusion-run serve`: an export or engines directory behind an OpenAI-compatible HTTP server in this
process (--api openai, the default) or NVIDIA Triton Inference Server (--api triton); and `refusion-run
client`: one request to either over HTTP, in the API `serve` speaks by default (--api triton for Triton's).

    refusion-run serve out/refusion-onnx [--api openai|triton] [--model-name refusion] [--http-port 8000]
                 [--grpc-port 8001 --metrics-port 8002 (triton)] [--address 127.0.0.1] [--allowed-host NAME (openai)]
                 [--api-key KEY]
                 [--max-requests N] [--max-batch N] [--max-queue N] [--prefix-cache-mb MB] [--backend ...]
                 [--replicas N [--min-replicas N --max-replicas N] [--gpus-per-replica G] [--ray-address ADDR]]
    refusion-run client "prompt" [--url http://127.0.0.1:8000] [--api openai|triton] [--api-key KEY] [--chat]
                 [--stream] [--json] [--client-timeout S] [decode options]

docs/serving.md has the requests (the openai client, curl, tritonclient), the fields and tensors, why the
default is the OpenAI API, scaling out through Ray Serve (--replicas: serve/rayserve/), and what was measured.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import click

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.profiles import DEFAULT_PREFILL_CHUNK
from refusion.runtime.generator import Generator
from refusion.runtime.runners import BACKENDS
from refusion.serve.http_client import CLIENT_TIMEOUT_S
from refusion.serve.openai import client as openai_client
from refusion.serve.security import API_KEY_ENV, DEFAULT_ADDRESS, api_key, bind_address, exposure_warning
from refusion.serve.triton import client as triton_client
from refusion.serve.triton.launcher import Ports, TritonServer, check_export
from refusion.serve.triton.settings import ServeSettings
from refusion.tools.cli_common import given_settings, progress, quiet_option, read_prompt, setting_options

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
APIS = ("openai", "triton")
_TRITON_ONLY = ("grpc_port", "metrics_port")
_OPENAI_ONLY = ("allowed_host",)
_RAY_ONLY = ("replicas", "min_replicas", "max_replicas", "gpus_per_replica", "ray_address")


@click.command("serve")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--api", type=click.Choice(APIS), default="openai", show_default=True,
              help="openai: /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics on --http-port, "
                   "served in this process; triton: NVIDIA Triton's generate endpoints, gRPC and metrics ports.")
@click.option("--model-name", default="refusion", show_default=True,
              help="The model's name: OpenAI's \"model\" field, or the name in Triton's URLs.")
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option("--grpc-port", type=int, default=8001, show_default=True, help="With --api triton.")
@click.option("--metrics-port", type=int, default=8002, show_default=True,
              help="With --api triton (the OpenAI server has /metrics on --http-port).")
@click.option("--address", default=DEFAULT_ADDRESS, show_default=True,
              help="Interface to listen on (0.0.0.0: every interface; give --api-key then).")
@click.option("--allowed-host", multiple=True, metavar="NAME",
              help="With --api openai: a name clients reach the server by, taken in the Host header beside IP "
                   "addresses, localhost and --address (others are refused, against DNS rebinding); repeatable; "
                   "'*' takes any (behind a proxy that checks it).")
@click.option("--api-key", "key", default=None,
              help=f"Clients must send Authorization: Bearer KEY (default: ${API_KEY_ENV}, else no key).")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True)
@click.option("--threads", type=int, default=None,
              help="onnxruntime intra-op threads (default: all cores; with --replicas, 1 a replica, the CPUs it reserves).")
@click.option("--max-requests", type=int, default=None,
              help="Requests decoding at once, a KV region each (default: the backend's; more wait in the queue).")
@click.option("--max-batch", type=int, default=None, help="Their forwards packed per call (default: the backend's).")
@click.option("--max-queue", type=int, default=ServeSettings.max_queue, show_default=True,
              help="Requests waiting beyond those decoding; more are refused at once (HTTP 429, RESOURCE_EXHAUSTED).")
@click.option("--prefix-cache-mb", type=float, default=ServeSettings.prefix_cache_mb, show_default=True,
              help="Budget of the prefix cache: the KV of prompt prefixes later requests copy instead of "
                   "prefilling (a shared system prompt); 0 turns it off.")
@click.option("--prefill-chunk", type=int, default=None,
              help=f"The most tokens one forward feeds: a longer prompt is prefilled in chunks, other requests' steps "
                   f"between them [default: {DEFAULT_PREFILL_CHUNK}, or the engines' own]; 0: no bound.")
@click.option("--guide-budget-ms", type=float, default=ServeSettings.guide_budget_ms, show_default=True,
              help="The grammar engine's work a guided request may take a token (a mask, a commit); a request over "
                   "it ends with an error naming its guide, and the others go on.")
@click.option("--replicas", type=int, default=None,
              help="With --api openai: serve through Ray Serve, this many replicas, each a process with its own "
                   "model, KV and prefix cache, requests routed by prompt prefix (the ray extra; docs/serving.md, "
                   "\"Scaling out with Ray Serve\"). Default: one process, no Ray.")
@click.option("--min-replicas", type=int, default=None, help="With --max-replicas: autoscaling's lower bound.")
@click.option("--max-replicas", type=int, default=None,
              help="Let Serve scale the replicas by load, up to this many (from --replicas at the start).")
@click.option("--gpus-per-replica", type=float, default=None, help="With --replicas: GPUs each replica reserves.")
@click.option("--ray-address", default=None,
              help="With --replicas: an existing Ray cluster (HOST:PORT, ray://HOST:PORT, auto); default: start a "
                   "local one, stopped with the server.")
@click.option("--drain-timeout", type=int, default=30, show_default=True,
              help="On SIGTERM or Ctrl-C: seconds for requests in flight to finish before they are cancelled.")
@click.option("--verbose", is_flag=True, help="The server's info log too (OpenAI: an access log line per request; "
                                              "--replicas: every Ray worker's log).")
@quiet_option
@click.pass_context
def serve(ctx: click.Context, model_dir: Path, api: str, model_name: str, http_port: int, grpc_port: int,
          metrics_port: int, address: str, allowed_host: tuple[str, ...], key: str | None, backend: str,
          threads: int | None,
          max_requests: int | None, max_batch: int | None, max_queue: int, prefix_cache_mb: float,
          prefill_chunk: int | None, guide_budget_ms: float, replicas: int | None, min_replicas: int | None,
          max_replicas: int | None, gpus_per_replica: float | None, ray_address: str | None, drain_timeout: int,
          verbose: bool) -> None:
    """Serve the export or engines in MODEL_DIR: an OpenAI-compatible API in this process (--api openai,
    the default), or NVIDIA Triton (--api triton: HTTP generate and generate_stream, gRPC streaming, health and
    metrics). Requests run concurrently, their forwards batched step by step. It listens on this host only
    unless --address says otherwise; bodies, JSON nesting and prompts are bounded (docs/serving.md, "Security
    and limits"). SIGTERM or Ctrl-C drains and stops; the exit code is 1 (with an error line) if the server
    failed. With --replicas, the OpenAI server runs as a Ray Serve application of that many replicas."""
    settings = ServeSettings(str(model_dir.resolve()), backend, threads, max_requests, max_batch, max_queue,
                             prefix_cache_mb, prefill_chunk, guide_budget_ms)
    key = api_key(key)
    given = [f"--{name.replace('_', '-')}" for name in (_TRITON_ONLY if api == "openai" else _OPENAI_ONLY)
             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
    if given:
        raise RefusionError(f"{given[0]} is Triton's; the OpenAI server takes everything on --http-port (add --api "
                            "triton for Triton's ports)." if api == "openai" else f"{given[0]} is the OpenAI server's; "
                            "Triton's gateways do not check the Host header (drop it, or serve --api openai).")
    ray_given = [f"--{name.replace('_', '-')}" for name in _RAY_ONLY
                 if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
    if ray_given and api != "openai":
        raise RefusionError(f"{ray_given[0]} scales the OpenAI server out through Ray Serve; Triton scales its own "
                            "way (docs/serving.md, \"Scaling out\"): drop it, or serve --api openai.")
    if ray_given:
        from refusion.serve.rayserve.app import ScaleOut

        scale = ScaleOut(str(model_dir), replicas=replicas if replicas is not None else min_replicas or 1,
                         min_replicas=min_replicas, max_replicas=max_replicas, threads=threads or 1,
                         gpus_per_replica=gpus_per_replica or 0.0, model_name=model_name, api_key=key,
                         allowed_hosts=list(allowed_host), backend=backend, max_requests=max_requests,
                         max_batch=max_batch, max_queue=max_queue, prefix_cache_mb=prefix_cache_mb,
                         prefill_chunk=prefill_chunk, guide_budget_ms=guide_budget_ms,
                         drain_timeout_s=float(drain_timeout))
        _serve_ray(scale, address, http_port, ray_address, verbose)
        return
    if api == "openai":
        check_export(model_dir, settings)  # the export and the runner options, before anything loads
        warning = exposure_warning(bind_address(address), key)
        if warning:
            click.echo(warning, err=True)
        _serve_openai(model_dir, settings, model_name, http_port, address, allowed_host, key, drain_timeout, verbose)
        return
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # the gRPC gateway's library logs no INFO lines of its own
    server = TritonServer(model_dir, Ports(http_port, grpc_port, metrics_port, address), settings, model_name,
                          drain_timeout, verbose=verbose, api_key=key)
    check_export(model_dir, settings)
    warning = exposure_warning(bind_address(address), key)
    if warning:
        click.echo(warning, err=True)
    stopped: list[int] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        stopped.append(signum)
        progress(f"{signal.Signals(signum).name}: draining (up to {drain_timeout} s), then stopping")
        server.signal(signal.SIGTERM)

    previous = {signum: signal.signal(signum, stop) for signum in _STOP_SIGNALS}
    try:
        progress(f"starting Triton on {model_dir} ({backend})")
        try:
            server.start()
        except Exception:
            if stopped:  # stopped while loading: not an error
                raise SystemExit(128 + stopped[0]) from None
            raise
        progress(f"ready: POST {server.url}/v2/models/{model_name}/generate (and generate_stream); "
                 f"gRPC on :{grpc_port}, metrics on :{metrics_port}")
        code = server.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if server.failure is not None:
        raise RefusionError(f"{server.failure}; the server stopped (restart it, or let its supervisor).")
    if code != 0:
        ended = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        raise RefusionError(f"tritonserver {ended} while {'stopping' if stopped else 'serving'}; its log above says "
                            "why, if it could.")
    progress("stopped (tritonserver exit code 0)")


def _serve_openai(model_dir: Path, settings: ServeSettings, model_name: str, http_port: int, address: str,
                  allowed_hosts: tuple[str, ...], key: str | None, drain_timeout: int, verbose: bool) -> None:
    from refusion.serve.openai.server import OpenAIServer  # the serve extra's FastAPI and uvicorn

    s = settings
    progress(f"loading {model_dir} ({s.backend})")
    with Generator.from_dir(model_dir, backend=s.backend, threads=s.threads, max_requests=s.max_requests,
                            max_batch=s.max_batch, prefix_cache_mb=s.prefix_cache_mb,
                            prefill_chunk=s.prefill_chunk, guide_budget_ms=s.guide_budget_ms) as gen:
        server = OpenAIServer(gen, model_name=model_name, address=address, port=http_port, api_key=key,
                              max_queue=s.max_queue, drain_timeout_s=drain_timeout, allowed_hosts=allowed_hosts,
                              verbose=verbose)

        def stop(signum: int, frame: FrameType | None) -> None:
            if server.frontend.drain_deadline is None:
                progress(f"{signal.Signals(signum).name}: draining (up to {drain_timeout} s), then stopping")
            server.drain()

        previous = {signum: signal.signal(signum, stop) for signum in _STOP_SIGNALS}
        try:
            progress(f"ready: {server.url}/v1 (chat/completions, completions, responses, models; model {model_name!r}), "
                     f"{server.url}/health, {server.url}/metrics; {gen.runner.name}, {gen.runner.max_requests} "
                     f"running + {s.max_queue} queued at most")
            server.run()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    progress("stopped")


def _serve_ray(scale: Any, address: str, http_port: int, ray_address: str | None, verbose: bool) -> None:
    from refusion.serve.rayserve.launch import serve_replicated

    warning = exposure_warning(bind_address(address), scale.api_key)
    if warning:
        click.echo(warning, err=True)
    serve_replicated(scale, address=bind_address(address), port=http_port, ray_address=ray_address,
                     progress=progress, verbose=verbose)
    progress("stopped")


@click.command("client")
@click.argument("prompt")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True,
              help="The server's HTTP address (both APIs' --http-port defaults to 8000).")
@click.option("--api", type=click.Choice(APIS), default="openai", show_default=True,
              help="The API the server speaks, as `serve --api` gave it: openai (/v1/completions, with --chat "
                   "/v1/chat/completions) or triton (generate, generate_stream).")
@click.option("--model-name", default="refusion", show_default=True)
@click.option("--chat", is_flag=True, help="Wrap PROMPT as a user message in the model's chat template.")
@click.option("--stream", is_flag=True, help="Print text as it settles (generate_stream).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the final response as JSON: text, token_ids, finish_reason, cached_prompt_tokens.")
@click.option("--logprobs", is_flag=True, help="With --json: each token's log-probability (return_log_probs).")
@click.option("--client-timeout", type=float, default=CLIENT_TIMEOUT_S, show_default=True,
              help="Seconds to wait for the server's answer (when streaming: for each event) before giving up.")
@click.option("--api-key", "key", default=None, help=f"The server's API key (default: ${API_KEY_ENV}, else none).")
@setting_options
def client(prompt: str, url: str, api: str, model_name: str, chat: bool, stream: bool, as_json: bool, logprobs: bool,
           client_timeout: float, key: str | None, **options: Any) -> None:
    """Send PROMPT to a server started with `refusion-run serve` and print the answer. Decode settings
    left out take the values the served export recorded. PROMPT - reads the prompt from stdin (its trailing
    newline dropped). finish_reason is the server API's own (OpenAI's stop or length; Triton's eos, stop,
    length, timeout or cancelled)."""
    prompt = read_prompt(prompt)
    if stream and as_json:
        raise RefusionError("--stream and --json do not combine; choose one.")
    if logprobs and not as_json:
        raise RefusionError("--logprobs is reported in the JSON output; add --json.")
    settings = {**given_settings(options), **({"logprobs": True} if logprobs else {})}
    timeout_s = settings.pop("timeout_s", None)
    if not client_timeout > 0:
        raise RefusionError(f"--client-timeout {client_timeout} must be a positive number of seconds.")
    key = api_key(key)
    speaks = openai_client if api == "openai" else triton_client
    body = speaks.request_body(prompt, settings, chat=chat, stream=stream, timeout_s=timeout_s)
    t0 = time.perf_counter()
    if stream:
        for event in speaks.stream_events(url, model_name, body, client_timeout, key):
            click.echo(event.get("text_output", ""), nl=False)
            sys.stdout.flush()
        click.echo()
        final = event
    else:
        final = speaks.generate(url, model_name, body, client_timeout, key)
        if as_json:
            extra = {"logprobs": final["output_log_probs"]} if logprobs else {}
            click.echo(json.dumps({"text": final["text_output"], "token_ids": final["token_ids"],
                                   "finish_reason": final["finish_reason"],
                                   "cached_prompt_tokens": final["cached_prompt_tokens"], **extra}))
        else:
            click.echo(final["text_output"])
    progress(f"{len(final['token_ids'])} tokens, finish_reason {final['finish_reason']}, "
             f"{time.perf_counter() - t0:.3f} s")
