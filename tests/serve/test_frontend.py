"""The serving frontend seam without any server: admission and the queue limit, the drain, cancellation of
requests whose client went away, answering to the end (pieces, result, the request's own error, a bug),
the metrics' values. A request is live from submit until its final response, so nothing here waits on
how fast the model decodes."""

from __future__ import annotations

import time

import pytest

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import Generator
from refusion.serve.frontend import Final, Frontend, ServeRequest

pytest.importorskip("onnxruntime")

JOB = ServeRequest("sort: 3 1 2", chat=True, settings={"gen_length": 16, "mode": "ar"})


@pytest.fixture(scope="module")
def gen(tiny_export):
    with Generator.from_dir(tiny_export, backend="ort-cpu", threads=1, max_requests=1, max_batch=1) as g:
        yield g


def _answer(frontend: Frontend, request, stream: bool) -> tuple[list[str], list[Final]]:
    pieces: list[str] = []
    finals: list[Final] = []
    frontend.respond(request, stream, pieces.append, finals.append)
    return pieces, finals


def test_requests_past_the_limit_are_refused_until_one_has_its_final_response(gen):
    frontend: Frontend[str] = Frontend(gen, max_queue=1)
    assert frontend.limit == 2 and frontend.refusal() is None
    first = frontend.submit(JOB, "a")
    second = frontend.submit(JOB, "b")
    assert frontend.refusal() == ("the server holds 2 requests, its limit (1 running + 1 queued, --max-queue); "
                                  "retry later or add instances.")
    pieces, finals = _answer(frontend, first, stream=True)
    assert frontend.refusal() is None
    assert len(finals) == 1 and finals[0].result is not None and not finals[0].error
    assert "".join(pieces) == finals[0].result.text  # streamed pieces add up to the answer
    _, finals = _answer(frontend, second, stream=False)
    assert finals[0].result is not None and finals[0].result.text == first.result().text


def test_bad_settings_raise_at_submit_and_nothing_is_held(gen):
    frontend: Frontend[str] = Frontend(gen, max_queue=0)
    with pytest.raises(RefusionError, match="slot_threshold=2.0 is outside"):
        frontend.submit(ServeRequest("hi", settings={"slot_threshold": 2.0}), "a")
    assert frontend.refusal() is None


def test_a_failed_request_gets_its_error_and_a_bug_an_internal_one(gen):
    frontend: Frontend[str] = Frontend(gen, max_queue=0)

    class Failing:
        def __init__(self, error: BaseException):
            self.error = error

        def result(self):
            raise self.error

    _, finals = _answer(frontend, Failing(RefusionError("max_tokens=9999 exceeds the engines'")), stream=False)
    assert finals == [Final(error="max_tokens=9999 exceeds the engines'")]
    _, finals = _answer(frontend, Failing(KeyError("oops")), stream=False)
    assert finals[0].internal and finals[0].error == "internal error: KeyError: 'oops'"


def test_gone_clients_are_cancelled_and_a_drain_refuses_then_cancels_everything(gen):
    frontend: Frontend[str] = Frontend(gen, max_queue=4)
    kept, gone = frontend.submit(JOB, "kept"), frontend.submit(JOB, "gone")
    frontend.cancel_gone(lambda handle: handle == "gone")
    assert gone.cancelled and not kept.cancelled
    frontend.drain(time.time() + 3600)
    assert frontend.refusal() == "the server is shutting down; send the request to another instance."
    frontend.cancel_gone(lambda handle: False)
    assert not kept.cancelled  # before the deadline, requests run on
    frontend.drain(time.time() - 1)  # the first deadline stays
    assert frontend.drain_deadline is not None and frontend.drain_deadline > time.time()
    frontend.drain_deadline = time.time() - 1
    frontend.cancel_gone(lambda handle: False)
    assert kept.cancelled
    for request in (kept, gone):
        _, finals = _answer(frontend, request, stream=False)
        assert finals[0].result is not None and finals[0].result.finish_reason in ("cancelled", "eos", "length")


def test_close_cancels_what_is_live_and_refuses_new_requests(gen):
    frontend: Frontend[str] = Frontend(gen, max_queue=4)
    request = frontend.submit(JOB, "a")
    frontend.close(timeout_s=0)  # no responder here: returns at its timeout
    assert request.cancelled
    assert frontend.refusal() == "the server is shutting down; send the request to another instance."
    request.result()
    metrics = frontend.metrics()
    assert metrics.requests_in_flight == 0 and metrics.kv_regions_in_use == 0
