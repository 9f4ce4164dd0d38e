"""The Triton model: a decoupled Python-backend model over the serving frontend (serve/frontend.py).

Triton hands `execute` requests as they arrive; each is read (serve/triton/tensors.py) and admitted there,
then tokenized, submitted and answered from a thread of its own, so requests run concurrently and the
runtime's scheduler batches their forwards step by step. A watcher polls Triton's cancellation flag (a client
that went away, a gRPC stream cancelled), the launcher's drain file, and whether this process should live on:
it exits when tritonserver or `refusion-run serve` has died (nothing outlives them) or when the scheduler
thread has (the launcher then sees the stub die and stops the server, so that a supervisor restarts it).
Errors cross Triton as `Final.coded()` messages: Triton keeps no error code of a Python model's response.

The settings come from settings.json beside this model's model.py (written by the launcher), not from
config.pbtxt: the model configuration Triton shows holds no host path. Load this only inside Triton's Python
backend stub: `triton_python_backend_utils` exists nowhere else.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import Generator
from refusion.runtime.request import GenerationResult
from refusion.serve.frontend import Final, Frontend, ServeRequest, Status
from refusion.serve.triton.fd_wait import readable
from refusion.serve.triton.settings import SETTINGS_FILE, ServeSettings
from refusion.serve.triton.tensors import INPUT_NAMES, read_request

_WATCH_S = 0.05  # how often client cancellation is polled: well under one forward of a real model
_FINAL_WAIT_S = 5.0  # at unload, for cancelled requests' final responses (each needs at most one forward)


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        self.parent = os.getppid()  # tritonserver
        self.settings = s = ServeSettings.read(Path(args["model_repository"]) / args["model_version"] / SETTINGS_FILE)
        self.launcher = os.pidfd_open(s.launcher_pid) if s.launcher_pid is not None else None
        try:
            gen = Generator.from_dir(s.model_dir, backend=s.backend, threads=s.threads, max_requests=s.max_requests,
                                     max_batch=s.max_batch, prefix_cache_mb=s.prefix_cache_mb,
                                     prefill_chunk=s.prefill_chunk, guide_budget_ms=s.guide_budget_ms)
        except RefusionError as e:  # the launcher prints it as one line, in place of Triton's load-failure report
            if s.work_dir is not None:
                (Path(s.work_dir) / "load-error").write_text(str(e))
            raise
        self.frontend: Frontend[Any] = Frontend(gen, s.max_queue)  # handles: Triton's requests
        self.stopping = threading.Event()
        labels = {"model": config["name"]}
        # The families must outlive their metrics (Triton refuses to set a metric of a deleted family).
        self.families = [pb_utils.MetricFamily(name=name, description=text, kind=pb_utils.MetricFamily.GAUGE)
                         for name, text in (("refusion_requests_in_flight", "Requests admitted and not yet given their final response"),
                                            ("refusion_kv_slots_in_use", "KV-cache regions held by running requests"))]
        self.in_flight, self.kv_regions = (family.Metric(labels=labels) for family in self.families)
        self.watcher = threading.Thread(target=self._watch, name="refusion-cancel-watch", daemon=True)
        self.watcher.start()

    def execute(self, requests: list[Any]) -> None:
        for triton_request in requests:
            self._start(triton_request)
        return None  # decoupled: every response goes through the request's sender

    def finalize(self) -> None:
        """Triton unloads the model (the launcher drained it first: nothing should be in flight). What still
        runs is cancelled, then the scheduler stops. Responses sent from now on may not arrive, so nothing
        here waits on one for long."""
        self.frontend.close(_FINAL_WAIT_S)
        self.stopping.set()
        self.watcher.join(_FINAL_WAIT_S)
        self.frontend.gen.close()

    # -- one request ----------------------------------------------------------------------
    def _start(self, triton_request: Any) -> None:
        sender = triton_request.get_response_sender()
        try:
            tensors = {name: t.as_numpy() for name in INPUT_NAMES
                       if (t := pb_utils.get_input_tensor_by_name(triton_request, name)) is not None}
            job = read_request(tensors)
        except RefusionError as e:
            _send_error(sender, Final(error=str(e)))
            return
        refusal = self.frontend.admit()
        if refusal is not None:
            _send_error(sender, refusal)
            return
        threading.Thread(target=self._run, args=(job, triton_request, sender), daemon=True,
                         name="refusion-respond").start()

    def _run(self, job: ServeRequest, triton_request: Any, sender: Any) -> None:
        try:
            request = self.frontend.submit(job, triton_request)  # tokenizes: on this thread, not execute's
        except RefusionError as e:
            _send_error(sender, Final(error=str(e)))
            return
        self._update_metrics()

        def final(outcome: Final) -> None:
            # The final response frees Triton's request; the watcher must not poll it after that (Triton
            # crashes in is_cancelled), so the frontend sends it under the watcher's lock.
            if outcome.result is not None:
                response = _response(text="" if job.stream else outcome.result.text, result=outcome.result)
            else:
                response = _error(outcome)
            _send(sender, response, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

        self.frontend.respond(request, job.stream, lambda text: _send(sender, _response(text=text)), final)
        self._update_metrics()

    def _watch(self) -> None:
        """Cancel the requests whose client went away, and all of them once the drain's deadline passes;
        end this process when it must not live on."""
        while not self.stopping.wait(_WATCH_S):
            self._exit_if_orphaned()
            self._read_drain_deadline()
            self.frontend.cancel_gone(lambda triton_request: triton_request.is_cancelled())
            self._update_metrics()

    def _exit_if_orphaned(self) -> None:
        """tritonserver gone (this stub was re-parented) or the launcher gone (tritonserver then goes too:
        the launcher also asks the kernel to kill it, but only while the thread that started it lives); or
        the scheduler thread dead, so that no request could be answered. Exit at once: no one is left to
        answer, or (a dead scheduler) the launcher sees this process end and stops the server."""
        launcher_gone = self.launcher is not None and bool(readable([self.launcher], 0))
        if launcher_gone and os.getppid() == self.parent:
            os.kill(self.parent, signal.SIGKILL)
        if launcher_gone or os.getppid() != self.parent or not self.frontend.gen.status().alive:
            os._exit(1)

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


_CODES = {Status.INVALID_ARGUMENT: "INVALID_ARG", Status.RESOURCE_EXHAUSTED: "UNAVAILABLE",
          Status.UNAVAILABLE: "UNAVAILABLE", Status.INTERNAL: "INTERNAL"}


def _error(outcome: Final) -> Any:
    code = getattr(pb_utils.TritonError, _CODES[outcome.status])
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(outcome.coded(), code))


def _send_error(sender: Any, outcome: Final) -> None:
    _send(sender, _error(outcome), pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
