"""The answer's text rule without a model (runtime/text.py): where stop sequences are found, what a stream holds
back, which tokens an answer cut at a stop returns."""

from __future__ import annotations

import pytest

from refusion.runtime.decode.steps import Commit
from refusion.runtime.text import SettledText, covering, first_stop, held_back

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
    assert text.stopped and text.stop_text == "go " and text.settled == ids("go ")  # the stop's tokens are not kept


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
    assert text.stopped and text.settled == ids("ab") and text.stop_text == "ab" and text.end_token == ids("x")[0]
    eos = SettledText(3, EOS, detok, stop_ids=(ids("x")[0],))
    assert feed(eos, [(0, "ab␃x")]) == ["ab"] and not eos.stopped  # EOS first: an EOS end, not a stop


def test_a_stop_string_before_the_eos_of_the_same_commit_still_stops():
    text = SettledText(3, EOS, detok, stop=("cd",))
    assert feed(text, [(0, "abcd␃")]) == ["ab"]
    assert text.stopped and text.settled == ids("ab") and text.end_token is None


def test_a_stop_that_begins_inside_a_token_keeps_that_token():
    words = {1: "ab", 2: "cd", 3: "ef"}
    text = SettledText(0, EOS, lambda t: "".join(words[i] for i in t), stop=("de",))
    assert text.add(Commit(0, (1, 2, 3), (0, 1, 2), "ar")) == "abc"
    assert text.stopped and text.settled == [1, 2]  # "cd" holds the "c" shown


def test_covering_counts_the_fewest_tokens_whose_text_begins_with_it():
    assert covering(ids("hello"), "hel", detok) == 3
    assert covering(ids("hello"), "", detok) == 0
    assert covering(ids("hello"), "help", detok) == 5  # none does: all of them


# F2 of requests-review-4: a stop whose last character is several bytes, split across byte-level tokens
BYTE_STOPS = ["😀", "½", "語", "ok 😀", "½ cup", "日本語"]


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level BPE with no merges: every byte a token of its own, as Qwen3's splits a rare character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE({c: i + 1 for i, c in enumerate(sorted(alphabet))}, []))  # id 0: EOS
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


@pytest.mark.parametrize("stop", BYTE_STOPS)
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_a_stop_ending_in_a_split_multibyte_character_is_found(byte_tokenizer, stop, chunk):
    text_before = "we need " + ("ok " if not stop.startswith("ok") else "")
    tokens = byte_tokenizer.encode(text_before + stop + " then more").ids
    assert len(tokens) > len(text_before + stop + " then more")  # multi-byte characters span tokens
    reader = SettledText(0, EOS, byte_tokenizer.decode, stop=(stop,))
    shown = "".join(reader.add(Commit(n, tuple(tokens[at:at + chunk]), tuple(range(at, min(at + chunk, len(tokens)))),
                                      "ar"))
                    for n, at in enumerate(range(0, len(tokens), chunk)))
    assert reader.stopped and shown == reader.stop_text == text_before
    assert byte_tokenizer.decode(reader.settled) == text_before


def test_a_result_applies_its_stops_to_the_final_text_across_a_hole():
    """requests-review-4's F1 unit: commits at answer positions 0-3 and 8-11 (4-7 never decoded, as upstream's
    EOS drop leaves them), the request running to its end: the joined text is still cut at its first stop."""
    from refusion.runtime.decode.steps import Tokens
    from refusion.runtime.options import RequestOptions
    from refusion.runtime.params import DecodeParams
    from refusion.runtime.request import Request

    for options in (RequestOptions(stop=("ef",)), RequestOptions(stop_token_ids=(ids("f")[0],))):
        request = Request(Tokens([1, 2, 3], 99, EOS), DecodeParams(), detok, options=options)
        for n, (at, text) in enumerate([(0, "abcd"), (8, "efg␃")]):
            request.add_commit(Commit(n, tuple(ids(text)), tuple(range(3 + at, 3 + at + len(text))), "infill"))
            assert not request.stop_reached  # the stop lies past the hole: the settled text never reaches it
        request.finish(None)
        result = request.result()
        cut = "abcd" if options.stop else "abcde"
        assert (result.text, result.finish_reason, result.token_ids) == (cut, "stop", ids(cut))
        assert "".join(request) == cut


@pytest.mark.parametrize("stop", BYTE_STOPS)
def test_a_requests_result_and_stream_stop_at_a_split_multibyte_stop(byte_tokenizer, stop):
    """The same through a Request: its stream and its result, the slots committed out of order."""
    from refusion.runtime.decode.steps import Tokens
    from refusion.runtime.options import RequestOptions
    from refusion.runtime.params import DecodeParams
    from refusion.runtime.request import Request

    before = "ask ½ or " if stop != "½" and stop != "½ cup" else "ask or "
    tokens = byte_tokenizer.encode(before + stop + " more").ids
    request = Request(Tokens([1, 2], 999, EOS), DecodeParams(), byte_tokenizer.decode,
                      options=RequestOptions(stop=(stop,)))
    half = len(tokens) // 2
    for n, (at, part) in enumerate([(half, tokens[half:]), (0, tokens[:half])]):  # the second half first
        request.add_commit(Commit(n, tuple(part), tuple(range(2 + at, 2 + at + len(part))), "infill"))
    assert request.stop_reached
    request.finish("stop")
    result = request.result()
    assert (result.text, result.finish_reason) == (before, "stop")
    assert byte_tokenizer.decode(result.token_ids) == before and "".join(request) == before
