"""The Triton model: a decoupled Python-backend model over one Generator.

Triton hands `execute` requests as they arrive; each is read (serve/triton/tensors.py), submitted to the
Generator and answered from a thread of its own, so requests run concurrently and their forwards
are batched step by step by the runtime's engine, not in lockstep by Triton. A watcher polls
Triton's cancellation flag (a client that went away, a gRPC stream cancelled) and cancels the
runtime request, which frees its KV region within one forward. Load this only inside Triton's Python
backend stub: `triton_python_backend_utils` exists nowhere else.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import Generator
from refusion.runtime.request import GenerationResult, Request
from refusion.serve.triton.settings import ServeSettings
from refusion.serve.triton.tensors import INPUT_NAMES, read_request

_WATCH_S = 0.05  # how often client cancellation is polled: well under one forward of a real model
_FINAL_WAIT_S = 30.0  # at unload, for cancelled requests' final responses (each needs at most one forward)


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        self.settings = ServeSettings.from_parameters(
            {k: v["string_value"] for k, v in config.get("parameters", {}).items()})
        s = self.settings
        self.gen = Generator.from_dir(s.model_dir, backend=s.backend, threads=s.threads,
                                      max_requests=s.max_requests, max_batch=s.max_batch)
        self.limit = self.gen.runner.max_requests + s.max_queue
        self.live: dict[Request, Any] = {}  # runtime request -> its Triton request, until its final response
        self.lock = threading.Condition()
        self.stopping = threading.Event()
        self.drain_deadline: float | None = None  # set once the launcher asks for a drain (SIGTERM)
        labels = {"model": config["name"]}
        # The families must outlive their metrics (Triton refuses to set a metric of a deleted family).
        self.families = [pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.GAUGE)
                         for name, text in (("refusion_requests_in_flight", "Requests submitted and not yet ended"),
                                            ("refusion_kv_slots_in_use", "KV-cache regions held by running requests"))]
        self.in_flight, self.kv_slots = (family.Metric(labels=labels) for family in self.families)
        self.watcher = threading.Thread(target=self._watch, name="refusion-cancel-watch", daemon=True)
        self.watcher.start()

    def execute(self, requests: list[Any]) -> None:
        for triton_request in requests:
            self._start(triton_request)
        return None  # decoupled: every response goes through the request's sender

    def finalize(self) -> None:
        """Triton unloads the model (shutdown, after its drain timeout): what still runs is
        cancelled and gets its final response, then the engine stops."""
        self.stopping.set()
        with self.lock:
            for request in self.live:
                request.cancel()  # each ends within a forward; its thread sends the final response
            self.lock.wait_for(lambda: not self.live, timeout=_FINAL_WAIT_S)
        self.watcher.join()
        self.gen.close()

    # -- one request ----------------------------------------------------------------------
    def _start(self, triton_request: Any) -> None:
        sender = triton_request.get_response_sender()
        try:
            tensors = {name: t.as_numpy() for name in INPUT_NAMES
                       if (t := pb_utils.get_input_tensor_by_name(triton_request, name)) is not None}
            job = read_request(tensors)
            if self.stopping.is_set() or self.drain_deadline is not None:
                raise _Unavailable("the server is shutting down; send the request to another instance.")
            held = len(self.live)  # only this thread (Triton's execute) adds: it cannot grow before the insert
            if held >= self.limit:
                raise _Unavailable(
                    f"the server holds {held} requests, its limit ({self.gen.runner.max_requests} running "
                    f"+ {self.settings.max_queue} queued, --max-queue); retry later or add instances.")
            # Tokenizing and submitting stay outside the lock that the watcher and final responses take.
            request = self.gen.submit(job.prompt, chat=job.chat, timeout_s=job.timeout_s, **job.settings)
            with self.lock:
                self.live[request] = triton_request
        except _Unavailable as e:
            _send_error(sender, str(e), pb_utils.TritonError.UNAVAILABLE)
            return
        except RefusionError as e:
            _send_error(sender, _server_names(str(e)), pb_utils.TritonError.INVALID_ARG)
            return
        self._update_metrics()
        threading.Thread(target=self._respond, args=(request, sender, job.stream), daemon=True,
                         name=f"refusion-respond-{request.id}").start()

    def _respond(self, request: Request, sender: Any, stream: bool) -> None:
        try:
            if stream:
                for piece in request:
                    _send(sender, _response(text=piece))
            result = request.result()
            final = _response(text="" if stream else result.text, result=result)
        except RefusionError as e:  # it failed alone (e.g. over a runner's limit), with its own error
            final = _error(_server_names(str(e)), pb_utils.TritonError.INVALID_ARG)
        except Exception as e:  # noqa: BLE001 - a bug: the client still gets a final response
            final = _error(f"internal error: {type(e).__name__}: {e}", pb_utils.TritonError.INTERNAL)
        # The final response frees Triton's request; the watcher must not poll it after that (Triton
        # crashes in is_cancelled), so it is sent and the request dropped under the watcher's lock.
        with self.lock:
            _send(sender, final, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            self.live.pop(request, None)
            self.lock.notify_all()
        self._update_metrics()

    def _watch(self) -> None:
        """Cancel the requests whose client went away, and all of them once the drain's deadline passes."""
        while not self.stopping.wait(_WATCH_S):
            self._read_drain_deadline()
            expired = self.drain_deadline is not None and time.time() > self.drain_deadline
            with self.lock:
                gone = [request for request, triton_request in self.live.items()
                        if expired or triton_request.is_cancelled()]
            for request in gone:
                request.cancel()
            self._update_metrics()

    def _read_drain_deadline(self) -> None:
        path = self.settings.drain_file
        if self.drain_deadline is None and path is not None and os.path.exists(path):
            with open(path) as f:
                self.drain_deadline = float(f.read())

    def _update_metrics(self) -> None:
        self.in_flight.set(float(self.gen.scheduler.in_flight))
        self.kv_slots.set(float(self.gen.scheduler.regions_in_use))


class _Unavailable(Exception):
    """Over the queue limit or shutting down: a clear rejection the client may retry."""


def _response(text: str, result: GenerationResult | None = None) -> Any:
    tensors = [pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))]
    if result is not None:
        tensors += [pb_utils.Tensor("token_ids", np.array(result.token_ids, dtype=np.int64)),
                    pb_utils.Tensor("finish_reason", np.array([result.finish_reason.encode()], dtype=np.object_))]
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _send(sender: Any, response: Any, flags: int = 0) -> None:
    try:
        sender.send(response, flags=flags)
    except Exception:  # noqa: BLE001 - the client went away; the watcher cancels its request
        pass


def _error(message: str, code: Any) -> Any:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def _send_error(sender: Any, message: str, code: Any) -> None:
    _send(sender, _error(message, code), pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _server_names(message: str) -> str:
    """The runtime's gen_length is max_tokens on the wire."""
    return message.replace("gen_length", "max_tokens")
