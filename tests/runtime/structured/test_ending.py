"""The matcher adapter that owns the answer's end (engine.Ending), over the fake guide of a few answers: the EOS is
valid where an answer is complete and nothing after it, consuming it ends the answer, a rollback over it reopens
the answer, and the engine's matcher never sees it."""

from __future__ import annotations

import numpy as np

from refusion.runtime.core.contract import mask_bytes
from refusion.runtime.structured.engine import Ending
from tests.fakes import FakeChoice

EOS, VOCAB = 9, 16


def _ending() -> Ending:
    return Ending(FakeChoice([[1, 2], [1, 2, 3, 4]], VOCAB, EOS).matcher(), EOS)


def _allows(mask: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(mask, bitorder="little")))


def test_the_eos_is_valid_where_an_answer_is_complete_and_nothing_after_it():
    m = _ending()
    assert m.valid([1, 2, EOS, 3]) == 3 and m.valid([1, EOS]) == 1 and m.valid([1, 2, 3, 4, EOS]) == 5
    m.consume([1, 2])
    assert m.finished is False  # 3 may follow
    m.consume([3, 4])
    assert m.finished and m.forced() == []  # complete: the loop ends it


def test_consuming_the_eos_ends_the_answer_and_a_rollback_over_it_reopens_it():
    m = _ending()
    m.consume([1, 2, EOS])
    assert m.ended and not m.finished and m.forced() == [] and m.valid([3]) == 0
    out = np.empty(mask_bytes(VOCAB), np.uint8)
    assert m.allowed(out) is False and not out.any()
    assert m.inner.taken == [1, 2]  # the engine's matcher never saw the EOS
    m.rollback(2)
    assert not m.ended and m.inner.taken == [1]
    assert m.allowed(out) and _allows(out) == {2}


def test_masks_along_a_draft_ending_with_the_eos_read_nothing_after_it():
    m = _ending()
    out = np.empty((4, mask_bytes(VOCAB)), np.uint8)
    m.allowed_along([1, 2, EOS], out)
    assert [_allows(row) for row in out[:3]] == [{1}, {2}, {3, EOS}]
    assert (out[3] == 255).all()  # after the end: every token, as an unguided head
    assert m.inner.taken == [] and not m.ended  # where it was
