"""Stop sequences in settled text, without a model: where they are found, what a stream holds back."""

from __future__ import annotations

from refusion.runtime.decode.steps import Commit
from refusion.runtime.request import SettledText
from refusion.runtime.stop import first_stop, held_back

EOS = 0
CHARS = {i: c for i, c in enumerate("␃abcdefghijklmnopqrstuvwxyz ", start=0)}  # token 0 is EOS


def detok(ids: list[int]) -> str:
    return "".join(CHARS[i] for i in ids)


def ids(text: str) -> list[int]:
    code = {c: i for i, c in CHARS.items()}
    return [code[c] for c in text]


def feed(text: SettledText, commits: list[tuple[int, str]], start: int = 3) -> list[str]:
    """Commits of (offset from the prompt's end, text); the pieces they settle."""
    return [text.add(Commit(n, tuple(ids(t)), tuple(range(start + at, start + at + len(t))), "ar"))
            for n, (at, t) in enumerate(commits)]


def test_first_stop_and_held_back():
    assert first_stop("hello world", ("wor", "lo")) == (3, 2)
    assert first_stop("hello world", ("xyz",)) is None
    assert first_stop("aab", ("ab", "aab")) == (0, 3)
    assert first_stop("hello", ("l",), start=4) is None
    assert held_back("hello wo", ("world",)) == 2
    assert held_back("hello", ("world",)) == 0
    assert held_back("abab", ("abac",)) == 2  # "ab" could still become "abac"


def test_text_before_a_stop_string_is_shown_and_the_stop_never():
    text = SettledText(3, EOS, detok, stop=("stop",))
    pieces = feed(text, [(0, "go s"), (4, "t"), (5, "op and more")])
    assert pieces == ["go ", "", ""]  # "s", "st" held back: they could begin "stop"
    assert text.stopped and text.stop_text == "go " and text.stop_tokens == 7  # through the token completing it


def test_held_back_text_that_is_no_stop_comes_once_it_cannot_be():
    text = SettledText(3, EOS, detok, stop=("stop",))
    assert feed(text, [(0, "a st"), (4, "ep")]) == ["a ", "step"]
    assert not text.stopped


def test_out_of_order_commits_settle_before_a_stop_is_looked_for():
    text = SettledText(3, EOS, detok, stop=("cd",))
    assert feed(text, [(2, "cd"), (0, "ab")]) == ["", "ab"]
    assert text.stopped and text.stop_text == "ab"


def test_a_stop_token_ends_the_text_and_is_not_shown():
    text = SettledText(3, EOS, detok, stop_ids=(ids("x")[0],))
    assert feed(text, [(0, "abxcd")]) == ["ab"]
    assert text.stopped and text.stop_tokens == 3 and text.stop_text == "ab"
    eos = SettledText(3, EOS, detok, stop_ids=(ids("x")[0],))
    assert feed(eos, [(0, "ab␃x")]) == ["ab"] and not eos.stopped  # EOS first: an EOS end, not a stop


def test_a_stop_string_before_the_eos_of_the_same_commit_still_stops():
    text = SettledText(3, EOS, detok, stop=("cd",))
    assert feed(text, [(0, "abcd␃")]) == ["ab"]
    assert text.stopped and text.stop_tokens == 4
