"""runtime/core/settings.py is the one table of request settings: every place a setting is declared (the
runtime's dataclasses, the strategies, the OpenAI fields, Triton's inputs, the CLIs' options, chat's
/settings and the docs' tables) says what its row says."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import get_args

import pytest

from refusion.runtime.core.defaults import DecodeDefaults
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.nesting import MAX_JSON_DEPTH
from refusion.runtime.core.profiles import DecodeLimits
from refusion.runtime.core.settings import (
    ALIASES,
    BY_NAME,
    DECODE,
    GUIDES,
    MODES,
    RECORDED,
    REQUEST,
    SETTINGS,
    Mode,
    read_by,
)
from refusion.runtime.decode import STRATEGIES
from refusion.runtime.options import RequestOptions
from refusion.runtime.params import DecodeParams
from tests.helpers import REPO


def _fields(cls) -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def test_the_runtimes_dataclasses_hold_the_rows():
    assert _fields(DecodeParams) == {s.name: s.default for s in DECODE}  # in the table's order, its defaults
    assert list(_fields(DecodeParams)) == [s.name for s in DECODE]
    assert _fields(RequestOptions) == {s.name: s.default for s in REQUEST}
    assert _fields(DecodeDefaults) == {s.name: s.default for s in RECORDED}
    limits = DecodeLimits()
    assert (limits.gen_length, limits.slot_size, limits.serial_blocks) == tuple(
        BY_NAME[name].default for name in ("gen_length", "slot_size", "serial_num_blocks"))


def test_the_strategies_read_what_the_rows_say():
    assert MODES == get_args(Mode) == BY_NAME["mode"].choices and set(MODES) < set(STRATEGIES)
    for mode in MODES:
        assert STRATEGIES[mode].settings == read_by(mode)
        assert set(read_by(mode)) <= set(_fields(DecodeParams))
    assert "slot_size" in read_by("refusion") and "slot_size" not in read_by("ar") and "mode" not in read_by("ar")


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_each_row_checks_its_kind_and_bounds(setting):
    if setting.default is not None:
        assert setting.check(setting.default) == setting.default
    bad = {"int": 1.5, "number": "x", "bool": 1, "string": 3, "strings": 3, "ints": ["2"], "text": 3,
           "json": [1]}[setting.kind]
    with pytest.raises(RefusionError, match=re.escape(f"{setting.name}={bad!r}")):
        setting.check(bad)
    if setting.low is not None and setting.kind in ("int", "number"):
        with pytest.raises(RefusionError, match=re.escape(setting.name)):
            setting.check(setting.low - 1)
    if setting.kind in ("text", "json"):  # bounded in bytes, before anything compiles it
        big = "x" * (int(setting.high) + 1) if setting.kind == "text" else {"a": "x" * int(setting.high)}
        with pytest.raises(RefusionError, match=rf"{setting.name} holds \d+ bytes, over the {setting.high:g}"):
            setting.check(big)
    assert setting.check(None) is None if setting.optional else True


def test_the_openai_fields_are_the_rows():
    from refusion.serve.openai.schema import FIELDS

    # tools and tool_choice feed Generator.submit's own keywords (the prompt's functions), not settings
    fed = {f.name: f for f in FIELDS if f.keyword and not (f.name == "logprobs" and f.kind == "int")
           and f.keyword not in ("tools", "tool_choice")}
    for setting in SETTINGS:
        for i, name in enumerate(setting.openai):
            field = fed.pop(name)
            assert (field.keyword, field.kind, field.refusion) == (setting.name, setting.kind, setting.openai_extra)
            assert field.help == setting.help or (i and setting.openai[0] in field.help)
    assert not fed, f"OpenAI fields that feed a setting with no row: {sorted(fed)}"


def test_the_triton_inputs_are_the_rows():
    pytest.importorskip("numpy")
    from refusion.serve.triton.tensors import INPUTS

    fed = {spec.name: spec for spec in INPUTS if spec.setting}
    for setting in (s for s in SETTINGS if s.triton):
        spec = fed.pop(setting.triton)
        assert (spec.setting, spec.help, spec.many) == (setting.name, setting.help,
                                                        setting.kind in ("strings", "ints"))
        kind = {"int": "INT", "ints": "INT", "number": "FP32", "bool": "BOOL"}.get(setting.kind, "STRING")
        assert kind in spec.triton_type
    assert not fed


def test_the_cli_options_are_the_rows():
    import click

    from refusion.tools.chat import chat
    from refusion.tools.run_cli import cli
    from refusion.tools.serve_command import client

    for command in (cli.commands["generate"], chat, client):
        options = {p.name: p for p in command.params if isinstance(p, click.Option)}
        for setting in (s for s in SETTINGS if s.cli != ""):
            option = options[setting.name]
            assert option.opts[0] == setting.flag
            assert option.opts[1:] == ["--" + a.replace("_", "-") for a in setting.aliases]
            assert option.help.lower().startswith(setting.help.lower())
            left_out = None if setting.recorded or setting.kind not in ("int", "number", "string") else setting.default
            assert option.default in (left_out, False, ()), (setting.name, option.default)
            if setting.choices:
                assert tuple(option.type.choices) == setting.choices


def test_chats_settings_are_the_decode_rows_and_the_guides():
    from refusion.tools.chat import _TYPES, HELP

    assert list(_TYPES) == [s.name for s in DECODE] + [s.name for s in GUIDES if s.cli != ""]
    assert ALIASES == {"k": "slot_size", "blocks": "serial_num_blocks", "serial_blocks": "serial_num_blocks"}
    for setting in (*DECODE, *GUIDES):
        assert setting.name in HELP or setting.cli == ""


def _first_column(doc: str, header: str) -> set[str]:
    table = doc[doc.index(header):].split("\n\n", 1)[0]
    return {name for row in table.splitlines()[2:] for name in re.findall(r"`([^`]+)`", row.split("|")[1])}


def test_the_docs_tables_name_every_row():
    api = (REPO / "docs" / "api.md").read_text()
    assert _first_column(api, "| setting | meaning |") == {s.name for s in DECODE}
    assert _first_column(api, "| option | meaning |") == {s.name for s in REQUEST}
    serving = (REPO / "docs" / "serving.md").read_text()
    inputs = _first_column(serving, "| input | type |")
    assert {s.triton for s in SETTINGS if s.triton} <= inputs


def _nested(depth: int) -> dict:
    """{"a": {"a": ... {}}}, `depth` objects deep, built without recursion."""
    outer = inner = {}
    for _ in range(depth - 1):
        inner["a"] = inner = {}
    return outer


@pytest.mark.parametrize("name", ["json_schema"])
@pytest.mark.parametrize("deep, depth", [("[" * 1000 + "]" * 1000, 1000), ('{"a":' * 3000 + "1" + "}" * 3000, 3000),
                                         (_nested(10_000), 10_000)], ids=["text-1000", "text-3000", "dict-10000"])
def test_a_json_guide_nests_no_deeper_than_a_body_may(name, deep, depth):
    """The probe's J07-J09: a guide's JSON text was parsed, and a dict dumped, by recursion (RecursionError, a 500
    from a server); now its nesting is measured first, as a server's body is, and refused naming the field."""
    with pytest.raises(RefusionError, match=rf"^{name} nests {depth} deep, over the limit of {MAX_JSON_DEPTH} "
                                            r"\(a guide is bounded\); give a flatter one"):
        BY_NAME[name].check(deep)


@pytest.mark.parametrize("name", ["json_schema"])
def test_a_json_guide_at_the_nesting_limit_is_taken(name):
    setting = BY_NAME[name]
    at = _nested(MAX_JSON_DEPTH)
    assert setting.check(at) == setting.check(json.dumps(at)) == json.dumps(at, separators=(",", ":"))
    for over in (_nested(MAX_JSON_DEPTH + 1), json.dumps(_nested(MAX_JSON_DEPTH + 1))):
        with pytest.raises(RefusionError, match=f"{name} nests {MAX_JSON_DEPTH + 1} deep"):
            setting.check(over)
    assert setting.check('{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}')  # brackets in strings do not count


def test_a_json_guide_that_holds_itself_is_not_json():
    loop: dict = {}
    loop["a"] = loop
    with pytest.raises(RefusionError, match=r"json_schema=\{'a': \{...\}\} is not JSON \(Circular reference"):
        BY_NAME["json_schema"].check(loop)


def test_an_empty_choice_is_refused_and_a_choice_left_out_is_none():
    """The probe's C03: choice=[] was taken as no guide, and the answer came unconstrained."""
    for empty in ([], ()):
        with pytest.raises(RefusionError, match=re.escape("choice=[] holds no strings; give at least one "
                                                          "(e.g. choice=['yes', 'no'])")):
            RequestOptions(choice=empty)
    assert RequestOptions().choice is None and RequestOptions(choice="yes").choice == ("yes",)
    assert RequestOptions(stop=[]).stop == ()  # no stop sequences is a value of stop


_BAD = {"int": "5", "number": "x", "bool": 1, "string": 5, "strings": 5, "ints": ["2"], "text": 5, "json": 5}


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_every_rows_refusal_carries_its_field(setting):
    """A frontend names the refused field from the error (OpenAI's param), never by reading its message."""
    with pytest.raises(RefusionError) as refused:
        setting.check(_BAD[setting.kind] if setting.choices is None else "not-a-choice")
    assert refused.value.field == setting.name and str(refused.value).startswith(setting.name)
