"""The LLaDA-style baseline strategy (decode/llada.py), driven by the scheduler on a peaky tiny export."""

from __future__ import annotations

import numpy as np
import pytest

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.decode import profile_needs
from refusion.runtime.decode.llada import FORWARD_KIND, DiffusionParams, num_transfer_tokens
from refusion.runtime.decode.steps import Tokens
from refusion.runtime.runners.onnxruntime import OrtRunner
from tests.helpers import MASK_ID, decode_on

pytest.importorskip("onnxruntime")

GEN = 16
PROMPT = [5, 17, 42, 9]


@pytest.fixture(scope="module")
def runner(peaky_export):
    with OrtRunner(ExportManifest.load(peaky_export), threads=1) as r:
        yield r


@pytest.fixture
def calls(runner):
    """Every forward the runner runs: (graph, seq, past, write_at, positions, ids, the argmax probabilities at its
    heads, the head positions)."""
    seen = []
    inner = runner._run

    def run(graph, rows):
        outs = inner(graph, rows)
        for r, out in zip(rows, outs):
            seen.append((graph, r.input_ids.shape[1], r.past, r.write_at, r.position_ids[0].tolist(),
                         r.input_ids[0].tolist(), out["argmax_probs"][0], r.heads_at[0].tolist()))
        return outs

    runner._run = run
    yield seen
    del runner._run


def _decode(runner, eos: int, **params):
    return decode_on(runner, Tokens(PROMPT, MASK_ID, eos), DiffusionParams(gen_length=GEN, **params))


def test_num_transfer_tokens_is_llada_schedule():
    assert num_transfer_tokens(32, 32) == [1] * 32
    assert num_transfer_tokens(10, 4) == [3, 3, 2, 2]
    assert sum(num_transfer_tokens(7, 3)) == 7


@pytest.mark.parametrize("steps, block", [(16, 8), (8, 8), (4, 16)])
def test_diffusion_fills_every_position_and_counts_every_forward(runner, calls, steps, block):
    res = _decode(runner, -1, steps=steps, block_length=block)
    assert len(res.token_ids) == GEN and res.stats.mode == "llada"
    assert res.stats.forward_count == steps == len(calls) == res.stats.forwards[FORWARD_KIND]
    # every step: the planner (no KV kept) over prompt + the whole span, no past, positions in order
    assert all(c[:5] == ("planner", len(PROMPT) + GEN, 0, None, list(range(len(PROMPT) + GEN))) for c in calls)
    assert all(c[7] == list(range(len(PROMPT), len(PROMPT) + GEN)) for c in calls)  # the prompt's heads never run
    assert res.stats.tpf == pytest.approx(GEN / steps)
    assert res.stats.tokens == GEN  # no EOS (-1): every position counts
    assert 0 < res.stats.runner_seconds <= res.stats.wall_seconds


def test_diffusion_commits_the_most_confident_masks_in_block_order(runner, calls):
    """One token a step, blocks left to right, each time the most confident mask of the current block."""
    res = _decode(runner, -1, steps=GEN, block_length=8)
    feeds = [np.array(c[5][len(PROMPT):]) for c in calls] + [np.array(res.token_ids)]
    for t in range(GEN):
        masked = feeds[t] == MASK_ID
        filled = np.flatnonzero(masked & (feeds[t + 1] != MASK_ID))
        assert masked.sum() == GEN - t and len(filled) == 1  # exactly one mask filled per step
        block = slice(0, 8) if t < 8 else slice(8, 16)
        candidates = np.flatnonzero(masked[block]) + block.start
        assert filled[0] == candidates[np.argmax(calls[t][6][candidates])]


def test_diffusion_early_exit_keeps_the_answer_and_saves_forwards(runner):
    eos = _decode(runner, -1, steps=GEN, block_length=8).token_ids[3]  # a token committed early on: used as EOS
    full = _decode(runner, eos, steps=GEN, block_length=8)
    fast = _decode(runner, eos, steps=GEN, block_length=8, early_exit=True)
    assert full.finish_reason == "eos" and eos not in full.token_ids  # the answer: the tokens before its EOS
    assert fast.token_ids == full.token_ids and full.stats.tokens == len(full.token_ids) + 1 <= 4
    assert fast.stats.tokens == full.stats.tokens and fast.finish_reason == "eos"
    assert fast.stats.forward_count < full.stats.forward_count == GEN


def test_diffusion_clean_first_feeds_committed_tokens_before_masks(runner, calls):
    res = _decode(runner, -1, steps=8, block_length=16, order="clean_first")
    assert len(res.token_ids) == GEN and res.stats.forward_count == 8
    span = list(range(len(PROMPT), len(PROMPT) + GEN))
    for t, call in enumerate(calls):  # step t: 2t committed tokens first, then the GEN - 2t masks
        pos, ids = call[4][len(PROMPT):], call[5][len(PROMPT):]
        c = 2 * t
        assert sorted(pos) == span and pos[:c] == sorted(pos[:c]) and pos[c:] == sorted(pos[c:])
        assert ids[c:] == [MASK_ID] * (GEN - c)
    final = dict(zip(calls[-1][4][len(PROMPT):], calls[-1][5][len(PROMPT):]))
    assert all(final[p] == res.token_ids[p - len(PROMPT)] for p in calls[-1][4][len(PROMPT):][:14])


@pytest.mark.parametrize("params, match", [
    (dict(gen_length=16, steps=16, block_length=5), "multiple of block_length"),
    (dict(gen_length=16, steps=3, block_length=8), "shared equally"),
    (dict(gen_length=16, steps=32, block_length=16), "at least one token"),
    (dict(gen_length=16, steps=16, block_length=16, order="random"), "order="),
])
def test_diffusion_bad_params(params, match):
    with pytest.raises(RefusionError, match=match):
        DiffusionParams(**params)


def test_no_tensorrt_profile_takes_its_forwards(peaky_export, fakes, tmp_path):
    from refusion.runtime.runners.tensorrt import TensorRTRunner
    from tests.helpers import fake_engines

    with TensorRTRunner.from_dir(fake_engines(peaky_export, tmp_path / "engines")) as trt:
        with pytest.raises(RefusionError, match="the llada strategy's forwards fit none of the TensorRT engine's"):
            trt.check_request(len(PROMPT), profile_needs(DiffusionParams(gen_length=GEN, steps=GEN, block_length=8)),
                              "llada")
