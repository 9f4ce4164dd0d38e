"""`refusion-run generate` on the embedded model's export: defaults from the export, refused flags, load options."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from click.testing import CliRunner

from refusion.export.exporter import export_onnx
from refusion.models import EMBEDDED_MODEL
from refusion.runtime import generator
from refusion.tools.run_cli import cli

PROMPT = "sort: 3 1 2"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The embedded model's export: 512 positions, recorded defaults gen_length 64, slot_size 4."""
    return export_onnx(EMBEDDED_MODEL, tmp_path_factory.mktemp("tiny") / "onnx", validate=False)


def run(*args: str):
    return CliRunner().invoke(cli, ["generate", *map(str, args)])


def test_generate_needs_no_decode_flags(tiny_dir):
    out = run(tiny_dir, PROMPT, "--chat")
    assert out.exit_code == 0, out.output
    assert out.stdout.strip() and "<|im_end|>" not in out.stdout
    data = json.loads(run(tiny_dir, PROMPT, "--chat", "--json", "--backend", "ort-cpu").stdout)
    assert data["text"] == out.stdout.strip() and len(data["token_ids"]) <= 64


def test_max_tokens_caps_the_answer(tiny_dir):
    for mode in ("refusion", "ar"):
        out = run(tiny_dir, PROMPT, "--chat", "--json", "--max-tokens", 3, "--mode", mode, "--backend", "ort-cpu")
        assert out.exit_code == 0, out.output
        assert 1 <= len(json.loads(out.stdout)["token_ids"]) <= 3
    out = run(tiny_dir, PROMPT, "--chat", "--max-tokens", 0)
    assert out.exit_code == 1 and "error: max_tokens=0 must be a positive integer" in out.output


def test_stop_flags_end_the_answer(tiny_dir):
    whole = json.loads(run(tiny_dir, "count: 1 2 3 4 5 6 7 8 9", "--chat", "--json", "--backend", "ort-cpu").stdout)
    stop = whole["text"][3:5]
    out = run(tiny_dir, "count: 1 2 3 4 5 6 7 8 9", "--chat", "--json", "--stop", "no such text", "--stop", stop)
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["finish_reason"] == "stop" and data["text"] == whole["text"][: whole["text"].find(stop)]
    with_logprobs = json.loads(run(tiny_dir, "count: 1 2 3", "--chat", "--json", "--logprobs").stdout)
    assert len(with_logprobs["logprobs"]) == len(with_logprobs["token_ids"]) and "logprobs" not in whole
    token = whole["token_ids"][2]
    data = json.loads(run(tiny_dir, "count: 1 2 3 4 5 6 7 8 9", "--chat", "--json", "--stop-token-id", token).stdout)
    at = whole["token_ids"].index(token)
    assert data["finish_reason"] == "stop" and data["token_ids"] == whole["token_ids"][:at]  # the stop token not kept


def test_sampling_flags_reach_the_request(tiny_dir):
    greedy = json.loads(run(tiny_dir, PROMPT, "--chat", "--json").stdout)["token_ids"]
    one = run(tiny_dir, PROMPT, "--chat", "--json", "--temperature", "1.5", "--top-k", "1", "--seed", "3")
    assert json.loads(one.stdout)["token_ids"] == greedy
    out = run(tiny_dir, PROMPT, "--chat", "--temperature", "1.5", "--top-p", "1.5")
    assert out.exit_code == 1 and "error: top_p=1.5 is outside [0, 1]" in out.output


def test_help_says_decode_settings_come_from_the_export():
    text = " ".join(CliRunner().invoke(cli, ["generate", "--help"]).stdout.split())
    assert "--serial-num-blocks, --serial-blocks INTEGER" in text  # the former name, still taken
    for flag in ("--gen-length", "--slot-size", "--serial-blocks", "--slot-threshold", "--token-threshold"):
        assert text.split(flag, 1)[1].split("--", 1)[0].count("default: the export's recorded value") == 1, flag
    assert "--low-memory onnxruntime only: no memory arena" in text
    assert "--verify Check every file's sha256 before loading" in text


@pytest.mark.parametrize("args, message", [
    (["--temperature", "nan"], "error: temperature=nan must be >= 0 and finite (0 is greedy; e.g. 0.7 samples)."),
    (["--temperature", "inf"], "error: temperature=inf must be >= 0 and finite"),
    (["--prompt-ids", "1,2"], "error: --chat does not combine with --prompt-ids: token ids are fed exactly as given, "
                              "without the chat template; drop --chat, or give the PROMPT text instead."),
    (["--threads", "0"], "error: threads=0 (--threads) is not a positive number of onnxruntime threads; "
                         "give 1 or more, or leave it out to use every core."),
    (["--backend", "trt", "--low-memory"],
     "error: low_memory=True (--low-memory) is an onnxruntime option (no memory arena) and does not "
     "apply to the trt backend; drop it, or choose --backend ort-cpu or ort-cuda."),
])
def test_refused_flags_name_the_flag_and_value(tiny_dir, args, message):
    prompt = [] if "--prompt-ids" in args else [PROMPT]
    out = run(tiny_dir, *prompt, "--chat", *args)
    assert out.exit_code == 1 and message in out.stderr, out.output


def test_float_prompt_ids_are_refused(tiny_dir):
    out = run(tiny_dir, "--prompt-ids", "1,2.5")
    assert out.exit_code == 1
    assert "error: --prompt-ids '1,2.5' is not a comma-separated list of integers, e.g. 1,2,3." in out.stderr


def test_ar_mode_is_not_padded_to_slots(tiny_dir):
    ids = ",".join(["5"] * 482)  # 482 + 30 = 512 positions; padded to 32-token slots it would not fit
    out = run(tiny_dir, "--prompt-ids", ids, "--mode", "ar", "--gen-length", "30", "--slot-size", "32", "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["stats"]["mode"] == "ar"


def test_low_memory_reaches_the_onnxruntime_runner(tiny_dir, monkeypatch):
    runners = []
    make_runner = generator.make_runner
    monkeypatch.setattr(generator, "make_runner", lambda *args: runners.append(make_runner(*args)) or runners[-1])
    out = run(tiny_dir, PROMPT, "--chat", "--backend", "ort-cpu", "--low-memory")
    assert out.exit_code == 0, out.output
    assert [r.low_memory for r in runners] == [True]


def test_verify_reads_every_files_sha256(tiny_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    size = (broken / "tokenizer.json").stat().st_size  # same size, other bytes: only the sha256 tells
    (broken / "tokenizer.json").write_bytes(b" " * size)
    out = run(broken, PROMPT, "--chat", "--backend", "ort-cpu", "--verify")
    assert out.exit_code == 1 and "tokenizer.json has sha256" in out.stderr, out.output
    unverified = run(broken, PROMPT, "--chat", "--backend", "ort-cpu")  # found only when the tokenizer parses it
    assert unverified.exit_code == 1 and "tokenizer.json' is corrupt" in unverified.stderr, unverified.output


def test_json_carries_the_finish_reason(tiny_dir):
    data = json.loads(run(tiny_dir, PROMPT, "--chat", "--json").stdout)
    with generator.Generator.from_dir(tiny_dir, backend="ort-cpu") as gen:
        result = gen.generate(PROMPT, chat=True)
    assert data["finish_reason"] == result.finish_reason and data["token_ids"] == result.token_ids
    cut = json.loads(run(tiny_dir, "--prompt-ids", "5,6,7", "--mode", "ar", "--gen-length", "2", "--json").stdout)
    assert cut["finish_reason"] in ("length", "eos") and len(cut["token_ids"]) <= 2


def test_a_dash_reads_the_prompt_from_stdin(tiny_dir):
    given = run(tiny_dir, PROMPT, "--chat", "--json")
    piped = CliRunner().invoke(cli, ["generate", str(tiny_dir), "-", "--chat", "--json"], input=f"{PROMPT}\n")
    assert piped.exit_code == 0, piped.output
    assert json.loads(piped.stdout)["prompt_ids"] == json.loads(given.stdout)["prompt_ids"]  # the newline dropped
    bad = CliRunner().invoke(cli, ["generate", str(tiny_dir), "-"], input=b"sort: \xff 3\n")
    assert bad.exit_code == 1 and "error: the prompt on stdin is not UTF-8 text: byte 0xff at offset 6" in bad.stderr
    assert "PROMPT - reads the prompt from stdin" in " ".join(CliRunner().invoke(cli, ["generate", "--help"]).stdout.split())


def test_no_prompt_is_refused_before_anything_loads(tmp_path):
    out = run(tmp_path / "not-even-there")
    assert out.exit_code == 1
    assert "error: give a PROMPT (or - to read it from stdin) or --prompt-ids 1,2,3, not both." in out.stderr


def test_the_banner_names_the_int4_quantization(tiny_dir, tmp_path):
    from refusion.export.quantize import QuantizeOptions

    int4 = export_onnx(EMBEDDED_MODEL, tmp_path / "int4", validate=False, quantize=QuantizeOptions("int4-rtn"))
    out = run(int4, PROMPT, "--chat", "--backend", "ort-cpu")
    assert out.exit_code == 0, out.output
    assert f"ort-cpu: {int4} (float32, int4-rtn block 64)" in out.stderr
    assert f"ort-cpu: {tiny_dir} (float32)\n" in run(tiny_dir, PROMPT, "--chat", "--backend", "ort-cpu").stderr


def test_errors_say_which_directory_to_pass(tiny_dir, tmp_path):
    out = run(EMBEDDED_MODEL, PROMPT, "--chat")  # a checkpoint, not an export
    assert out.exit_code == 1
    assert (f"is not a refusion export: refusion.json is missing. It is a checkpoint (config.json): export it first "
            f"with `refusion-export onnx {EMBEDDED_MODEL} --output out/refusion-tiny-onnx`, then pass "
            "out/refusion-tiny-onnx.") in out.stderr
    trt = run(tiny_dir, PROMPT, "--chat", "--backend", "trt")
    if "needs TensorRT" not in trt.stderr:  # with TensorRT importable, the engines are what is missing
        assert (f"error: {tiny_dir} holds no TensorRT engines (engines.json is missing): it is an export. Build them "
                f"with `refusion-export build {tiny_dir} --output {tiny_dir.parent / 'engines'}` and pass "
                f"{tiny_dir.parent / 'engines'}") in trt.stderr
    parent = tmp_path / "demo"  # `refusion-export demo` leaves its export one level down, in out/demo/onnx
    shutil.copytree(tiny_dir, parent / "onnx")
    out = run(parent, PROMPT, "--chat")
    assert f"error: {parent} is not a refusion export: refusion.json is missing. {parent / 'onnx'} is an export: " \
           "pass it." in out.stderr


def test_guides_on_the_command_line(tiny_dir, tmp_path):
    schema = tmp_path / "robot.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"action": {"enum": ["left", "right"]}},
                                  "required": ["action"], "additionalProperties": False}))
    out = run(tiny_dir, PROMPT, "--chat", "--json-schema", schema, "--backend", "ort-cpu")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["action"] in ("left", "right")
    out = run(tiny_dir, PROMPT, "--chat", "--regex", r"\d( \d)+", "--mode", "ar", "--backend", "ort-cpu")
    assert out.exit_code == 0 and re.fullmatch(r"\d( \d)+", out.stdout.strip()), out.output
    out = run(tiny_dir, PROMPT, "--chat", "--choice", "1 2 3", "--choice", "3 2 1", "--stream", "--backend", "ort-cpu")
    assert out.exit_code == 0 and out.stdout.strip() in ("1 2 3", "3 2 1"), out.output
    grammar = tmp_path / "yes.lark"
    grammar.write_text('start: "yes" | "no"\n')
    out = run(tiny_dir, PROMPT, "--chat", "--grammar", grammar, "--backend", "ort-cpu")
    assert out.exit_code == 0 and out.stdout.strip() in ("yes", "no"), out.output


@pytest.mark.parametrize("args, message", [
    (("--regex", "(a"), "error: regex is not a guide llguidance can enforce"),
    (("--json-schema", "missing.json"), "error: --json-schema missing.json: cannot read it as UTF-8 text"),
    (("--regex", "a", "--choice", "b"), "error: regex and choice both ask for structured output"),
])
def test_a_guide_that_cannot_be_enforced_is_refused(tiny_dir, args, message):
    out = run(tiny_dir, PROMPT, "--chat", *args)
    assert out.exit_code == 1 and message in out.output, out.output


def test_a_schema_file_nested_too_deep_is_one_error_line(tiny_dir, tmp_path):
    """The probe's X9: a --json-schema file 3,000 deep printed a 47-line RecursionError traceback."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 3000 + "]" * 3000)
    out = run(tiny_dir, PROMPT, "--chat", "--json-schema", deep)
    assert out.exit_code == 1 and isinstance(out.exception, SystemExit), out.exception  # no traceback: a refusal
    assert out.stderr.splitlines() == [
        "error: json_schema nests 3000 deep, over the limit of 32 (a guide is bounded); give a flatter one: a schema "
        "can name a part once in $defs and use it by $ref."], out.output
    assert out.stdout == ""
