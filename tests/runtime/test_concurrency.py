"""Many requests at once on the embedded model, whose packed forwards are real onnxruntime ones.

Every greedy request must get exactly the tokens it gets alone, whatever runs beside it: other settings, AR and
ReFusion mixed, other prompt lengths, early or no EOS. The scheduler's own behaviour (threads, cancel, timeouts,
stops, failures) is tested without a model in tests/runtime/test_scheduler.py; here what only real forwards show:
packed rows giving each row's own outputs, and the text of a result with a gap in its positions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.generator import Generator
from refusion.runtime.runners.onnxruntime import OrtRunner
from tests.helpers import MIXED_SETTINGS, chat_jobs, decode_alone

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


@pytest.mark.parametrize("max_requests, max_batch", [(20, 4), (20, 20)])  # packed forwards
def test_concurrent_and_batched_requests_get_their_tokens_alone(export, jobs, alone, max_requests, max_batch):
    with Generator.from_dir(export, backend="ort-cpu", threads=1, max_requests=max_requests,
                            max_batch=max_batch) as gen:
        requests = [gen.submit(prompt_ids=ids, **settings) for ids, settings in jobs]
        results = [r.result(timeout=120) for r in requests]
        assert gen.scheduler.in_flight == 0
    assert [r.token_ids for r in results] == alone
    reasons = {r.finish_reason for r in results}
    assert reasons == {"eos", "length"}, reasons  # the mix really has both endings


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
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add: 19+80"}]  # a gap, on this model
    with Generator.from_dir(export, backend="ort-cpu", threads=1) as gen:
        result = gen.generate(messages=messages)
        positions = sorted(p for c in result.commits for p in c.positions)
        assert positions != list(range(positions[0], positions[0] + len(positions)))  # the case has a gap
        assert "".join(gen.stream(messages=messages)) == result.text
