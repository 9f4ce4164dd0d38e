"""refusion.runtime.tokenizer against transformers' AutoTokenizer on the tiny Qwen3-like fixture."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.tokenizer import TOKENIZER_FILES, Tokenizer
from refusion.tools.checks.fixtures.tokenizer_files import write_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "",
    "Hello world",
    "  leading and trailing spaces  ",
    "line one\nline two\r\n\tindented\n\n\n",
    "Grüße aus München — café crème, naïve 日本語 你好 🙂🚀",
    "e\u0301 composed by NFC",  # the normalizer must run
    "<|im_start|>user\nhi<|im_end|>\n",
    "before<think>reasoning</think>after<|mask|><|mask|> tail<|endoftext|>",
    "not special: <|im_start |> <think >",
    "def add(a, b):\n    return a + b  # 42, 3.14",
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — «quoted» & <escaped>?",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello there"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    "multi_turn_reasoning": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nThree and three.\n</think>\n\n6"},
    ],
    "reasoning_alias": [  # transformers copies `reasoning` to `reasoning_content`
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Because.", "reasoning": "Thinking it over."},
    ],
    "content_parts_and_none": [
        {"role": "system", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Two."}]},
        {"role": "user", "content": "Hi", "name": None},
    ],
    "tools": [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,  # dropped like transformers does
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "22 °C"},
        {"role": "assistant", "content": "Sunny, 22 °C."},
        {"role": "user", "content": "Thanks"},
    ],
}


@pytest.fixture(scope="module", params=[False, True], ids=["tokenizer_json", "vocab_merges"])
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    info = write_tokenizer(d, legacy_files=request.param)
    return Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(str(d)), info, d


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok_main")
    write_tokenizer(d)
    return d


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, **changes) -> None:
    path = d / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


# --- tokens ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(pair, text):
    ours, hf, _, _ = pair
    ids = ours.encode(text)
    assert ids == hf(text)["input_ids"]
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_attributes_match_fixture_and_transformers(pair):
    ours, hf, info, d = pair
    assert ours.vocab_size == info["vocab_size"] == len(hf)
    assert ours.eos_token_id == info["eos_token_id"] == hf.eos_token_id == ours.token_to_id("<|im_end|>")
    assert ours.token_to_id("<|mask|>") == info["mask_token_id"] == hf.mask_token_id
    assert ours.token_to_id("<|endoftext|>") == info["pad_token_id"] == hf.pad_token_id
    assert ours.token_to_id("no such token") is None
    assert info["vocab_size"] < 400
    # Special tokens inside text are single ids; non-special added tokens survive decoding.
    assert ours.encode("a<|im_end|>")[-1] == info["eos_token_id"]
    assert ours.decode(ours.encode("<|im_start|>x<think>y</think><|im_end|>")) == "x<think>y</think>"
    assert {p.name for p in d.iterdir()} <= set(TOKENIZER_FILES)


def test_tokenizer_files_constant():
    assert set(TOKENIZER_FILES) == {
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "merges.txt",
        "special_tokens_map.json",
        "chat_template.jinja",
        "added_tokens.json",
    }


# --- chat template --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("enable_thinking", [True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(pair, name, enable_thinking, add_generation_prompt):
    ours, hf, _, _ = pair
    messages = CONVERSATIONS[name]
    tools = TOOLS if name == "tools" else None
    expected = hf.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        enable_thinking=enable_thinking,
    )
    got = ours.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking, tools=tools
    )
    assert got == expected


def test_chat_template_exact_text(tok_dir):
    # Independent of transformers: pins trim_blocks/lstrip_blocks and the thinking switch.
    tok = Tokenizer.from_dir(tok_dir)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    head = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages) == head
    assert tok.apply_chat_template(messages, enable_thinking=False) == head + "<think>\n\n</think>\n\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == head.removesuffix(
        "<|im_start|>assistant\n"
    )
    tools_prompt = tok.apply_chat_template(messages, tools=TOOLS)
    assert json.dumps(TOOLS[0], ensure_ascii=False) in tools_prompt  # transformers' tojson: no HTML escaping


def test_chat_template_jinja_file_preferred(tok_dir, tmp_path):
    # transformers 5 stores the template in chat_template.jinja and prefers it to the config entry.
    d = _copy(tok_dir, tmp_path / "tok")
    (d / "chat_template.jinja").write_text(
        textwrap.dedent(
            """\
            {% set ns = namespace(n=0) %}
            {% for m in messages %}
                {% set ns.n = ns.n + 1 %}
                {% generation %}[{{ m.role | upper }}] {{ m.content | trim }}{% endgeneration %}
                {% if loop.last %}{% continue %}{% endif %}
            --
            {% endfor %}
            {{ dict(a=1, b=[2, 'é']) | tojson(indent=2, sort_keys=true) }}
            {{ ns.n }} {{ eos_token }} {{ mask_token }} {{ bos_token is defined }} {{ strftime_now('%Y') | length }}
            {% if add_generation_prompt %}<|im_start|>assistant{% endif %}
            """
        )
    )
    messages = [{"role": "user", "content": "  hi  "}, {"role": "assistant", "content": "yo"}]
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    got = Tokenizer.from_dir(d).apply_chat_template(messages)
    assert got == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=True)
    assert got.startswith("[USER] hi")


def test_qwen2_defaults_for_omitted_special_tokens(tok_dir, tmp_path):
    # Qwen2Tokenizer fills eos/unk/pad with <|endoftext|> when the config omits them.
    d = _copy(tok_dir, tmp_path / "tok")
    _edit_config(
        d,
        eos_token=None,
        mask_token=None,
        unk_token=None,
        chat_template="{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ mask_token is defined }}",
    )
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    ours = Tokenizer.from_dir(d)
    assert ours.eos_token_id == hf.eos_token_id == ours.token_to_id("<|endoftext|>")
    messages = [{"role": "user", "content": "x"}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False)


@pytest.mark.parametrize("legacy", [False, True])
def test_named_special_token_missing_from_vocab(tmp_path, legacy):
    # transformers appends a named special token the vocabulary lacks as a new special token.
    d = tmp_path / "tok"
    info = write_tokenizer(d, legacy_files=legacy)
    _edit_config(d, eos_token="<|eot|>")
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    ours = Tokenizer.from_dir(d)
    assert ours.eos_token_id == hf.eos_token_id == info["vocab_size"]
    assert ours.vocab_size == len(hf) == info["vocab_size"] + 1
    text = "x<|eot|>y"
    assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.decode(ours.encode(text)) == hf.decode(hf(text)["input_ids"], skip_special_tokens=True) == "xy"


def test_split_special_tokens(tok_dir, tmp_path):
    # split_special_tokens=True in the config: special tokens typed in text are plain text.
    d = _copy(tok_dir, tmp_path / "tok")
    _edit_config(d, split_special_tokens=True)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    ours = Tokenizer.from_dir(d)
    text = "a<|im_end|>b<think>c"
    assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.eos_token_id not in ours.encode(text)


def test_legacy_special_files_without_added_tokens_decoder(tmp_path):
    # Old checkpoints: added_tokens.json + special_tokens_map.json instead of added_tokens_decoder.
    d = tmp_path / "tok"
    write_tokenizer(d, legacy_files=True)
    config = json.loads((d / "tokenizer_config.json").read_text())
    decoder = config.pop("added_tokens_decoder")
    config.pop("eos_token")
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "added_tokens.json").write_text(json.dumps({t["content"]: int(i) for i, t in decoder.items()}))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>", "lstrip": False}}))
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    ours = Tokenizer.from_dir(d)
    assert ours.eos_token_id == hf.eos_token_id == ours.token_to_id("<|im_end|>")
    text = "a<|im_end|>b<think>c</think><|mask|> d"
    assert ours.encode(text) == hf(text)["input_ids"]
    assert ours.decode(ours.encode(text)) == hf.decode(hf(text)["input_ids"], skip_special_tokens=True)


# --- errors ---------------------------------------------------------------------------------


def test_missing_dir(tmp_path):
    with pytest.raises(RefusionError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")


def test_corrupt_tokenizer_json(tok_dir, tmp_path):
    d = _copy(tok_dir, tmp_path / "tok")
    (d / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(RefusionError, match=r"tokenizer\.json.*corrupt"):
        Tokenizer.from_dir(d)


def test_corrupt_tokenizer_config(tok_dir, tmp_path):
    d = _copy(tok_dir, tmp_path / "tok")
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(RefusionError, match=r"tokenizer_config\.json.*corrupt"):
        Tokenizer.from_dir(d)


def test_no_tokenizer_files(tmp_path):
    d = tmp_path / "tok"
    write_tokenizer(d, legacy_files=True)
    (d / "merges.txt").unlink()
    with pytest.raises(RefusionError, match=r"lacks merges\.txt"):
        Tokenizer.from_dir(d)


def test_added_token_id_mismatch(tok_dir, tmp_path):
    d = _copy(tok_dir, tmp_path / "tok")
    config = json.loads((d / "tokenizer_config.json").read_text())
    decoder = config["added_tokens_decoder"]
    decoder["399"] = {**decoder.pop(str(max(map(int, decoder)))), "content": "<|new|>"}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(RefusionError, match=r"'<\|new\|>' is declared with id 399"):
        Tokenizer.from_dir(d)


def test_no_chat_template(tok_dir, tmp_path):
    d = _copy(tok_dir, tmp_path / "tok")
    _edit_config(d, chat_template=None)
    tok = Tokenizer.from_dir(d)  # loading still works: raw text and ids need no template
    assert tok.encode("hi") == Tokenizer.from_dir(tok_dir).encode("hi")
    with pytest.raises(RefusionError, match="no chat template.*raw text or token ids"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_errors(tok_dir, tmp_path):
    tok = Tokenizer.from_dir(tok_dir)
    with pytest.raises(RefusionError, match="unsupported role robot"):  # the template's raise_exception
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(RefusionError, match="empty conversation"):
        tok.apply_chat_template([])
    with pytest.raises(RefusionError, match="not a dict"):
        tok.apply_chat_template(["hello"])
    d = _copy(tok_dir, tmp_path / "tok")
    (d / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(RefusionError, match="not valid Jinja"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "hi"}])
    (d / "chat_template.jinja").write_text("{{ namespace(_x=1) }}")
    with pytest.raises(RefusionError, match="underscore"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "hi"}])



@pytest.mark.parametrize("template, limit", [
    ("{{ 'a' * 100000000 }}", "made a repetition of 100000000"),
    ("{{ [0] * 100000000 }}", "made a repetition of 800000000"),  # 8 bytes an item
    ("{{ 9 ** 99999999 }}", "made a power's bits"),
    ("{{ 'a'|center(100000000) }}", "passed 100000000 to a call"),
    ("{{ '{:>100000000}'.format('a') }}", "formats to a width of 100000000"),
    ("{{ '{:>{w}}'.format('a', w=100000000) }}", "passed 100000000 to a call"),
    ("{{ '%100000000s' % 'a' }}", "formats to a width of 100000000"),
    ("{{ '%.100000000f' % 1.0 }}", "formats to a width of 100000000"),
    ("{{ '%*s' % (100000000, 'a') }}", "passed 100000000 to a call"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "made a concatenation of"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "made a sum of"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "wrote more than"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran more than 50000 lines"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "maximum recursion depth"),
])
def test_a_hostile_template_is_stopped_at_a_limit(tok_dir, tmp_path, monkeypatch, template, limit):
    from refusion.runtime import chat_template as module

    # Smaller limits than the defaults, so that each case stops at once: the same checks, hit sooner.
    monkeypatch.setattr(module, "TEMPLATE_MAX_LINES", 50_000)
    monkeypatch.setattr(module, "TEMPLATE_MAX_SIZE", 1 << 20)
    d = _copy(tok_dir, tmp_path / "tok")
    (d / "chat_template.jinja").write_text(template)
    with pytest.raises(RefusionError, match="the chat template ") as err:
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "hi"}])
    assert limit in str(err.value)


def _render(tok_dir, tmp_path, template: str) -> str:
    d = _copy(tok_dir, tmp_path / "tok")
    (d / "chat_template.jinja").write_text(template)
    return Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("template, limit", [
    ("{{ (['a' * 60000000] * 100) | join }}", "made the join filter's result of 6000000000"),  # TPL4
    ("{% set s = 'a' * 60000 %}{{ s | replace('a', s) }}", "made the replace filter's result of 3600000000"),  # TPL5
    ("{{ s.replace('a', s) }}", "made the result of replace() of 3600000000"),
    ("{{ ('\t' * 1000).expandtabs(60000000) }}", "made the result of expandtabs() of 60000001000"),  # TPL6
    ("{{ lipsum(300000, html=False, min=100, max=101) }}", "made lorem ipsum of 484800000"),  # TPL7
    ("{{ ('a b ' * 16000000) | wordwrap(3) }}", "made the wordwrap filter's result of"),  # TPL8
    ("{{ ('a' * 60000000) | list | length }}", "made the list filter's result of 3840000000"),  # TPL9
    ("{{ ([0] * 8000000) | batch(8000000, 0) | list }}", "made the batch filter's result of"),
    ("{{ 'x'.join(['a' * 30000000] * 3) }}", "made the result of join() of"),
    ("{{ '{0}{0}{0}'.format('a' * 30000000) }}", "made the result of format() of"),
    ("{{ '%s%s%s' % (('a' * 30000000,) * 3) }}", "made a formatted string of"),
    ("{{ ['a' * 30000000] * 3 }}", "made an output of"),  # str() of a list: each item again
    ("{{ [['a' * 30000000] * 3] | tojson }}", "made the tojson filter's result of"),
    ("{% macro m() %}{% for i in range(3) %}{{ 'a' * 30000000 }}{% endfor %}{% endmacro %}{{ m() }}",
     "made a concatenation of"),
    ("{{ [[1]] * 10 | sum(start=[]) }}", "summed values other than numbers"),
    ("{{ (2 ** 32000) * (2 ** 32000) * (2 ** 32000) }}", "multiplied integers of 64001 and 32001 bits"),
    ("{{ 'abc'.encode() }}", "called the string method encode"),
    ("{{ (1).to_bytes(60000000, 'big') }}", "called int.to_bytes"),
    ("{{ {}.fromkeys('a' * 60000000) }}", "called dict.fromkeys"),
    ("{{ dict.fromkeys('a' * 60000000) }}", "made a sequence of"),
    ("{{ 'x'.join('a' * 60000000) }}", "made a sequence of"),  # refused from the length, not char by char
    ("{{ 'a' | urlize }}", "No filter named 'urlize'"),  # markup filters are not there
])
def test_filters_methods_and_globals_are_bounded_before_they_run(tok_dir, tmp_path, template, limit):
    """The probe's TPL4-TPL9 at the default limits: each is refused before it allocates what it asks for (the
    probe saw 6 GB and 60 GB allocations, 3.5 GiB and 1.6 GiB peaks, a render still running at 120 s)."""
    with pytest.raises(RefusionError, match="chat template ") as err:
        _render(tok_dir, tmp_path, template.replace("{{ s.", "{% set s = 'a' * 60000 %}{{ s."))
    assert limit in str(err.value)


@pytest.mark.parametrize("template, inside", [
    ("{{ lipsum(50, html=False, min=100, max=101) }}", "generate_lorem_ipsum"),  # a global's own loop
    ("{{ range(100000) | map('string') | join }}", "bounded"),  # a filter consuming another's results
])
def test_the_time_limit_stops_a_step_inside_a_filter_or_a_global(tok_dir, tmp_path, monkeypatch, template, inside):
    """The probe: the clock was read on template lines only, so one long filter or global call ran to its end.
    With no time allowed, the render stops at the first reading of the clock, which falls inside the call."""
    from refusion.runtime import chat_template as module

    monkeypatch.setattr(module, "TEMPLATE_MAX_SECONDS", 0.0)
    with pytest.raises(RefusionError, match="ran for more than 0 s") as err:
        _render(tok_dir, tmp_path, template)
    assert inside in [entry.name for entry in err.traceback]


def test_the_template_limits_leave_real_templates_and_the_callers_tracer_alone(tok_dir):
    import sys

    def tracer(frame, event, arg):
        return None

    sys.settrace(tracer)
    try:
        Tokenizer.from_dir(tok_dir).apply_chat_template(CONVERSATIONS["tools"])
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)

# --- dependencies ---------------------------------------------------------------------------


def test_runtime_imports_neither_torch_nor_transformers(tok_dir):
    code = textwrap.dedent(
        """
        import sys
        from refusion.runtime.tokenizer import Tokenizer
        tok = Tokenizer.from_dir(sys.argv[1])
        tok.decode(tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}])))
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
        print(heavy)
        sys.exit(1 if heavy else 0)
        """
    )
    result = subprocess.run([sys.executable, "-c", code, str(tok_dir)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
