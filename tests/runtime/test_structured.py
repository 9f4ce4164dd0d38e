"""Structured output through the Generator: a guide the export, the engine or the strategy cannot enforce is
refused before any work (never answered unconstrained); tools are offered through the chat template, a required or
named call is certain, calls come back in the result and results go back in as role tool messages."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("llguidance")

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.decode.llada import DiffusionParams
from refusion.runtime.generator import Generator, Resolved
from refusion.runtime.options import RequestOptions
from refusion.tools.bench.guides import RANDOM_SETTINGS as RANDOM
from refusion.tools.bench.guides import TOOLS
from tests.helpers import as_format_6

ASK = [{"role": "user", "content": "robot, go left"}]


def test_an_export_of_format_6_runs_and_refuses_guides_saying_to_re_export(tiny_export, tmp_path):
    with Generator.from_dir(as_format_6(tiny_export, tmp_path), backend="ort-cpu", threads=1) as old:
        assert old.manifest.format_version == 6 and not old.manifest.takes_masks
        with Generator.from_dir(tiny_export, backend="ort-cpu", threads=1) as new:
            assert old.generate("sort: 3 1 2", chat=True).token_ids == new.generate("sort: 3 1 2", chat=True).token_ids
        with pytest.raises(RefusionError, match=r"regex: .* is an export of format 6, whose graphs cannot apply a guide "
                                                r"\(they take no vocab_mask\); re-export it"):
            old.submit("sort: 3 1 2", chat=True, regex=r"\d+")
        assert old.scheduler.in_flight == 0  # refused before any work


def test_a_guide_needs_the_tokenizer_and_a_strategy_that_follows_one(tiny):
    bare = Generator(tiny.manifest, tiny.runner, None, prefix_cache_mb=0)
    with pytest.raises(RefusionError, match="carries no tokenizer files"):
        bare.submit(prompt_ids=[1, 2, 3], regex="a")
    with pytest.raises(RefusionError, match="mode 'llada' follows no guide"):
        options = RequestOptions(regex="a")
        tiny.submit_ids([1, 2, 3], Resolved(DiffusionParams(gen_length=8, steps=8, block_length=8), options,
                                            grammar=tiny.grammar(options)))


def test_without_llguidance_a_guide_is_refused_naming_the_extra(tiny_export, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with Generator.from_dir(tiny_export, backend="ort-cpu", threads=1) as gen:
        assert gen.generate("sort: 3 1 2", chat=True).text  # the rest works without it
        with pytest.raises(RefusionError, match=r"needs llguidance, which is not installed: pip install "
                                                r"'refusion-trt\[structured\]'"):
            gen.generate("sort: 3 1 2", chat=True, choice=["a", "b"])


@pytest.mark.parametrize("mode", ["refusion", "ar"])
def test_an_empty_choice_or_a_guide_nested_too_deep_is_refused_before_any_work(tiny, mode):
    """The probe's C03 (choice=[] was answered unconstrained) and J09 (a schema dict 10,000 deep raised
    RecursionError from json.dumps): each is a RefusionError naming its field, and nothing starts."""
    deep = schema = {}
    for _ in range(9_999):
        schema["items"] = schema = {"type": "array"}
    for guide, message in [(dict(choice=[]), r"^choice=\[\] holds no strings; give at least one"),
                           (dict(json_schema=deep), r"^json_schema nests 10000 deep, over the limit of 32"),
                           (dict(json_schema="[" * 1000 + "]" * 1000), r"^json_schema nests 1000 deep")]:
        with pytest.raises(RefusionError, match=message):
            tiny.generate("sort: 3 1 2", chat=True, mode=mode, **guide)
    assert tiny.scheduler.in_flight == 0
    assert tiny.generate("sort: 3 1 2", chat=True, mode=mode, choice=["1 2 3", "3 2 1"]).text in ("1 2 3", "3 2 1")


def test_importing_the_runtime_loads_neither_torch_nor_llguidance():
    engine = "refusion.runtime.structured.llguidance_engine"  # nor the engine's adapter: a tool call is data
    code = f"import sys, refusion.runtime; print(sorted({{'torch', 'llguidance', {engine!r}}} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_tools_need_a_template_with_a_tool_format(untooled_export):
    with Generator.from_dir(untooled_export, backend="ort-cpu", threads=1) as untooled:
        with pytest.raises(RefusionError, match="has no tool format .it never reads `tools`."):
            untooled.submit(messages=ASK, tools=TOOLS)
        with pytest.raises(RefusionError, match="tools are offered through the chat template"):
            untooled.submit("go", tools=TOOLS)


@pytest.mark.parametrize("tools, choice, message", [
    (None, "required", "tool_choice='required' needs tools"),
    ([], None, "tools must be a non-empty list"),
    ([{"type": "function", "function": {"name": "a b"}}], None, "tools\\[0\\].function.name='a b' must be"),
    (TOOLS + TOOLS[:1], None, "tools\\[2\\].function.name='move' is given twice"),
    (TOOLS, "sometimes", "tool_choice='sometimes' is not one of"),
    (TOOLS, {"type": "function", "function": {"name": "fly"}}, "names the function 'fly', which is not one of"),
])
def test_bad_tools_are_refused_naming_the_field(random_model, tools, choice, message):
    with pytest.raises(RefusionError, match=message):
        random_model.submit(messages=ASK, tools=tools, tool_choice=choice)


@pytest.mark.parametrize("mode", ["refusion", "ar"])
def test_a_required_or_named_call_is_certain_and_valid(random_model, mode):
    import jsonschema

    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice, names in (("required", set(params)), ({"type": "function", "function": {"name": "move"}}, {"move"})):
        result = random_model.generate(messages=ASK, tools=TOOLS, tool_choice=choice, mode=mode, **RANDOM)
        assert result.finish_reason == "tool_calls" and result.text == "" and len(result.tool_calls) == 1
        call = result.tool_calls[0]
        assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), params[call["function"]["name"]])


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},  # a Pydantic model's schema:
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},  # no
          "required": ["name", "age"]}  # additionalProperties, which a guide reads as false


@pytest.mark.parametrize("mode", ["refusion", "ar"])
def test_tools_and_a_typed_answer_in_one_request_give_a_call_or_that_answer(random_model, mode):
    """OpenAI's reading, which agents rely on (tools, then a typed final answer): with "auto" the model calls a tool
    or answers in the typed answer's schema (OpenAI's response_format, which its server translates into json_schema);
    with "required" or a named function it calls one (a call has no text)."""
    import jsonschema

    seen = set()
    for seed in range(8):
        result = random_model.generate(messages=ASK, tools=TOOLS, json_schema=PERSON, mode=mode, temperature=1.0,
                                       seed=seed, max_tokens=96)
        if result.tool_calls:
            assert result.finish_reason == "tool_calls" and result.text == ""
            seen.add("call")
        else:
            assert result.finish_reason == "eos"
            jsonschema.validate(json.loads(result.text), {**PERSON, "additionalProperties": False})
            seen.add("answer")
    assert seen == {"call", "answer"}  # both forms are open to it: the first token may be `<tool_call>` or `{`
    for choice in ("required", {"type": "function", "function": {"name": "move"}}):
        result = random_model.generate(messages=ASK, tools=TOOLS, tool_choice=choice, json_schema=PERSON, mode=mode,
                                       max_tokens=96)
        assert result.finish_reason == "tool_calls" and len(result.tool_calls) == 1
    # a regex shapes the whole answer, calls read out of it (vLLM's guided fields): here it writes a call
    written = '<tool_call>\n{"name": "stop", "arguments": {}}\n</tool_call>'
    result = random_model.generate(messages=ASK, tools=TOOLS, choice=[written], mode=mode, max_tokens=96)
    assert result.finish_reason == "tool_calls" and result.tool_calls[0]["function"]["name"] == "stop"


@pytest.mark.parametrize("mode", ["refusion", "ar"])
def test_a_required_call_cut_by_max_tokens_is_a_cut_call_not_markup(random_model, mode):
    for cut in (4, 24, 40):
        result = random_model.generate(messages=ASK, tools=TOOLS, tool_choice="required", mode=mode, max_tokens=cut)
        assert result.finish_reason == "length" and result.text == "" and len(result.tool_calls) == 1
        name, arguments = result.tool_calls[0]["function"]["name"], result.tool_calls[0]["function"]["arguments"]
        assert any(tool.startswith(name) for tool in ("move", "stop")) and "<tool_call>" not in arguments
        assert ('{"direction": "'.startswith(arguments) or arguments.startswith('{"direction": "') or arguments in "{}")


def test_auto_reads_calls_out_of_the_answer_and_none_offers_no_tools(random_model):
    auto = random_model.generate(messages=ASK, tools=TOOLS, **RANDOM)  # a random model calls nothing
    assert auto.tool_calls == [] and auto.finish_reason in ("eos", "length")
    plain = random_model.prompt_ids(messages=ASK)
    offered = random_model.prompt_ids(messages=ASK, tools=random_model_tools("auto"))
    assert random_model.prompt_ids(messages=ASK, tools=random_model_tools("none")) == plain != offered
    assert "<tools>" in random_model.tokenizer.decode(offered)


def random_model_tools(choice):
    from refusion.runtime.structured.tools import read_tools

    return read_tools(TOOLS, choice)


def test_calls_and_their_results_go_back_into_the_conversation(random_model):
    call = random_model.generate(messages=ASK, tools=TOOLS, tool_choice="required", **RANDOM).tool_calls[0]
    conversation = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": '{"ok": true}'}]
    text = random_model.tokenizer.decode(random_model.prompt_ids(messages=conversation,
                                                                 tools=random_model_tools("auto")))
    assert f'<tool_call>\n{{"name": "{call["function"]["name"]}", "arguments": ' in text
    assert '<tool_response>\n{"ok": true}\n</tool_response>' in text
    assert random_model.generate(messages=conversation, tools=TOOLS, **RANDOM).finish_reason in ("eos", "length")


def test_a_request_is_resolved_once(tiny, monkeypatch):
    """Generator.options resolves a request's keywords once, its guide compiled there and handed to submit_ids
    (issue 43, item 3): one compile call a submit, where the guide was looked up at three places."""
    asked = []
    real = tiny.guides.compile
    monkeypatch.setattr(tiny.guides, "compile", lambda guide: asked.append(guide.field) or real(guide))
    resolved = tiny.options(regex="[ab]{2}", max_tokens=4)
    assert isinstance(resolved, Resolved) and resolved.grammar is not None and asked == ["regex"]
    tiny.submit(prompt_ids=[1, 2, 3], regex="[ab]{2}", max_tokens=4).result()
    assert asked == ["regex"] * 2  # the submit's one resolution
