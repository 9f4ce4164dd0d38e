"""Attention masks for the decode loop's forwards: bool [1, seq, past + seq], True = may attend."""

from __future__ import annotations

import numpy as np


def causal_after(past: int, seq: int) -> np.ndarray:
    """New tokens see all of the past and the new tokens before them (plan, verify, prefill)."""
    mask = np.ones((1, seq, past + seq), dtype=bool)
    if seq > 1:  # one token (an AR step) sees everything: no triangle to cut
        mask[0, :, past:] = np.tri(seq, dtype=bool)
    return mask


def rows_over_prefix(prefix: int, scratch_rows: int, row_stride: int, private: int, rows: int, window: int) -> np.ndarray:
    """Parallel infill: `rows` slot rows of `window` new tokens each, over one shared prefix.

    The past is the committed prefix followed by `scratch_rows` private regions of
    `row_stride` tokens (row r's own earlier tokens at prefix + r*row_stride, `private` of
    them valid) when `private` > 0; with `private` == 0 the past is the prefix alone.
    A row sees the prefix, its own private tokens, and its own window causally; never a
    sibling row. This is how n slots share one copy of the prefix's KV.
    """
    past = prefix + (scratch_rows * row_stride if private else 0)
    seq = rows * window
    mask = np.zeros((1, seq, past + seq), dtype=bool)
    mask[0, :, :prefix] = True
    causal = np.tri(window, dtype=bool)
    for r in range(rows):
        new = slice(r * window, (r + 1) * window)
        if private:
            own = prefix + r * row_stride
            mask[0, new, own : own + private] = True
        mask[0, new, past + r * window : past + (r + 1) * window] = causal
    return mask
