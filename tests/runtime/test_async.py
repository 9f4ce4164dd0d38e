"""The hooks for embedded loops: Request.events() and the asyncio forms (agenerate, astream, aevents), on the
embedded model. A request held in flight is held by its runner, released by the test (no sleeps)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import Generator

pytest.importorskip("onnxruntime")

PROMPT, SETTINGS = "count: 1 2 3 4 5 6 7", dict(mode="ar", max_tokens=24)


@pytest.fixture
def gen(tiny_export):
    with Generator.from_dir(tiny_export, backend="ort-cpu", threads=1) as g:
        yield g


def hold_after_first_forward(gen: Generator, monkeypatch) -> threading.Event:
    """The runner's second forward waits until the returned event is set."""
    release, calls, real = threading.Event(), [], gen.runner._run

    def held(*args):
        calls.append(1)
        if len(calls) == 2:
            assert release.wait(60), "the test never released the runner"
        return real(*args)

    monkeypatch.setattr(gen.runner, "_run", held)
    return release


def submitted(gen: Generator, monkeypatch) -> list:
    """Every Request the Generator's submit returns, in order."""
    requests, submit = [], gen.submit
    monkeypatch.setattr(gen, "submit", lambda *a, **k: requests.append(submit(*a, **k)) or requests[-1])
    return requests


def test_the_async_forms_give_what_the_sync_ones_give(gen):
    expected = gen.generate(PROMPT, chat=True, **SETTINGS)

    async def main():
        result = await gen.agenerate(PROMPT, chat=True, **SETTINGS)
        pieces = [piece async for piece in gen.astream(PROMPT, chat=True, **SETTINGS)]
        request = gen.submit(PROMPT, chat=True, **SETTINGS)
        commits = [commit async for commit in request.aevents()]
        return result, pieces, commits, await request.aresult()

    result, pieces, commits, again = asyncio.run(main())
    assert result.token_ids == again.token_ids == expected.token_ids and "".join(pieces) == expected.text
    assert commits == again.commits and [c.token_ids for c in gen.submit(PROMPT, chat=True, **SETTINGS).events()] \
        == [c.token_ids for c in commits]


def test_awaiting_a_result_wakes_the_event_loop_once_not_at_each_commit(gen, monkeypatch):
    release = hold_after_first_forward(gen, monkeypatch)

    async def main():
        loop, wakes, real = asyncio.get_running_loop(), [], asyncio.get_running_loop().call_soon_threadsafe
        monkeypatch.setattr(loop, "call_soon_threadsafe", lambda *a, **k: wakes.append(a) or real(*a, **k))
        request = gen.submit(PROMPT, chat=True, **SETTINGS)
        waiting = asyncio.create_task(request.aresult())
        await asyncio.sleep(0)  # the task has registered its listener before the runner goes on
        release.set()
        result = await waiting
        return request, result, len(wakes), await request.aresult()  # the second: already done, no wait

    request, result, wakes, again = asyncio.run(main())
    assert len(request.commits) >= 8 and wakes == 1 and again is result


def test_cancelling_the_task_cancels_the_request_and_the_loop_runs_on_meanwhile(gen, monkeypatch):
    requests = submitted(gen, monkeypatch)
    release = hold_after_first_forward(gen, monkeypatch)

    async def main():
        first = asyncio.Event()

        async def consume():
            async for _ in gen.astream(PROMPT, chat=True, **SETTINGS):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()  # the event loop ran while the request was held on the scheduler thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert requests[0].cancelled
        release.set()
        return await requests[0].aresult()

    result = asyncio.run(main())
    assert result.finish_reason == "cancelled" and gen.scheduler.regions_in_use == 0


def test_a_failed_request_raises_its_error_when_awaited(gen):
    async def main():
        context = gen.manifest.max_positions
        with pytest.raises(RefusionError, match=f"maximum context length is {context} tokens"):
            await gen.agenerate(prompt_ids=[5] * (context - 6), max_tokens=24, mode="ar")
        with pytest.raises(RefusionError, match="max_tokens=0 must be a positive integer"):
            [piece async for piece in gen.astream(PROMPT, max_tokens=0)]

    asyncio.run(main())
