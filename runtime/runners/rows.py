"""What a Runner takes: one request's forward as a row (`RowFeed`: its feed over its own KV region), and rows packed
into one batch's feed (`pack_rows`), each padded to the longest so no row sees another's."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from refusion.runtime.decode.steps import Feed, Forward


@dataclass(frozen=True)
class PackedRows:
    """Rows as one batch's feed: `past`, `seq` and the head count are the longest row's."""

    input_ids: np.ndarray  # [rows, seq] int64
    position_ids: np.ndarray  # [rows, seq] int64
    attention_mask: np.ndarray  # [rows, seq, past + seq] bool
    heads: np.ndarray  # [rows, heads] int64
    seq: int
    past: int
    vocab_mask: np.ndarray | None  # [rows, heads, mask bytes] uint8; None when no row has one


def pack_rows(rows: list[RowFeed]) -> PackedRows:
    """Each row padded to the longest: its ids and positions first, its mask over its own past
    (columns [0, row past)) and its own tokens (columns [past, past + row seq)). Padding is attended
    by no real token, so no row sees another's; a padding token attends to itself alone, so no mask
    row is all False (its softmax would be NaN once the mask bias is rounded to half precision, and
    the NaN would reach the row's real tokens through the padding's KV in the next layer). Head positions
    are padded with position 0, whose heads no row reads (each row's outputs are its first heads). Ids are padded
    with the row's last token, so its last position's input_probs reads its own token there as alone (the next
    token's probability, clamped to the last fed). Where a row has a vocab_mask, every row gets one a head: all
    ones for the rows without and for padding (a head with no token allowed would read NaN)."""
    batch = len(rows)
    seq, past = max(r.input_ids.shape[1] for r in rows), max(r.past for r in rows)
    ids = np.zeros((batch, seq), np.int64)
    pos = np.zeros((batch, seq), np.int64)
    mask = np.zeros((batch, seq, past + seq), bool)
    heads = np.zeros((batch, max(r.head_count for r in rows)), np.int64)
    pad = np.arange(seq)
    for b, r in enumerate(rows):
        s, p = r.input_ids.shape[1], r.past
        ids[b, :s], ids[b, s:], pos[b, :s] = r.input_ids[0], r.input_ids[0, -1], r.position_ids[0]
        mask[b, :s, :p] = r.attention_mask[0, :, :p]
        mask[b, :s, past : past + s] = r.attention_mask[0, :, p:]
        mask[b, pad[s:], past + pad[s:]] = True
        heads[b, : r.head_count] = r.heads_at[0]
    masked = [(b, r.vocab_mask) for b, r in enumerate(rows) if r.vocab_mask is not None]
    vocab_mask = None
    if masked:
        vocab_mask = np.full((batch, heads.shape[1], masked[0][1].shape[2]), 255, np.uint8)
        for b, rows_mask in masked:
            vocab_mask[b, : rows_mask.shape[1]] = rows_mask[0]
    return PackedRows(ids, pos, mask, heads, seq, past, vocab_mask)


@dataclass(frozen=True)
class RowFeed(Feed):
    """One request's forward in a batch: its feed over KV [0, past) of its region, its heads at `heads` ([1, n]
    indices into seq; None: every position), each allowed the tokens of its row of `vocab_mask` ([1, n, mask bytes]
    uint8; None: every token)."""

    region: int
    heads: np.ndarray | None = None
    vocab_mask: np.ndarray | None = None

    @staticmethod
    def of(forward: Forward, region: int) -> RowFeed:
        """A strategy's forward over the KV region its request holds (the scheduler's rows)."""
        return RowFeed(forward.input_ids, forward.position_ids, forward.attention_mask, forward.past, forward.write_at,
                       region, forward.heads, forward.vocab_mask)

    @property
    def heads_at(self) -> np.ndarray:
        """The head positions, [1, n] int64."""
        assert self.heads is not None  # Runner.run_batch fills them in (with_heads) before anything reads them
        return self.heads

    @property
    def head_count(self) -> int:
        return self.heads_at.shape[1]

    def with_heads(self) -> RowFeed:
        """This row with its head positions given: every position when None."""
        if self.heads is not None:
            return self
        return replace(self, heads=np.arange(self.input_ids.shape[1], dtype=np.int64)[None])

