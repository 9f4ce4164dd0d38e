"""A forward cut into chunks of at most N tokens, and the chunks' outputs put back together: chunked prefill.

A forward whose tokens write their KV right after its past and attend only to that past and the tokens fed
before them (a prefill, a ReFusion prefill with its first plan's masks) computes exactly what its chunks
compute in turn, each over the KV the chunks before it wrote: causal attention does not look ahead. So the
scheduler runs a long one as chunks (one a round, other requests' forwards between them) and its step
machine never knows. A forward a backend cannot run in one execution (a TensorRT prefill over a cached prefix,
which no profile holds whole) is cut the same way, to the chunks the backend states it runs (`cut`). Pure
functions over the Forward and its outputs; runtime/scheduler.py drives them (and the engines check, as it does).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from refusion.runtime.core.contract import GraphName
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.decode.steps import Forward, Outputs

# input_probs at a chunk's last token reads that token's own id, not the next chunk's first: not the unchunked
# forward's, so a chunked forward returns none (no strategy reads a prefill's).
UNCHUNKED_ONLY = ("input_probs",)


class Backend(Protocol):
    """What `cut` asks of a runner (runners/base.py's Runner states it)."""

    name: str

    def chunk_bound(self, graph: GraphName, seq: int, past: int, heads: int) -> int | None: ...


def chunkable(forward: Forward) -> bool:
    """Its tokens write their KV right after the past, none attends to a token fed after it, and its heads are in
    order (as merge puts them back)."""
    seq, past = forward.input_ids.shape[1], forward.past
    if forward.write_at != past or not (np.diff(forward.heads[0]) > 0).all():
        return False
    ahead = np.triu(np.ones((seq, seq), dtype=bool), 1)
    return not (forward.attention_mask[0, :, past:] & ahead).any()


def bounds(seq: int, bound: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk: as few as fit `bound`, as even as can be, the longer ones last (the last holds
    what a strategy's first forward adds at its end: ReFusion's plan masks, AR's head)."""
    count = -(-seq // bound)
    base, longer = divmod(seq, count)
    sizes = [base] * (count - longer) + [base + 1] * longer
    edges = np.cumsum([0, *sizes])
    return [(int(s), int(e)) for s, e in zip(edges[:-1], edges[1:])]


def split(forward: Forward, bound: int) -> list[Forward]:
    """`forward` (chunkable) as chunks of at most `bound` tokens, in order. A chunk keeps the heads that fall in it,
    and their rows of vocab_mask; one that holds none reads a head at its last token, which `merge` drops."""
    heads = forward.heads[0]
    assert (np.diff(heads) > 0).all(), "head positions in order"
    chunks = []
    for start, end in bounds(forward.input_ids.shape[1], bound):
        held = (heads >= start) & (heads < end)
        own = heads[held] - start
        masks = forward.vocab_mask[:, held] if forward.vocab_mask is not None and own.size else None
        chunks.append(Forward(forward.input_ids[:, start:end], forward.position_ids[:, start:end],
                              forward.attention_mask[:, start:end, : forward.past + end], forward.past + start,
                              forward.past + start,
                              (own if own.size else np.array([end - start - 1]))[None].astype(np.int64), masks,
                              kind=forward.kind, graph=forward.graph))
    return chunks


def cut(forward: Forward, bound: int | None, backend: Backend) -> list[Forward]:
    """`forward` as the chunks it runs as, in order: at most `bound` tokens each (None: any), and each one `backend`
    runs in one execution (its chunk_bound: None where it runs a forward whole, else the most tokens a chunk of it
    may feed; 0: none), a chunk it does not run whole cut again to that (a chunk over a past, on TensorRT engines
    built for whole prefills). Past prefill_chunk a forward that cannot be cut is refused; one the backend cannot
    run whole nor in chunks is left whole, for the backend to refuse naming its own limits."""
    seq = forward.input_ids.shape[1]
    most = backend.chunk_bound(forward.graph, seq, forward.past, forward.heads.shape[1])
    if most is None and (bound is None or seq <= bound):
        return [forward]
    limit = min(b for b in (bound, most) if b is not None)
    if seq <= limit:  # held whole by the backend's bound though not by its profiles' heads: the backend says why
        return [forward]
    if most is None and not chunkable(forward):
        raise RefusionError(f"a {forward.kind} forward of {seq} tokens exceeds prefill_chunk={bound} and cannot be "
                            "cut (only a prefill can); raise prefill_chunk to the request's block length.")
    if not (limit and chunkable(forward)):  # the backend refuses it whole, naming the limit and how to rebuild
        return [forward]
    return [chunk for piece in split(forward, limit) for chunk in cut(piece, None, backend)]


def merge(forward: Forward, chunks: list[Forward], outputs: list[Outputs]) -> Outputs:
    """The chunks' outputs as `forward`'s: each head's row from the chunk it fell in, in order (a chunk's stand-in
    head dropped); input_probs left out (UNCHUNKED_ONLY)."""
    heads = forward.heads[0]
    held = [int(((heads >= c.past - forward.past) & (heads < c.past - forward.past + c.input_ids.shape[1])).sum())
            for c in chunks]
    names = [name for name in outputs[-1] if name not in UNCHUNKED_ONLY]
    return {name: np.concatenate([out[name][:, :n] for out, n in zip(outputs, held) if n], axis=1) for name in names}
