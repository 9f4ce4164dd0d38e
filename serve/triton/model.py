"""The Triton model: a decoupled Python-backend model over the serving frontend (serve/frontend.py).

Triton hands `execute` requests as they arrive; each is read (serve/triton/tensors.py), submitted and
answered from a thread of its own, so requests run concurrently and the runtime's scheduler batches their
forwards step by step. A watcher polls Triton's cancellation flag (a client that went away, a gRPC stream
cancelled) and the launcher's drain file. Load this only inside Triton's Python backend stub:
`triton_python_backend_utils` exists nowhere else.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import Generator
from refusion.runtime.request import GenerationResult, Request
from refusion.serve.frontend import Final, Frontend
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
        gen = Generator.from_dir(s.model_dir, backend=s.backend, threads=s.threads, max_requests=s.max_requests,
                                 max_batch=s.max_batch, prefix_cache_mb=s.prefix_cache_mb)
        self.frontend: Frontend[Any] = Frontend(gen, s.max_queue)  # handles: Triton's requests
        self.stopping = threading.Event()
        labels = {"model": config["name"]}
        # The families must outlive their metrics (Triton refuses to set a metric of a deleted family).
        self.families = [pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.GAUGE)
                         for name, text in (("refusion_requests_in_flight", "Requests submitted and not yet ended"),
                                            ("refusion_kv_slots_in_use", "KV-cache regions held by running requests"))]
        self.in_flight, self.kv_regions = (family.Metric(labels=labels) for family in self.families)
        self.watcher = threading.Thread(target=self._watch, name="refusion-cancel-watch", daemon=True)
        self.watcher.start()

    def execute(self, requests: list[Any]) -> None:
        for triton_request in requests:
            self._start(triton_request)
        return None  # decoupled: every response goes through the request's sender

    def finalize(self) -> None:
        """Triton unloads the model (shutdown, after its drain timeout): what still runs is
        cancelled and gets its final response, then the scheduler stops."""
        self.frontend.close(_FINAL_WAIT_S)
        self.stopping.set()
        self.watcher.join()
        self.frontend.gen.close()

    # -- one request ----------------------------------------------------------------------
    def _start(self, triton_request: Any) -> None:
        sender = triton_request.get_response_sender()
        try:
            tensors = {name: t.as_numpy() for name in INPUT_NAMES
                       if (t := pb_utils.get_input_tensor_by_name(triton_request, name)) is not None}
            job = read_request(tensors)
            refusal = self.frontend.refusal()  # only this thread (Triton's execute) submits
            if refusal is not None:
                _send_error(sender, refusal, pb_utils.TritonError.UNAVAILABLE)
                return
            request = self.frontend.submit(job, triton_request)
        except RefusionError as e:
            _send_error(sender, str(e), pb_utils.TritonError.INVALID_ARG)
            return
        self._update_metrics()
        threading.Thread(target=self._respond, args=(request, sender, job.stream), daemon=True,
                         name=f"refusion-respond-{request.id}").start()

    def _respond(self, request: Request, sender: Any, stream: bool) -> None:
        def final(outcome: Final) -> None:
            # The final response frees Triton's request; the watcher must not poll it after that (Triton
            # crashes in is_cancelled), so the frontend sends it under the watcher's lock.
            if outcome.result is not None:
                response = _response(text="" if stream else outcome.result.text, result=outcome.result)
            else:
                code = pb_utils.TritonError.INTERNAL if outcome.internal else pb_utils.TritonError.INVALID_ARG
                response = _error(outcome.error, code)
            _send(sender, response, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

        self.frontend.respond(request, stream, lambda text: _send(sender, _response(text=text)), final)
        self._update_metrics()

    def _watch(self) -> None:
        """Cancel the requests whose client went away, and all of them once the drain's deadline passes."""
        while not self.stopping.wait(_WATCH_S):
            self._read_drain_deadline()
            self.frontend.cancel_gone(lambda triton_request: triton_request.is_cancelled())
            self._update_metrics()

    def _read_drain_deadline(self) -> None:
        path = self.settings.drain_file
        if self.frontend.drain_deadline is None and path is not None and os.path.exists(path):
            with open(path) as f:
                self.frontend.drain(float(f.read()))

    def _update_metrics(self) -> None:
        metrics = self.frontend.metrics()
        self.in_flight.set(float(metrics.requests_in_flight))
        self.kv_regions.set(float(metrics.kv_regions_in_use))


def _response(text: str, result: GenerationResult | None = None) -> Any:
    tensors = [pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))]
    if result is not None:
        tensors += [pb_utils.Tensor("token_ids", np.array(result.token_ids, dtype=np.int64)),
                    pb_utils.Tensor("finish_reason", np.array([result.finish_reason.encode()], dtype=np.object_)),
                    pb_utils.Tensor("cached_prompt_tokens", np.array([result.stats.cached_prompt_tokens], np.int32))]
        if result.logprobs is not None:
            tensors.append(pb_utils.Tensor("output_log_probs", np.array(result.logprobs, dtype=np.float32)))
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
