"""The structured task families (tools/families.py): answers that are right by an independent reading of the
prompt, valid under the schemas the families publish, within the token cap, rendered the same by our chat template
sandbox as by transformers, and held-out sets disjoint from training."""

from __future__ import annotations

import json
import random
import re

import pytest

from refusion.tools import families as F
from refusion.tools import tasks as T

jsonschema = pytest.importorskip("jsonschema")


def _robot_command(prompt: str) -> dict:
    """The command an instruction asks for, read independently of the generator."""
    if m := re.fullmatch(r"(?:move|go|drive) to (-?\d+) (-?\d+)(?: at speed (\d+))?", prompt):
        return {"action": "move", **({"speed": int(m[3])} if m[3] else {}), "to": [int(m[1]), int(m[2])]}
    if m := re.fullmatch(r"(?:turn to|rotate to|face) (-?\d+)(?: at speed (\d+))?", prompt):
        return {"action": "turn", **({"speed": int(m[2])} if m[2] else {}), "to": [int(m[1])]}
    if m := re.fullmatch(r"(?:grip at|pick up at|grab at) ((?:-?\d+ ?){2,3})(?: with the (left|right) hand)?", prompt):
        return {"action": "grip", **({"hand": m[2]} if m[2] else {}), "to": [int(x) for x in m[1].split()]}
    if prompt in ("stop", "halt", "stop now", "freeze", "stop moving"):
        return {"action": "stop"}
    m = re.fullmatch(r"(?:say|speak|tell them) (.+)", prompt)
    assert m, prompt
    return {"action": "say", "text": m[1]}


def test_robot_commands_follow_from_the_instruction_and_validate():
    for ex in F.held_out("robot", 300):
        assert json.loads(ex.answer) == _robot_command(ex.prompt), ex
        assert ex.answer == json.dumps(json.loads(ex.answer))  # the guides' layout
        jsonschema.validate(json.loads(ex.answer), F.ROBOT_SCHEMA)
    assert {json.loads(ex.answer)["action"] for ex in F.held_out("robot", 100)} == set(F.ACTIONS)


def test_json_answers_frame_the_base_held_out_answers_in_order():
    bases = T.held_out(120)
    for base, ex in zip(bases, F.held_out("json", 120)):
        assert ex.prompt == base.prompt and ex.schema == F.answer_schema(base.task)
        value = json.loads(ex.answer)["answer"]
        if base.task == "list":
            assert value == json.loads(base.answer)
        elif base.task == "add":  # a+b=c: the sum, an integer
            a, b = base.prompt.removeprefix("add: ").split("+")
            assert value == int(a) + int(b)
        else:
            assert value == base.answer
        jsonschema.validate(json.loads(ex.answer), ex.schema)
    asked = [ex for ex in F.held_out("json", 400) if ex.before]
    assert 0.6 < len(asked) / 400 < 0.9 and all("JSON" in ex.before[0]["content"] for ex in asked)


def test_tool_examples_call_what_the_request_names_and_answer_from_the_result():
    kinds = set()
    for ex in F.held_out("tool", 300):
        offered = {t["function"]["name"]: t["function"]["parameters"] for t in ex.tools}
        if ex.call is not None:
            name, arguments = ex.call
            assert name in offered and ex.answer == F.call_text(name, arguments)
            jsonschema.validate(arguments, offered[name])
            kinds.add("call")
        elif ex.after:
            call = ex.after[0]["tool_calls"][0]["function"]
            result = json.loads(ex.after[1]["content"])
            assert ex.answer == F.final_answer(call["name"], json.loads(call["arguments"]), result)
            assert str(next(iter(result.values()))) in ex.answer or result == {"ok": True}
            kinds.add("final")
        else:
            assert T.score(T.Example(ex.task, ex.prompt, ex.answer), ex.answer) and not ex.answer.startswith("<")
            kinds.add("plain")
        assert 2 <= len(ex.tools) <= 4 and set(offered) <= set(F.FUNCTIONS)
    assert kinds == {"call", "final", "plain"}


def test_typed_examples_call_the_one_function_offered_with_the_answer_as_its_arguments():
    bases = {ex.prompt: ex for ex in T.held_out(T.HELD_OUT_RESERVED)}
    kinds = set()
    for ex in F.held_out("typed", 200):
        ((tool),) = ex.tools
        function = tool["function"]
        assert ex.call is not None and ex.call[0] == function["name"] and ex.answer == F.call_text(*ex.call)
        jsonschema.validate(ex.call[1], function["parameters"])
        if function["name"] in F.COMMAND_NAMES:
            assert function["parameters"] == F.ROBOT_SCHEMA and json.loads(json.dumps(ex.call[1])) == ex.call[1]
            kinds.add("command")
        else:
            base = bases[ex.prompt]  # a base held-out prompt, its answer framed
            assert function["name"] in F.ANSWER_NAMES and ex.call[1] == {"answer": F.answer_value(base)}
            kinds.add("answer")
    assert kinds == {"command", "answer"}


def test_every_answer_but_a_typed_call_fits_64_tokens():
    from refusion.tools.train import tiny

    tok = tiny.build_tokenizer()
    for family in F.FAMILIES:
        for ex in F.held_out(family, 300):
            if family != "typed":
                assert len(tok(ex.answer)["input_ids"]) + 1 <= F.ANSWER_MAX_TOKENS, ex  # + EOS


def test_held_out_sets_are_fixed_and_disjoint_from_training():
    for family in F.FAMILIES:
        held = F.held_out(family, 200)
        assert held == F.held_out(family, 200) and F.held_out(family, 20) == held[:20]
        rng = random.Random(family)
        held = F.held_out_prompts()
        assert T.held_out_prompts() <= held and {ex.prompt for ex in F.held_out(family, 200)} <= held
        closed = 0
        for _ in range(600):
            ex = F.training_example(rng, family)
            if ex.prompt in F.STOP_COMMANDS:  # a closed set: trained and held out alike
                closed += 1
                continue
            assert ex.prompt not in held  # no family's held-out prompt, a call's request in a final's turn included
        assert closed > 0 if family in ("robot", "typed") else closed == 0, family  # stop is trained
    with pytest.raises(ValueError, match="unknown family 'nope'"):
        F.held_out("nope")
    with pytest.raises(ValueError, match="needs 0 <= n"):
        F.held_out("robot", F.HELD_OUT_RESERVED + 1)


def test_the_sandboxed_template_renders_every_family_as_transformers_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    from refusion.runtime.tokenizer import Tokenizer
    from refusion.tools.train import tiny

    tiny.build_tokenizer().save_pretrained(tmp_path)
    ours, theirs = Tokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    for family in F.FAMILIES:
        for ex in F.held_out(family, 60):
            tools = list(ex.tools) or None
            text = ours.apply_chat_template(ex.messages(), tools=tools)
            assert text == theirs.apply_chat_template(ex.messages(), tools=tools, tokenize=False, add_generation_prompt=True)
            if tools:
                assert text.startswith("<|im_start|>system\n") and "<tools>\n{\"name\": " in text
    call = F.held_out("tool", 40)
    ids = theirs(next(ex.answer for ex in call if ex.call))["input_ids"]
    assert ids[0] == theirs.convert_tokens_to_ids("<tool_call>")  # one token, as in Qwen's vocabulary
