"""The scheduler on a model in numpy (tests/fakes.py's FakeRunner), without torch or onnxruntime: many requests at
once from threads, batched forwards, cancel, timeouts, stops, failures, a closed Generator.

Every greedy request must get exactly the tokens it gets alone, whatever runs beside it: the fake's outputs follow
from exactly the tokens each head attends to, read back from its own KV region, so a request fed another's past or
a stale one decodes other tokens. Work in flight is held by tests/gate.py's ForwardGate, never by a sleep; every
`timeout=` of a result() or join() only guards against a hang. tests/runtime/test_concurrency.py runs the same mix
on the embedded model, whose packed forwards are real.
"""

from __future__ import annotations

import threading
import time

import pytest

from refusion.models import EMBEDDED_MODEL
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.generator import Generator
from refusion.runtime.prefix_cache import DEFAULT_MB
from refusion.runtime.runners import runner_options
from refusion.runtime.scheduler import Scheduler
from refusion.runtime.tokenizer import Tokenizer
from refusion.tools.tasks import held_out
from tests.fakes import FakeRunner, fake_manifest
from tests.gate import ForwardGate
from tests.helpers import MIXED_SETTINGS, broken_request, decode_alone_on


@pytest.fixture(scope="module")
def manifest() -> ExportManifest:
    return fake_manifest(EMBEDDED_MODEL)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(EMBEDDED_MODEL)


def fake_generator(manifest: ExportManifest, tokenizer: Tokenizer | None, max_requests: int = 4,
                   max_batch: int = 4, prefix_cache_mb: float = DEFAULT_MB) -> Generator:
    runner = FakeRunner(manifest, max_requests, max_batch)
    runner.activate()
    return Generator(manifest, runner, tokenizer, prefix_cache_mb)


@pytest.fixture
def gen(manifest, tokenizer):
    with fake_generator(manifest, tokenizer) as g:
        yield g


@pytest.fixture(scope="module")
def jobs(manifest, tokenizer) -> list[tuple[list[int], dict]]:
    """The first 20 held-out prompts, chat-templated, each with one of MIXED_SETTINGS in turn."""
    with fake_generator(manifest, tokenizer) as g:
        prompts = [g.prompt_ids(ex.prompt, chat=True) for ex in held_out(20)]
    return [(ids, MIXED_SETTINGS[i % len(MIXED_SETTINGS)]) for i, ids in enumerate(prompts)]


@pytest.fixture(scope="module")
def alone(manifest, jobs) -> list[list[int]]:
    with FakeRunner(manifest, max_requests=1, max_batch=1) as runner:
        return decode_alone_on(runner, manifest, jobs)


@pytest.mark.parametrize("max_requests, max_batch", [(1, 1), (6, 1), (20, 4), (20, 20)])
def test_concurrent_and_batched_requests_get_their_tokens_alone(manifest, jobs, alone, max_requests, max_batch):
    with fake_generator(manifest, None, max_requests, max_batch) as gen:
        requests = [gen.submit(prompt_ids=ids, **settings) for ids, settings in jobs]
        results = [r.result(timeout=60) for r in requests]
        assert gen.scheduler.in_flight == 0
        stats = gen.runner.stats.total
    assert [r.token_ids for r in results] == alone
    assert {r.finish_reason for r in results} == {"eos", "length"}  # the mix really has both endings
    assert stats.rows > stats.forwards if max_batch > 1 else stats.rows == stats.forwards  # batches really ran


def test_eight_threads_share_one_generator(gen, jobs, alone):
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            for j in range(index, len(jobs), 8):
                ids, settings = jobs[j]
                results[j] = gen.generate(prompt_ids=ids, **settings).token_ids
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert [results[j] for j in range(len(jobs))] == alone


def test_cancel_midway_frees_the_region_and_leaves_the_others_alone(gen, jobs, alone):
    with ForwardGate(gen.runner) as gate:  # nothing runs until every request is in
        victim = gen.submit(prompt_ids=jobs[0][0], gen_length=64, mode="ar")
        others = [gen.submit(prompt_ids=ids, **settings) for ids, settings in jobs[1:6]]
        gate.hold_when(lambda: victim.commits)
        gate.wait_held()  # it has started (one commit is in) and is held before its next forward
        first = victim.commits[0]
        victim.cancel()
    cancelled = victim.result(timeout=60)
    assert victim.done and cancelled.finish_reason == "cancelled"
    assert cancelled.commits[0] == first and len(cancelled.token_ids) < 64
    settled = cancelled.token_ids  # the contiguous run from the prompt's end, nothing beyond
    assert settled == _full(cancelled)[: len(settled)]
    assert [r.result(timeout=60).token_ids for r in others] == alone[1:6]
    assert gen.scheduler.in_flight == 0 and sorted(gen.scheduler._free_regions) == [0, 1, 2, 3]


def _full(result) -> list[int]:
    committed = {p: t for c in result.commits for p, t in zip(c.positions, c.token_ids)}
    start = len(result.prompt_ids)
    return [committed[p] for p in range(start, start + len(committed)) if p in committed]


def test_timeout_ends_with_what_settled(gen, jobs):
    with ForwardGate(gen.runner) as gate:
        gate.hold_when(lambda: gate.passed >= 3)
        request = gen.submit(prompt_ids=jobs[0][0], gen_length=64, slot_size=4, serial_num_blocks=4,
                             slot_threshold=0.0, token_threshold=1.0, timeout_s=600)
        gate.wait_held()  # three forwards done, the fourth held
        request.deadline = time.monotonic()  # its deadline passes while the fourth forward runs
        gate.open()
        res = request.result(timeout=60)
    assert res.finish_reason == "timeout"
    assert res.stats.forward_count == 4  # none after the deadline
    assert res.text == gen.tokenizer.decode(res.token_ids)


@pytest.mark.parametrize("stop", ["cancel", "timeout"])
def test_a_waiting_request_that_is_cancelled_or_expires_ends_without_waiting_its_turn(manifest, tokenizer, stop):
    """One KV region, held by a busy request; the waiting one ends at the scheduler's next round
    (its deadline measured on the real clock), while the busy one is still held mid-decode."""
    with fake_generator(manifest, tokenizer, max_requests=1, max_batch=1) as gen, ForwardGate(gen.runner) as gate:
        busy = gen.submit(prompt_ids=[5, 6, 7], gen_length=64, mode="ar")
        gate.wait_held()  # busy's prefill, held
        waiting = gen.submit(prompt_ids=[5, 6, 7], gen_length=64, mode="ar", timeout_s=0.05)
        if stop == "cancel":
            waiting.cancel()
        else:
            time.sleep(max(0.0, waiting.deadline - time.monotonic()) + 0.01)  # to the deadline, not a guess
            assert time.monotonic() > waiting.deadline
        gate.allow(1)  # one more forward of busy's; the round after it admits (and ends) the waiting one
        result = waiting.result(timeout=60)
        assert result.finish_reason == {"cancel": "cancelled", "timeout": "timeout"}[stop]
        assert result.stats.forward_count == 0 and result.token_ids == []
        gate.wait_held()
        assert not busy.done and gate.passed == 1  # it did not wait for the busy one
        busy.cancel()


def test_closing_a_stream_cancels_its_request(gen, monkeypatch):
    with ForwardGate(gen.runner) as gate:
        requests = []
        submit = gen.submit
        monkeypatch.setattr(gen, "submit", lambda *args, **kw: requests.append(submit(*args, **kw)) or requests[-1])
        gate.hold_when(lambda: requests and requests[0].commits)
        stream = gen.stream("sort: 9 8 7 6 5 4 3 2 1", chat=True, gen_length=64, mode="ar")
        next(stream)  # its first piece (AR commits in order); the next forward is held
        gate.wait_held()
        stream.close()
        gate.open()
        assert requests[0].result(timeout=60).finish_reason == "cancelled"
        assert gen.scheduler.in_flight == 0


def test_iterating_a_request_gives_its_settled_text(gen):
    request = gen.submit("sort: 3 1 2", chat=True)
    text = "".join(request)
    assert request.done and text == request.result().text and request.result().finish_reason == "eos"


def test_a_failing_request_fails_alone(gen, jobs, alone):
    good = gen.submit(prompt_ids=jobs[1][0], **jobs[1][1])
    bad = broken_request(gen, jobs[2][0], RefusionError("request 2 broke in its second step"))
    with pytest.raises(RefusionError, match=r"request 2 broke in its second step"):
        bad.result(timeout=60)
    assert good.result(timeout=60).token_ids == alone[1]
    context = gen.manifest.max_positions
    with pytest.raises(RefusionError, match=rf"maximum context length is {context} tokens"):
        gen.submit(prompt_ids=list(range(1, 100)) * (context // 99 + 1))
    with pytest.raises(RefusionError, match=r"timeout_s=0 must be a positive number"):
        gen.submit(prompt_ids=[5, 6], timeout_s=0)


def test_result_wait_and_closed_generator(manifest, tokenizer):
    gen = fake_generator(manifest, tokenizer)
    with ForwardGate(gen.runner) as gate:  # the request cannot end while the test waits for it
        request = gen.submit(prompt_ids=[5, 6, 7], gen_length=64, slot_size=4, serial_num_blocks=4,
                             slot_threshold=0.0, token_threshold=1.0)
        with pytest.raises(RefusionError, match=r"has no result after 0.01 s; it goes on"):
            request.result(timeout=0.01)
        gate.wait_held()
        gate.close_generator(gen)  # cancels what is in flight
    assert request.result(timeout=10).finish_reason == "cancelled"
    with pytest.raises(RefusionError, match=r"this Generator is closed"):
        gen.submit(prompt_ids=[5, 6, 7])


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_requests=0), r"max_requests=0 must be a positive integer"),
    (dict(max_requests=2, max_batch=4), r"max_batch=4 exceeds max_requests=2"),
])
def test_runner_options_checked(manifest, kwargs, match):
    with pytest.raises(RefusionError, match=match):
        runner_options(manifest, "ort-cpu", **kwargs)


def test_a_scheduler_failure_fails_the_running_requests_instead_of_hanging(gen, monkeypatch):
    def broken(self):
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(Scheduler, "_round", broken)
    request = gen.submit(prompt_ids=[5, 6, 7], gen_length=8, mode="ar")
    with pytest.raises(RuntimeError, match="scheduler bug"):
        request.result(timeout=10)
    monkeypatch.undo()
    assert gen.generate(prompt_ids=[5, 6, 7], gen_length=8, mode="ar").finish_reason in ("eos", "length")


def test_status_is_what_frontends_read_of_a_generator(manifest, tokenizer, jobs):
    """Generator.status(): alive, the requests it runs at once, those in flight (running or waiting), the KV
    regions held, the prefix cache's figures; frontends read this one value."""
    with fake_generator(manifest, tokenizer, max_requests=2, max_batch=2) as gen:
        idle = gen.status()
        assert (idle.alive, idle.max_requests, idle.in_flight, idle.regions_in_use) == (True, 2, 0, 0)
        assert idle.prefix_cache is not None and (idle.prefix_cache.blocks, idle.prefix_cache.hit_tokens) == (0, 0)
        with ForwardGate(gen.runner) as gate:
            requests = [gen.submit(prompt_ids=ids, **settings) for ids, settings in jobs[:3]]
            gate.wait_held()  # the first forward, held: the second request may not be admitted yet
            gate.allow(1)
            gate.wait_held()  # a round later: two admitted into the two regions, the third waiting
            busy = gen.status()
            assert (busy.in_flight, busy.regions_in_use) == (3, 2)
        for r in requests:
            r.result(timeout=60)
        gen.generate(prompt_ids=jobs[0][0], **jobs[0][1])  # its prompt again: its prefix from the cache
        done = gen.status()
        assert (done.in_flight, done.regions_in_use) == (0, 0)
        assert done.prefix_cache is not None and done.prefix_cache.blocks > 0 and done.prefix_cache.hit_tokens > 0
        assert done.prefix_cache.bytes == gen.prefix_cache.reserved_bytes
    assert not gen.status().alive
    with fake_generator(manifest, tokenizer, prefix_cache_mb=0) as off:
        assert off.status().prefix_cache is None


# -- stops --------------------------------------------------------------------------------------------------------
SETTINGS = MIXED_SETTINGS[0]  # gen_length 64 in 4 blocks of 4-token slots (AR reads gen_length alone)


@pytest.mark.parametrize("mode", ["refusion", "ar"])
def test_a_stop_string_ends_the_answer_before_it_and_frees_the_request_at_once(gen, jobs, mode):
    ids = jobs[12][0]  # a long answer in both modes
    whole = gen.generate(prompt_ids=ids, mode=mode, **SETTINGS)
    stop = whole.text[10:12]  # two characters of the middle of its answer (a character a token here)
    res = gen.generate(prompt_ids=ids, mode=mode, stop=[stop], **SETTINGS)
    assert res.finish_reason == "stop" and res.text == whole.text[: whole.text.index(stop)]
    assert res.stats.forward_count < whole.stats.forward_count  # nothing decoded past the commit that held it
    assert gen.scheduler.regions_in_use == 0


@pytest.mark.parametrize("mode", ["refusion", "ar"])
def test_a_stop_token_ends_the_answer_there(gen, jobs, mode):
    ids = jobs[12][0]  # a long answer in both modes
    whole = gen.generate(prompt_ids=ids, mode=mode, **SETTINGS)
    at = 5
    token = whole.token_ids[at]
    assert token not in whole.token_ids[:at]
    res = gen.generate(prompt_ids=ids, mode=mode, stop_token_ids=[token], **SETTINGS)
    assert res.finish_reason == "stop" and res.token_ids == whole.token_ids[:at]
