"""Guided decoding without a grammar engine: tests/fakes.py's FakeChoice (a trie of answers) on the FakeRunner,
which applies the guide's vocab_mask as a graph does. The loop's own rules, in both modes, with llguidance not
importable: every answer is one of the choices and ends by EOS, the forced run takes no forward, and the same
request decodes the same tokens alone or beside others."""

from __future__ import annotations

import sys

import pytest

from refusion.models import EMBEDDED_MODEL
from refusion.runtime.core.settings import MODES
from refusion.runtime.decode.steps import Tokens
from refusion.runtime.params import DecodeParams
from refusion.runtime.request import Request
from refusion.runtime.scheduler import Scheduler
from refusion.runtime.tokenizer import Tokenizer
from tests.fakes import FakeChoice, FakeRunner, fake_manifest
from tests.helpers import decode_on

ANSWERS = ["left", "lift", "right", "stop now", "stop", "straight on"]  # shared prefixes: branches in the trie
PROMPTS = [[101, 97, 0, 93, 102, 0, 101, 98, 0], [5, 6, 7, 8], [40, 41], [3] * 12]


@pytest.fixture(autouse=True)
def no_llguidance(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # any import of it fails: these tests need none


@pytest.fixture(scope="module")
def setting():
    manifest = fake_manifest(EMBEDDED_MODEL)
    tok = Tokenizer.from_dir(EMBEDDED_MODEL)
    answers = [tok.encode(a) for a in ANSWERS]
    return manifest, tok, FakeChoice(answers, manifest.vocab_size, manifest.eos_token_id)


def _params(mode: str) -> DecodeParams:
    return DecodeParams(gen_length=32, slot_size=4, serial_num_blocks=2, slot_threshold=0.5, token_threshold=0.1,
                        mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_every_answer_is_one_of_the_choices_and_ends_by_eos(setting, mode):
    manifest, tok, guide = setting
    with FakeRunner(manifest) as runner:
        for prompt in PROMPTS:
            tokens = Tokens(prompt, manifest.mask_token_id, manifest.eos_token_id, guide=guide)
            result = decode_on(runner, tokens, _params(mode))
            assert tok.decode(result.token_ids) in ANSWERS and result.finish_reason == "eos", (prompt, result.token_ids)


@pytest.mark.parametrize("mode", MODES)
def test_a_single_answer_is_forced_whole_without_a_forward(setting, mode):
    manifest, tok, _ = setting
    only = FakeChoice([tok.encode("straight on")], manifest.vocab_size, manifest.eos_token_id)
    with FakeRunner(manifest) as runner:
        result = decode_on(runner, Tokens(PROMPTS[0], manifest.mask_token_id, manifest.eos_token_id, guide=only),
                           _params(mode))
    assert tok.decode(result.token_ids) == "straight on" and result.stats.forward_count == 0
    assert result.stats.branches["forced_tokens"] == len(tok.encode("straight on")) + 1  # and the EOS


@pytest.mark.parametrize("mode", MODES)
def test_guided_requests_decode_alike_alone_and_batched(setting, mode):
    manifest, _, guide = setting
    with FakeRunner(manifest) as runner:
        alone = [decode_on(runner, Tokens(p, manifest.mask_token_id, manifest.eos_token_id, guide=guide),
                           _params(mode)).token_ids for p in PROMPTS]
    with FakeRunner(manifest, max_requests=4, max_batch=4) as runner:
        scheduler = Scheduler(runner)
        try:
            requests = [scheduler.submit(Request(Tokens(p, manifest.mask_token_id, manifest.eos_token_id,
                                                        guide=guide), _params(mode))) for p in PROMPTS]
            together = [r.result(timeout=60).token_ids for r in requests]
        finally:
            scheduler.close()
    assert together == alone
