"""The answer's text rule, as a request reads it: text is shown once every earlier position is committed, up to
the first EOS, never half a character, and ends at the first stop sequence or stop token (neither shown); a
stream holds back what could still begin a stop. `SettledText` applies it to commits as they come; the pure
functions below find a stop in growing text, what to hold back, and how many tokens hold a given text."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from refusion.runtime.decode.steps import Commit

Detokenize = Callable[[list[int]], str]


class SettledText:
    """The text of the settled prefix: slots commit out of order; text is shown only once every
    earlier position is committed, up to the first EOS, and never ends in half a character. With stop
    sequences it ends at the first one (`stop` strings in the text, or a token of `stop_ids`), which is not
    shown, and it holds back text that could still turn out to begin one. `detokenize` None: tokens only.
    `settled` holds the answer's tokens: never the EOS or a stop token, and once a stop string ended it, the
    fewest tokens whose text covers `stop_text` (a token the stop begins inside stays: part of it is shown)."""

    def __init__(self, prompt_length: int, eos_id: int, detokenize: Detokenize | None,
                 stop: tuple[str, ...] = (), stop_ids: tuple[int, ...] = ()):
        self.next, self.eos_id, self.detokenize = prompt_length, eos_id, detokenize
        self.stop, self.stop_ids = stop, frozenset(stop_ids)
        self.settled: list[int] = []
        self.pending: dict[int, int] = {}
        self.shown = ""
        self.ended = False  # at an EOS or a stop: nothing after it is read
        self.stopped = False  # ended by a stop sequence or a stop token
        self.stop_text = ""  # stopped: the text before the stop sequence
        self.end_token: int | None = None  # the EOS or stop token that ended it (None: a stop string, or not ended)
        self._scanned = 0  # stop strings were looked for in the text before this index

    def add(self, commit: Commit) -> str:
        """The new piece of text this commit settles ("" if none)."""
        if self.ended:
            return ""
        self.pending.update(zip(commit.positions, commit.token_ids))
        while not self.ended and self.next in self.pending:
            token = self.pending.pop(self.next)
            self.next += 1
            self.ended = token == self.eos_id or token in self.stop_ids
            if not self.ended:
                self.settled.append(token)
            else:
                self.end_token, self.stopped = token, token != self.eos_id
        if self.detokenize is None:
            return ""
        text = self.detokenize(self.settled)
        if self.stop:  # also when this commit ended it (EOS, a stop token): a stop string before that comes first
            found = first_stop(text, self.stop, self._scanned)
            # A character split across byte-level tokens reads U+FFFD until its last byte comes, and then
            # replaces the placeholder: the scan resumes before it, or a stop that ends in it is missed.
            self._scanned = max(0, len(text.rstrip("\ufffd")) - max(map(len, self.stop)) + 1)
            if found is not None:
                self.ended = self.stopped = True
                self.end_token = None
                text = text[: found[0]]
                self.settled = self.settled[: covering(self.settled, text, self.detokenize)]
        if self.stopped:
            self.stop_text = text
        if text.endswith("\ufffd") and not self.ended:  # an incomplete UTF-8 sequence: wait for the rest
            return ""
        end = len(text) if self.ended else len(text) - held_back(text, self.stop)
        piece = text[len(self.shown):end] if end > len(self.shown) else ""
        self.shown += piece
        return piece


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
