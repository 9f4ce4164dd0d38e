"""A prompt near the model's positions (clients-5, failures 4 and 5), on the random-weight export of 1024 positions
(canvas 512 in 4 blocks of 128, slots of 32): max_tokens left out takes what the context leaves, any max_tokens that
fits is taken, the canvas's last block cut to the room; a cut canvas still only cuts (greedy max_tokens N is the
uncapped answer's first N tokens); past the positions, a ContextLengthError in OpenAI's words whose advice is taken."""

from __future__ import annotations

import pytest

from refusion.runtime.core.errors import ContextLengthError
from refusion.runtime.core.settings import MODES
from refusion.runtime.structured.tools import read_tools

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

# repro 4b's request: 740 prompt tokens with the fixture's template
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                              "unit": {"type": "string", "enum": ["c", "f"]}},
             "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "move", "description": "Drive the robot", "parameters": {
             "type": "object", "properties": {"direction": {"type": "string", "enum": ["left", "right"]},
                                              "steps": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["direction", "steps"], "additionalProperties": False}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_the_export_is_the_reviews(random_model):
    d = random_model.manifest.defaults
    assert (random_model.manifest.max_positions, d.gen_length, d.slot_size, d.serial_num_blocks) == (1024, 512, 32, 4)


@pytest.mark.parametrize("mode", MODES)
def test_max_tokens_left_out_takes_what_the_context_leaves(random_model, mode):
    """Repro 4a: a 616-token prompt was refused ("616 tokens + 512 positions"); the canvas shrinks to the 408 left."""
    messages = [{"role": "user", "content": "word " * 150}]
    assert len(random_model.prompt_ids(messages=messages)) == 616
    res = random_model.generate(messages=messages, mode=mode)
    assert res.finish_reason == "eos" or (res.finish_reason == "length" and len(res.token_ids) == 408)
    assert len(res.token_ids) <= 408


@pytest.mark.parametrize("mode", MODES)
def test_any_max_tokens_that_fits_is_taken(random_model, mode):
    """Repro 4b: max_tokens=284 after a 740-token prompt was rounded up to 384 positions and refused."""
    ids = random_model.prompt_ids(messages=WEATHER, tools=read_tools(TOOLS, NAMED))
    assert len(ids) == 740
    res = random_model.generate(messages=WEATHER, tools=TOOLS, tool_choice=NAMED, max_tokens=284, mode=mode)
    assert res.finish_reason == "tool_calls" and res.tool_calls[0]["function"]["name"] == "get_weather"
    plain = random_model.generate(prompt_ids=ids, max_tokens=284, mode=mode)  # unguided: every position decoded
    assert plain.finish_reason == "eos" or len(plain.token_ids) == 284


@pytest.mark.parametrize("mode", MODES)
def test_the_errors_advice_is_taken(random_model, mode):
    ids = [5] * 740
    with pytest.raises(ContextLengthError, match=r"^This model's maximum context length is 1024 tokens\. However, you "
                                                 r"requested 1025 tokens \(740 in the prompt, 285 in the completion\)\. "
                                                 r"The prompt is too long for that many: shorten it, or ask for at most 284 tokens "
                                                 r"\(max_tokens\); 284 positions remain after it\.$") as refused:
        random_model.generate(prompt_ids=ids, max_tokens=285, mode=mode)
    assert (refused.value.context, refused.value.prompt, refused.value.completion, refused.value.room) == (1024, 740, 285, 284)
    res = random_model.generate(prompt_ids=ids, max_tokens=refused.value.room, mode=mode)
    assert res.finish_reason == "eos" or len(res.token_ids) == 284


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("room", [300, 284, 20])
def test_a_cut_canvas_still_only_cuts(random_model, mode, room):
    """The token-exact contract where the canvas is cut: greedy max_tokens N is the first N tokens of the answer
    with max_tokens left out (whose canvas is cut to the same room), across whole blocks, whole slots and the
    short last slot (300 = 2 blocks of 128 + a slot of 32 + 12; 284 = 2 blocks + 28; 20: less than a slot)."""
    ids = [(7 * i) % 300 + 3 for i in range(random_model.manifest.max_positions - room)]
    whole = random_model.generate(prompt_ids=ids, mode=mode)
    assert whole.finish_reason == "eos" or len(whole.token_ids) == room
    for n in sorted({1, 19, 31, 32, 33, 127, 128, 129, 255, 256, 257, 270, room - 1, room}):
        if n <= room:
            capped = random_model.generate(prompt_ids=ids, mode=mode, max_tokens=n)
            assert capped.token_ids == whole.token_ids[:n], (room, n)


def test_a_gen_length_given_is_the_canvas_or_refused(random_model):
    """The expert's canvas is kept as given (upstream's layout): past the room it is refused, as before, saying
    what to do; with max_tokens it is cut as any canvas is."""
    ids = [5] * 900
    with pytest.raises(ContextLengthError, match=r"requested 1412 tokens \(900 in the prompt, 512 in the completion\)\. "
                                                 r"The prompt is too long for the canvas of 512 positions the gen_length given asks "
                                                 r"for: .*"
                                                 r"124 positions remain after this prompt"):
        random_model.generate(prompt_ids=ids, gen_length=512)
    assert len(random_model.generate(prompt_ids=ids, gen_length=512, max_tokens=124).token_ids) <= 124
    assert len(random_model.generate(prompt_ids=ids).token_ids) <= 124  # left out: the export's, cut


@pytest.mark.parametrize("mode", MODES)
def test_a_prompt_that_leaves_nothing_is_refused(random_model, mode):
    for ids, max_tokens in (([5] * 1024, None), ([5] * 1100, None), ([5] * 1024, 1)):
        with pytest.raises(ContextLengthError, match=r"maximum context length is 1024 tokens\. .*The prompt is too "
                                                     r"long: it leaves no position for an answer; shorten it to at most "
                                                     r"1023 tokens"):
            random_model.generate(prompt_ids=ids, max_tokens=max_tokens, mode=mode)
    last = random_model.generate(prompt_ids=[5] * 1023, mode=mode)  # one position left: one token
    assert len(last.token_ids) == 1 or last.finish_reason == "eos"
