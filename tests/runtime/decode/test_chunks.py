"""Chunked prefill's pure half (runtime/decode/chunks.py): which forwards may be cut, where, and the chunks'
outputs put back together; the exactness on a real graph is tests/runtime/test_chunked_prefill.py's."""

from __future__ import annotations

import numpy as np
import pytest

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.decode import masks
from refusion.runtime.decode.chunks import bounds, chunkable, cut, merge, split
from refusion.runtime.decode.steps import Forward


def _prefill(past: int, seq: int, heads: list[int]) -> Forward:
    ids = np.arange(100, 100 + seq)[None]
    return Forward(ids, np.arange(past, past + seq)[None], masks.causal_after(past, seq), past, past, np.array([heads]),
                   kind="prefill_plan", graph="infiller")


@pytest.mark.parametrize("seq, bound, sizes", [
    (10, 10, [10]), (10, 4, [3, 3, 4]), (33, 16, [11, 11, 11]), (34, 16, [11, 11, 12]), (1, 8, [1]),
])
def test_chunks_are_few_even_and_the_longer_last(seq, bound, sizes):
    assert [e - s for s, e in bounds(seq, bound)] == sizes
    assert bounds(seq, bound)[0][0] == 0 and bounds(seq, bound)[-1][1] == seq


def test_a_prefill_is_chunkable_and_an_infill_or_a_staged_write_is_not():
    assert chunkable(_prefill(5, 12, [11]))
    rows = masks.rows_over_prefix(5, 2, 4, 0, 2, 4)  # two rows that must not see each other: still none looks ahead
    infill = Forward(np.zeros((1, 8), np.int64), np.zeros((1, 8), np.int64), rows, 5, 5, np.arange(7)[None],
                     kind="infill_verify", graph="infiller")
    assert chunkable(infill)
    ahead = _prefill(5, 6, [5])
    ahead.attention_mask[0, 0, 5 + 3] = True  # token 0 sees token 3
    assert not chunkable(ahead)
    staged = Forward(*(_prefill(5, 6, [5]).input_ids,) * 2, masks.causal_after(5, 6), 5, 40, np.array([[5]]),
                     kind="infill_verify", graph="infiller")
    assert not chunkable(staged)


def test_each_chunk_feeds_its_tokens_over_the_kv_before_them():
    forward = _prefill(past=7, seq=20, heads=[12, 13, 19])
    chunks = split(forward, 8)
    assert [c.input_ids.shape[1] for c in chunks] == [6, 7, 7]
    assert [(c.past, c.write_at) for c in chunks] == [(7, 7), (13, 13), (20, 20)]
    assert chunks[0].heads[0].tolist() == [5]  # none of its own: a stand-in at its last token
    assert chunks[1].heads[0].tolist() == [12 - 6] and chunks[2].heads[0].tolist() == [13 - 13, 19 - 13]
    for chunk in chunks:  # its rows of the mask, over the past and everything fed before it
        start = chunk.past - forward.past
        n = chunk.input_ids.shape[1]
        np.testing.assert_array_equal(chunk.attention_mask[0], forward.attention_mask[0, start:start + n, :chunk.past + n])
        np.testing.assert_array_equal(chunk.position_ids[0], np.arange(chunk.past, chunk.past + n))


def test_merge_takes_each_heads_row_from_its_chunk_and_drops_stand_ins_and_input_probs():
    forward = _prefill(past=0, seq=9, heads=[2, 7, 8])
    chunks = split(forward, 4)  # [0, 3), [3, 6), [6, 9): heads 2 | stand-in 2 | 1, 2
    outputs = [{"argmax_ids": c.heads + 100 * i, "top_ids": np.repeat(c.heads[..., None], 3, axis=2),
                "input_probs": np.ones(c.heads.shape)} for i, c in enumerate(chunks)]
    merged = merge(forward, chunks, outputs)
    assert merged["argmax_ids"].tolist() == [[2, 201, 202]] and merged["top_ids"].shape == (1, 3, 3)
    assert "input_probs" not in merged


class _Engines:
    """A backend that runs forwards whole over no past up to `whole` tokens and, over a past, up to `block`."""

    name = "fake"

    def __init__(self, whole: int, block: int):
        self.whole, self.block = whole, block

    def chunk_bound(self, graph: str, seq: int, past: int, heads: int) -> int | None:
        most = self.whole if past == 0 else self.block
        return None if seq <= most else most


def test_cut_is_the_bound_and_the_backends_chunks_one_place():
    """The scheduler's one cut: whole where neither the bound nor the backend asks; to the bound; and where the
    backend runs a chunk over a past shorter than the bound (engines built for whole prefills), cut again to it."""
    prefill = _prefill(0, 40, [39])
    assert cut(prefill, None, _Engines(64, 16)) == [prefill]
    assert [(c.past, c.input_ids.shape[1]) for c in cut(prefill, 20, _Engines(64, 64))] == [(0, 20), (20, 20)]
    assert [(c.past, c.input_ids.shape[1]) for c in cut(prefill, 20, _Engines(64, 8))] == [
        (0, 20), (20, 6), (26, 7), (33, 7)]  # the second piece, over a past, in the backend's chunks
    over = _prefill(10, 40, [0, 39])
    chunks = cut(over, None, _Engines(64, 16))
    assert [(c.past, c.input_ids.shape[1]) for c in chunks] == [(10, 13), (23, 13), (36, 14)]
    outs = [{"argmax_ids": np.array([[c.past]] * 1).reshape(1, -1).repeat(c.heads.shape[1], 1)} for c in chunks]
    assert merge(over, chunks, outs)["argmax_ids"].tolist() == [[10, 36]]


def test_a_forward_past_the_bound_that_cannot_be_cut_is_refused_and_one_past_the_backend_is_left_to_it():
    ahead = _prefill(5, 30, [29])
    ahead.attention_mask[0, 0, 5 + 3] = True
    with pytest.raises(RefusionError, match="exceeds prefill_chunk=16 and cannot be cut"):
        cut(ahead, 16, _Engines(64, 64))
    # one the backend runs neither whole nor in chunks stays whole: the backend refuses it naming its own limits
    assert cut(ahead, None, _Engines(8, 8)) == [ahead]
    prefill = _prefill(5, 30, [29])
    assert cut(prefill, None, _Engines(0, 0)) == [prefill]
    assert cut(ahead, 64, _Engines(64, 64)) == [ahead]  # within both: whole, cut or not
