"""The serving frontend seam without any server: admission and the queue limit, the drain, cancellation of
requests whose client went away, answering to the end (pieces, result, the request's own error, a bug),
the status of each error, the metrics' values. A request holds its place from admission until its final
response, so nothing here waits on how fast the model decodes."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import Generator
from refusion.serve.frontend import Final, Frontend, ServeRequest, Status, decode
from tests.gate import ForwardGate

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


def _submit(frontend: Frontend, job: ServeRequest, handle: str):
    assert frontend.admit() is None
    return frontend.submit(job, handle)


def test_requests_past_the_limit_are_refused_until_one_has_its_final_response(gen):
    frontend: Frontend[str] = Frontend(gen, max_queue=1)
    assert frontend.limit == 2
    first = _submit(frontend, JOB, "a")
    assert frontend.admit() is None  # admitted (still tokenizing, say): it holds its place
    assert frontend.metrics().requests_in_flight == 2
    assert frontend.admit() == Final(error="the server holds 2 requests, its limit (1 running + 1 queued, "
                                           "--max-queue); retry later or add instances.",
                                     status=Status.RESOURCE_EXHAUSTED)
    second = frontend.submit(JOB, "b")
    pieces, finals = _answer(frontend, first, stream=True)
    assert frontend.admit() is None  # its place is free again
    third = frontend.submit(JOB, "c")
    assert len(finals) == 1 and finals[0].result is not None and not finals[0].error
    assert "".join(pieces) == finals[0].result.text  # streamed pieces add up to the answer
    for request in (second, third):
        _, finals = _answer(frontend, request, stream=False)
        assert finals[0].result is not None and finals[0].result.text == first.result().text
    assert frontend.metrics().requests_in_flight == 0


def test_bad_settings_raise_at_submit_and_nothing_is_held(gen):
    frontend: Frontend[str] = Frontend(gen, max_queue=0)
    assert frontend.admit() is None
    with pytest.raises(RefusionError, match="slot_threshold=2.0 is outside"):
        frontend.submit(ServeRequest("hi", settings={"slot_threshold": 2.0}), "a")
    assert frontend.admit() is None and frontend.metrics().requests_in_flight == 1  # the place was given back


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


def test_an_error_crosses_a_wire_of_messages_with_its_status():
    for status in Status:
        assert decode(Final(error="x: y", status=status).coded()) == (status, "x: y")
    assert decode("Stub process 'refusion_0_0' is not healthy.") == (None, "Stub process 'refusion_0_0' is not healthy.")
    assert decode("NOT_A_STATUS: z") == (None, "NOT_A_STATUS: z")
    assert [s.value for s in Status] == [400, 429, 503, 500]


def test_gone_clients_are_cancelled_and_a_drain_refuses_then_cancels_everything(gen):
    frontend: Frontend[str] = Frontend(gen, max_queue=4)
    kept, gone = _submit(frontend, JOB, "kept"), _submit(frontend, JOB, "gone")
    frontend.cancel_gone(lambda handle: handle == "gone")
    assert gone.cancelled and not kept.cancelled
    frontend.drain(time.time() + 3600)
    shutting = Final(error="the server is shutting down; send the request to another instance.",
                     status=Status.UNAVAILABLE)
    assert frontend.admit() == shutting
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
    request = _submit(frontend, JOB, "a")
    frontend.close(timeout_s=0)  # no responder here: returns at its timeout
    assert request.cancelled
    assert frontend.admit() is not None and frontend.admit().status is Status.UNAVAILABLE
    request.result()
    assert frontend.metrics().kv_regions_in_use == 0
    _answer(frontend, request, stream=False)
    assert frontend.metrics().requests_in_flight == 0


def test_answer_is_respond_for_asyncio_and_tells_on_end_once(gen):
    ended: list[tuple[str, Final]] = []
    frontend: Frontend[str] = Frontend(gen, max_queue=1, on_end=lambda request, handle, final: ended.append((handle, final)))

    async def answer(stream: bool) -> list:
        return [item async for item in frontend.answer(_submit(frontend, JOB, "whole"), stream)]

    *pieces, final = asyncio.run(answer(stream=True))
    assert final.result is not None and "".join(pieces) == final.result.text == gen.generate(
        JOB.prompt, chat=True, **JOB.settings).text
    assert asyncio.run(answer(stream=False)) == [ended[-1][1]] and len(ended) == 2
    assert [handle for handle, _ in ended] == ["whole", "whole"] and frontend.admit() is None


def test_an_answer_closed_before_its_end_cancels_and_gives_its_place_back_once_ended(gen):
    ended: list[Final] = []
    frontend: Frontend[str] = Frontend(gen, max_queue=0, on_end=lambda request, handle, final: ended.append(final))

    async def leave_early():
        with ForwardGate(gen.runner) as gate:
            request = _submit(frontend, JOB, "gone")
            answers = frontend.answer(request, stream=True)
            reading = asyncio.ensure_future(anext(answers))
            await asyncio.to_thread(gate.wait_held)  # its forward waits at the gate: no piece yet
            reading.cancel()  # the client went away
            with contextlib.suppress(asyncio.CancelledError):
                await reading
            assert request.cancelled and frontend.admit() is not None  # its place is held until it ends
            gate.open()
            await asyncio.gather(*frontend._releasing)
        return request

    request = asyncio.run(leave_early())
    assert request.result().finish_reason == "cancelled" and len(ended) == 1
    assert ended[0].result is request.result() and frontend.admit() is None
