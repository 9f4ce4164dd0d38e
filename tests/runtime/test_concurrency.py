"""Many requests at once on one Generator: threads, submit / cancel / timeouts, batched forwards.

Every greedy request must get exactly the tokens it gets alone (run directly on a runner,
no scheduler), whatever runs beside it: other settings, AR and ReFusion mixed, other prompt
lengths, early or no EOS, neighbours cancelled midway.

Work in flight is held by tests/gate.py's ForwardGate, never by a sleep or a long request; every
`timeout=` of a result() or join() only guards against a hang.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.generator import Generator
from refusion.runtime.runners.onnxruntime import OrtRunner
from tests.gate import ForwardGate
from tests.helpers import MIXED_SETTINGS, broken_request, chat_jobs, decode_alone

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
@pytest.fixture(scope="module")
def export(tiny_export) -> Path:
    return tiny_export


@pytest.fixture(scope="module")
def jobs(export) -> list[tuple[list[int], dict]]:
    """Chat prompts of several lengths, each with one of MIXED_SETTINGS."""
    return chat_jobs(export, 20, MIXED_SETTINGS)


@pytest.fixture(scope="module")
def alone(export, jobs) -> list[list[int]]:
    return decode_alone(export, jobs)


@pytest.mark.parametrize("max_requests, max_batch", [(1, 1), (6, 1), (20, 4), (20, 20)])
def test_concurrent_and_batched_requests_get_their_tokens_alone(export, jobs, alone, max_requests, max_batch):
    with Generator.from_dir(export, backend="ort-cpu", threads=1, max_requests=max_requests,
                            max_batch=max_batch) as gen:
        requests = [gen.submit(prompt_ids=ids, **settings) for ids, settings in jobs]
        results = [r.result(timeout=120) for r in requests]
        assert gen.scheduler.in_flight == 0
    assert [r.token_ids for r in results] == alone
    reasons = {r.finish_reason for r in results}
    assert reasons == {"eos", "length"}, reasons  # the mix really has both endings


def test_eight_threads_share_one_generator(export, jobs, alone):
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            for j in range(index, len(jobs), 8):
                ids, settings = jobs[j]
                results[j] = gen.generate(prompt_ids=ids, **settings).token_ids
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with Generator.from_dir(export, backend="ort-cpu", threads=1) as gen:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not errors
    assert [results[j] for j in range(len(jobs))] == alone


def test_cancel_midway_frees_the_slot_and_leaves_the_others_alone(export, jobs, alone):
    with Generator.from_dir(export, backend="ort-cpu", threads=1, max_requests=4, max_batch=4) as gen:
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
        assert settled == [t for t in _full(cancelled)][: len(settled)]
        assert [r.result(timeout=60).token_ids for r in others] == alone[1:6]
        assert gen.scheduler.in_flight == 0 and sorted(gen.scheduler._free_regions) == [0, 1, 2, 3]


def _full(result) -> list[int]:
    committed = {p: t for c in result.commits for p, t in zip(c.positions, c.token_ids)}
    start = len(result.prompt_ids)
    return [committed[p] for p in range(start, start + len(committed)) if p in committed]


def test_timeout_ends_with_what_settled(export, jobs):
    with Generator.from_dir(export, backend="ort-cpu", threads=1) as gen, ForwardGate(gen.runner) as gate:
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
def test_a_waiting_request_that_is_cancelled_or_expires_ends_without_waiting_its_turn(export, stop):
    """One KV region, held by a busy request; the waiting one ends at the scheduler's next round
    (its deadline measured on the real clock), while the busy one is still held mid-decode."""
    with Generator.from_dir(export, backend="ort-cpu", threads=1, max_requests=1, max_batch=1) as gen, \
            ForwardGate(gen.runner) as gate:
        busy = gen.submit("sort: 9 8 7 6 5 4 3 2 1", chat=True, gen_length=64, mode="ar")  # 18 forwards: 17 characters, EOS
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


def test_closing_a_stream_cancels_its_request(export, monkeypatch):
    with Generator.from_dir(export, backend="ort-cpu", threads=1) as gen, ForwardGate(gen.runner) as gate:
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


def test_iterating_a_request_gives_its_settled_text(export):
    with Generator.from_dir(export, backend="ort-cpu", threads=1) as gen:
        request = gen.submit("sort: 3 1 2", chat=True)
        text = "".join(request)
        assert request.done and text == request.result().text and request.result().finish_reason == "eos"


def test_a_failing_request_fails_alone(export, jobs, alone):
    with Generator.from_dir(export, backend="ort-cpu", threads=1, max_requests=4, max_batch=4) as gen:
        good = gen.submit(prompt_ids=jobs[1][0], **jobs[1][1])
        bad = broken_request(gen, jobs[2][0], RefusionError("request 2 broke in its second step"))
        with pytest.raises(RefusionError, match=r"request 2 broke in its second step"):
            bad.result(timeout=60)
        assert good.result(timeout=60).token_ids == alone[1]
        with pytest.raises(RefusionError, match=r"exceeds the model's 256 positions"):
            gen.submit(prompt_ids=list(range(1, 100)) * 3)
        with pytest.raises(RefusionError, match=r"timeout_s=0 must be a positive number"):
            gen.submit(prompt_ids=[5, 6], timeout_s=0)


def test_result_wait_and_closed_generator(export):
    gen = Generator.from_dir(export, backend="ort-cpu", threads=1)
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
def test_runner_options_checked(export, kwargs, match):
    with pytest.raises(RefusionError, match=match):
        Generator.from_dir(export, backend="ort-cpu", **kwargs)


def test_batched_rows_equal_single_rows_on_the_runner(export):
    """The runner alone: rows of different lengths and pasts packed into one call give each row's
    own outputs and present KV. Not bit for bit: onnxruntime's kernels sum a padded batch in another
    order (3e-7 seen), which could flip an exact near-tie; the token tests above show it does not."""
    from refusion.runtime.decode import masks
    from refusion.runtime.runners.rows import RowFeed

    manifest = ExportManifest.load(export)
    rng = np.random.default_rng(0)
    with OrtRunner(manifest, threads=1, max_requests=3, max_batch=3) as runner:
        feeds = []
        for region, (past, seq) in enumerate([(0, 7), (5, 3), (11, 1)]):
            runner.allocate_kv(32, region)
            if past:  # some real KV to read: a prefill of `past` tokens first
                runner.run("infiller", rng.integers(0, 100, (1, past)), np.arange(past)[None],
                           masks.causal_after(0, past), 0, 0, region)
            feeds.append(RowFeed(rng.integers(0, 100, (1, seq)), np.arange(past, past + seq)[None],
                                 masks.causal_after(past, seq), past, past, region))
        before = [runner.kv_to_host(0, 32, s) for s in range(3)]
        single = [runner.run_batch("infiller", [f])[0] for f in feeds]
        kv_single = [runner.kv_to_host(0, 32, s) for s in range(3)]
        for s in range(3):
            runner.kv_from_host(0, {name.replace("present", "past_key_values"): kv for name, kv in before[s].items()}, s)
        packed = runner.run_batch("infiller", feeds)
        for a, b in zip(single, packed):
            assert a.keys() == b.keys()
            for name in a:
                # Packed rows sum in another order: a log-probability is logit - logsumexp over logits that reach
                # ~30, so its float32 error scales with them, not with its own value (1.6e-5 seen at -0.33).
                np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=5e-5)
        for s in range(3):
            for name, kv in runner.kv_to_host(0, 32, s).items():
                np.testing.assert_allclose(kv_single[s][name], kv, rtol=0, atol=1e-5)


def test_stream_ends_with_the_results_text_across_a_gap(export):
    """Slots dropped after an EOS leave a gap in positions (upstream's reading joins what follows
    it in the result): the stream still ends with the result's text."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add: 75+72"}]  # a gap, on this model
    with Generator.from_dir(export, backend="ort-cpu", threads=1) as gen:
        result = gen.generate(messages=messages)
        positions = sorted(p for c in result.commits for p in c.positions)
        assert positions != list(range(positions[0], positions[0] + len(positions)))  # the case has a gap
        assert "".join(gen.stream(messages=messages)) == result.text


def test_a_scheduler_failure_fails_the_running_requests_instead_of_hanging(export, monkeypatch):
    from refusion.runtime.scheduler import Scheduler

    def broken(self):
        raise RuntimeError("scheduler bug")

    with Generator.from_dir(export, backend="ort-cpu", threads=1) as gen:
        monkeypatch.setattr(Scheduler, "_round", broken)
        request = gen.submit(prompt_ids=[5, 6, 7], gen_length=8, mode="ar")
        with pytest.raises(RuntimeError, match="scheduler bug"):
            request.result(timeout=10)
        monkeypatch.undo()
        assert gen.generate(prompt_ids=[5, 6, 7], gen_length=8, mode="ar").finish_reason in ("eos", "length")
