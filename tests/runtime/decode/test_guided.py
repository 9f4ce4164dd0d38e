"""Guided decoding (runtime/decode/guided.py): every answer follows its guide, ReFusion and AR, streamed and not,
on the embedded model and on a random-weight one; AR under a guide its answer already follows is AR unguided, and
greedy ReFusion under a guide is guided AR, token for token; a forward drafts at most MAX_LOOKAHEAD tokens; the
answer ends where the guide does, at max_tokens ("length") or at a dead end ("dead_end"); forced tokens take no
forward; a guided request shares batches with unguided ones, which stay as they were."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytest.importorskip("llguidance")
pytest.importorskip("jsonschema")

from refusion.runtime.core.contract import mask_bytes
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.core.settings import MODES
from refusion.runtime.decode.guided import MAX_LOOKAHEAD, lookahead
from refusion.runtime.decode.steps import Tokens
from refusion.runtime.options import RequestOptions
from refusion.runtime.params import DecodeParams
from refusion.runtime.runners.base import Runner
from refusion.runtime.runners.onnxruntime import OrtCudaRunner, OrtRunner
from refusion.runtime.runners.stats import ForwardShape
from refusion.runtime.structured.engine import Grammar, Matcher
from refusion.tools.bench.guides import CASES, ROBOT
from refusion.tools.bench.guides import FAMILY_BY_NAME as FAMILY
from refusion.tools.bench.guides import RANDOM_SETTINGS as RANDOM
from refusion.tools.tasks import held_out
from tests.helpers import decode_on


@pytest.mark.parametrize("mode", MODES)
def test_every_answer_of_the_embedded_model_follows_its_guide(tiny, mode):
    prompts = [ex.prompt for ex in held_out(3)]
    for case in (c for c in CASES if not c.tools):
        for prompt in prompts:
            result = tiny.generate(prompt, chat=True, mode=mode, **case.settings)
            assert case.valid(result), (case.name, prompt, result.text, result.finish_reason)
            streamed = "".join(tiny.stream(prompt, chat=True, mode=mode, **case.settings))
            assert streamed == result.text, case.name  # greedy: the stream settles to the same answer


@pytest.mark.parametrize("mode", MODES)
def test_every_answer_of_a_random_weight_model_follows_its_guide(random_model, mode):
    for case in CASES:
        for prompt in ("robot, go", "Grüße 🙂"):
            ask = dict(messages=[{"role": "user", "content": prompt}]) if case.tools else dict(prompt=prompt)
            result = random_model.generate(**ask, mode=mode, **RANDOM, **case.settings)
            assert case.valid(result), (case.name, prompt, result.text, result.tool_calls, result.finish_reason)
            if not case.tools:
                assert "".join(random_model.stream(prompt, mode=mode, **RANDOM, **case.settings)) == result.text


def test_constrained_ar_is_unconstrained_ar_where_that_already_follows_the_guide(tiny, random_model):
    """The mask only removes tokens the guide forbids, so AR's argmax is unchanged wherever the unguided answer
    follows the guide; forced tokens are fed in one forward, and read the same."""
    guides = {"list": dict(json_schema={"type": "array", "items": {"type": "integer"}}),
              "add": dict(regex=r"\d+\+\d+=\d+"), "sort": dict(regex=r"\d( \d)*"), "upper": dict(regex="[A-Z ]+"),
              "reverse": dict(regex="[a-z]+"), "lookup": dict(regex=r"[a-z]\d( [a-z]\d)*")}
    fitting = 0
    for ex in held_out(24):
        free = tiny.generate(ex.prompt, chat=True, mode="ar")
        guide = guides[ex.task]
        fits = (re.fullmatch(guide["regex"], free.text) if "regex" in guide
                else free.text.startswith("[") and isinstance(json.loads(free.text), list))
        if fits:
            fitting += 1
            assert tiny.generate(ex.prompt, chat=True, mode="ar", **guide).token_ids == free.token_ids, ex.prompt
    assert fitting >= 20  # the embedded model answers in these forms
    # A random model's garbage is no text (bytes that form no UTF-8): up to the first token a guide that takes any
    # text refuses, the guided answer is the unguided one, token for token.
    matcher = random_model.grammar(RequestOptions(regex=r"[\s\S]*")).matcher()
    for prompt in ("a", "robot, stop", "hello"):
        free = random_model.generate(prompt, mode="ar", **RANDOM).token_ids
        accepted = matcher.valid(free)
        assert random_model.generate(prompt, mode="ar", regex=r"[\s\S]*", **RANDOM).token_ids[:accepted] == free[:accepted]


def test_greedy_guided_refusion_answers_as_guided_ar_token_for_token(tiny):
    """At temperature 0 a draft is accepted only where it is AR's pick (the masked argmax of the head before it), so
    ReFusion's structured answer is guided AR's, in fewer forwards. Accepting a draft whose probability passed
    token_threshold (0.1) made the 10th robot command and the 6th typed call other answers than AR's."""
    drafted = 0
    for case, n in ((FAMILY["robot-command"], 12), (FAMILY["typed-call"], 6)):
        for ex in case.examples(n):
            ours, ar = (tiny.generate(**case.asks(ex), mode=mode) for mode in ("refusion", "ar"))
            assert ours.token_ids == ar.token_ids and ours.finish_reason == ar.finish_reason, (case.name, ex.messages())
            assert ours.stats.forward_count < ar.stats.forward_count
            drafted += ours.stats.branches["drafts_accepted"]
    assert drafted > 100


@pytest.mark.parametrize("mode", MODES)
def test_max_tokens_inside_the_structure_is_length(tiny, mode):
    result = tiny.generate("hi", chat=True, mode=mode, json_schema=ROBOT, max_tokens=5)
    assert result.finish_reason == "length" and result.text == '{"act' and len(result.token_ids) == 5


@pytest.mark.parametrize("mode", MODES)
def test_forced_tokens_take_no_forward(tiny, mode):
    one = tiny.generate("hi", chat=True, mode=mode, choice=["forward-then-stop"])
    assert one.text == "forward-then-stop" and one.finish_reason == "eos" and one.stats.forward_count == 0
    robot = tiny.generate("hi", chat=True, mode=mode, json_schema=ROBOT)
    assert robot.stats.branches["forced_tokens"] >= len('{"action": "') + len('", "speed": ') + 1  # and the EOS
    assert robot.stats.forward_count < robot.stats.tokens - robot.stats.branches["forced_tokens"] + 1


class _Recording(OrtRunner):
    """onnxruntime, each forward's past and tokens fed recorded."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fed: list[tuple[int, int]] = []
        self.ids: list[list[int]] = []
        self.heads: list[int] = []

    def run_batch(self, graph, rows):
        self.fed += [(row.past, row.input_ids.shape[1]) for row in rows]
        self.heads += [row.with_heads().head_count for row in rows]
        self.ids += [row.input_ids[0].tolist() for row in rows]
        return super().run_batch(graph, rows)


def test_no_masks_are_fed_after_a_drafted_eos(tiny):
    """A verified run that ends with the EOS is the answer's end if accepted: nothing after it is drafted."""
    m, schema = tiny.manifest, RequestOptions(json_schema=json.dumps({"type": "array", "items": {"type": "integer"}}))
    params = DecodeParams(gen_length=64, slot_size=4, serial_num_blocks=4, slot_threshold=0.5, token_threshold=0.1)
    eos_fed = 0
    with _Recording(m, threads=1) as runner:
        for ex in [ex for ex in held_out(60) if ex.task == "list"][:6]:  # the list task's answers: JSON arrays
            tokens = Tokens(tiny.prompt_ids(ex.prompt, chat=True), m.mask_token_id, m.eos_token_id,
                            guide=tiny.grammar(schema))
            assert decode_on(runner, tokens, params).finish_reason == "eos"
        for (past, _), ids in zip(runner.fed, runner.ids):
            if past and m.eos_token_id in ids:  # past the prompt (whose turns end with the EOS token)
                eos_fed += 1
                assert m.mask_token_id not in ids[ids.index(m.eos_token_id):], ids
    assert eos_fed  # drafted EOSes were verified


def test_a_guided_forward_drafts_at_most_max_lookahead_tokens_whatever_the_block(tiny):
    """gen_length 256 in one block: each guided ReFusion forward still verifies and drafts at most MAX_LOOKAHEAD
    tokens after P (its heads: P's last, then R's and M's), where it used to feed the block's 256 masks; at 64 in 4
    blocks (16) the block bounds it. The answers follow the guide either way."""
    m, schema = tiny.manifest, RequestOptions(json_schema=json.dumps(ROBOT))
    assert lookahead(DecodeParams(gen_length=256, slot_size=4, serial_num_blocks=1)) == MAX_LOOKAHEAD == 32
    for gen_length, blocks, most in ((256, 1, MAX_LOOKAHEAD), (64, 4, 16)):
        params = DecodeParams(gen_length=gen_length, slot_size=4, serial_num_blocks=blocks, slot_threshold=0.5,
                              token_threshold=0.1)
        with _Recording(m, threads=1) as runner:
            for ex in held_out(4):
                tokens = Tokens(tiny.prompt_ids(ex.prompt, chat=True), m.mask_token_id, m.eos_token_id,
                                guide=tiny.grammar(schema))
                result = decode_on(runner, tokens, params)
                assert result.finish_reason == "eos" and set(json.loads(tiny.tokenizer.decode(result.token_ids)))
            assert max(runner.heads) == 1 + most, runner.heads  # reached: the drafts fill it


def test_the_runner_sizes_the_lookahead_where_fed_tokens_cost_their_arithmetic(tiny):
    """onnxruntime on the CPU verifies and drafts 8 tokens a guided forward (two slots of 4), a GPU runner a block:
    the answers are the same (greedy: guided AR's, token for token), only the forwards' widths differ."""
    assert (OrtRunner.guided_lookahead, OrtCudaRunner.guided_lookahead, Runner.guided_lookahead) == (8, None, None)
    block = DecodeParams(gen_length=64, slot_size=4, serial_num_blocks=4)
    assert lookahead(block, 8) == 8 and lookahead(block, None) == 16
    assert lookahead(DecodeParams(gen_length=64, slot_size=8, serial_num_blocks=2), 8) == 16  # two slots at least
    schema = json.dumps(ROBOT)
    answers, widest = {}, {}
    for most in (8, None):
        tiny.runner.guided_lookahead = most  # the instance's: what the Generator reads at each submit
        recorded: list = []
        tiny.runner.stats.record = recorded
        try:
            answers[most] = [tiny.generate(ex.prompt, chat=True, json_schema=schema).token_ids for ex in held_out(4)]
        finally:
            tiny.runner.stats.record = None
            del tiny.runner.guided_lookahead
        widest[most] = max(len(row.heads) for e in recorded if isinstance(e, ForwardShape) for row in e.rows)
    assert answers[8] == answers[None]
    assert widest == {8: 1 + 8, None: 1 + 16}  # P's last head, then R's and M's: reached, the drafts fill it


@pytest.mark.parametrize("mode", MODES)
def test_a_forced_stretch_is_fed_whole_where_the_runner_takes_it_else_in_chunks_of_its_bound(tiny, tiny_export, mode):
    """A stretch the guide forces after a free choice (here 45 tokens, as a call's `", "arguments": {"city": "`
    after its function's name) runs past a block of 16: onnxruntime takes it whole with the next forward, a runner
    bound to a block (a TensorRT engine's decode profile) in chunks of it. AR's answer is the same either way (its
    masked argmax); ReFusion's drafts differ with what a forward feeds, each answer under the guide."""
    guide = RequestOptions(regex=r"(yes|no), the stretch after this choice is forced whole: [0-9]{1,3}")
    ids = tiny.prompt_ids("sort: 3 1 2", chat=True)
    m = tiny.manifest
    params = DecodeParams(gen_length=64, slot_size=4, serial_num_blocks=4, slot_threshold=0.5, token_threshold=0.1,
                          mode=mode)
    results, fed = {}, {}
    for bound in (None, 16):
        with _Recording(m, threads=1) as runner:
            tokens = Tokens(ids, m.mask_token_id, m.eos_token_id, guide=tiny.grammar(guide), feed_bound=bound)
            results[bound], fed[bound] = decode_on(runner, tokens, params), runner.fed
    for result in results.values():
        text = tiny.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        assert result.finish_reason == "eos" and re.fullmatch(guide.regex, text), text
    assert mode == "refusion" or results[None].token_ids == results[16].token_ids
    assert "guided_kv" not in results[None].stats.forwards and results[16].stats.forwards["guided_kv"] >= 2
    assert all(n <= 16 for past, n in fed[16] if past >= len(ids))  # within the bound past the prompt
    assert results[None].stats.forward_count < results[16].stats.forward_count


class _Blocked(Grammar, Matcher):
    """A guide that allows every token but the EOS for `free` tokens, then none: a dead end."""

    def __init__(self, width: int, free: int, eos: int):
        self.width, self.free, self.eos, self.taken = width, free, eos, 0

    def matcher(self) -> Matcher:
        return _Blocked(self.width, self.free, self.eos)

    def allowed(self, out: np.ndarray) -> bool:
        out[:] = 255 if self.taken < self.free else 0
        out[self.eos // 8] &= ~np.uint8(1 << self.eos % 8)
        return self.taken < self.free

    def valid(self, tokens) -> int:
        return max(0, min(len(tokens), self.free - self.taken))

    def consume(self, tokens) -> None:
        self.taken += len(tokens)

    def rollback(self, count: int) -> None:
        self.taken -= count

    def forced(self) -> list[int]:
        return []

    @property
    def finished(self) -> bool:
        return False


@pytest.mark.parametrize("mode", MODES)
def test_a_dead_end_ends_the_answer_with_its_finish_reason(tiny_export, mode):
    m = ExportManifest.load(tiny_export)
    params = DecodeParams(gen_length=64, slot_size=4, serial_num_blocks=4, slot_threshold=0.5, token_threshold=0.1,
                          mode=mode)
    with OrtRunner(m, threads=1) as runner:
        tokens = Tokens([101, 97, 0, 93, 102, 0, 101, 98, 0], m.mask_token_id, m.eos_token_id,
                        guide=_Blocked(mask_bytes(m.vocab_size), 3, m.eos_token_id))
        result = decode_on(runner, tokens, params)
    assert result.finish_reason == "dead_end" and len(result.token_ids) == 3
    assert result.stats.forward_count <= 3


def test_a_guided_request_shares_batches_with_unguided_ones_which_stay_as_they_were(random_model):
    prompts = ["the robot", "go left now", "stop", "x y z"]
    alone = [random_model.generate(p, **RANDOM).token_ids for p in prompts]
    requests = [random_model.submit(p, **RANDOM, **({"json_schema": ROBOT} if i % 2 else {}))
                for i, p in enumerate(prompts)]
    results = [r.result() for r in requests]
    assert [results[i].token_ids for i in (0, 2)] == [alone[0], alone[2]]
    assert all(json.loads(results[i].text)["action"] for i in (1, 3))
    assert random_model.runner.stats.graph("infiller").rows > random_model.runner.stats.graph("infiller").forwards
