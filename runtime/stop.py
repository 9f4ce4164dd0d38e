"""Stop sequences in growing text, as pure functions: where the first one begins, and how much of the end
of the text could still become the start of one (so a stream holds it back)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def first_stop(text: str, stops: tuple[str, ...], start: int = 0) -> tuple[int, int] | None:
    """(where, length) of the earliest stop sequence found in text[start:], the shortest at a tie; None if none."""
    found = [(at, len(s)) for s in stops if (at := text.find(s, start)) >= 0]
    return min(found) if found else None


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Characters at the end of `text` that begin some stop sequence (without completing it): the longest
    such suffix, 0 when none."""
    longest = max((len(s) for s in stops), default=1) - 1
    for n in range(min(longest, len(text)), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0


def covering(tokens: Sequence[int], text: str, detokenize: Callable[[list[int]], str]) -> int:
    """The fewest leading `tokens` whose text begins with `text` (all of them if none do): the tokens an answer
    cut before a stop sequence returns. A longer prefix of tokens decodes to a longer prefix of text, so the
    count is found by bisection, in O(log n) decodes."""
    lo, hi = 0, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if detokenize(list(tokens[:mid])).startswith(text):
            hi = mid
        else:
            lo = mid + 1
    return lo
