"""The public runtime: Generator, streaming, KV memory, bad input, and the refusion-run CLI."""

from __future__ import annotations

import json
import shutil
import tracemalloc

import numpy as np
import pytest
from click.testing import CliRunner

from refusion.export.exporter import export_onnx
from refusion.models import EMBEDDED_MODEL
from refusion.runtime.core.errors import ContextLengthError, RefusionError
from refusion.runtime.generator import Generator
from refusion.runtime.params import DecodeParams
from refusion.runtime.tokenizer import Tokenizer
from refusion.tools.run_cli import cli
from tests.helpers import export_peaky

SMALL = dict(gen_length=32, slot_size=4, serial_num_blocks=2, slot_threshold=0.6, token_threshold=0.3)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    return export_peaky(tmp_path_factory.mktemp("gen"), seed=0)[1]


@pytest.fixture(scope="module")
def gen(export_dir):
    with Generator.from_dir(export_dir, backend="ort-cpu", threads=1) as g:
        yield g


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The embedded model's export: 512 positions, recorded defaults gen_length 64, slot_size 4."""
    return export_onnx(EMBEDDED_MODEL, tmp_path_factory.mktemp("tiny") / "onnx", validate=False)


def test_no_decode_settings_take_the_exports_recorded_defaults(tiny_dir):
    with Generator.from_dir(tiny_dir, backend="ort-cpu", threads=1) as tiny:
        # the paper's bare gen_length 512 would leave a prompt no room in the 512 positions
        assert tiny.params() == DecodeParams(gen_length=64, slot_size=4, serial_num_blocks=4, slot_threshold=0.5,
                                             token_threshold=0.1)
        assert tiny.params(gen_length=None, slot_size=8, mode="ar") == DecodeParams(64, 8, 4, 0.5, 0.1, mode="ar")
        res = tiny.generate("sort: 8 2 7 9 2 6", chat=True)
        assert res.text and res.finish_reason == "eos" and tiny.manifest.eos_token_id not in res.token_ids
        assert "".join(tiny.stream("sort: 8 2 7 9 2 6", chat=True)) == res.text


def test_text_stops_before_the_eos_even_when_the_tokenizer_would_show_it(tiny_dir, tmp_path):
    """A tokenizer that flags no token special (as some checkpoints ship) still never shows the EOS."""
    raw = json.loads((tiny_dir / "tokenizer.json").read_text())
    for token in raw["added_tokens"]:
        token["special"] = False
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_dir / name, tmp_path)
    with Generator.from_dir(tiny_dir, backend="ort-cpu", threads=1) as tiny:
        tiny.tokenizer = Tokenizer.from_dir(tmp_path)
        eos = tiny.manifest.eos_token_id
        assert tiny.tokenizer.decode([eos]) == "<|im_end|>"
        res = tiny.generate("sort: 8 2 7 9 2 6", chat=True)
        assert eos in res.committed_ids and res.text and "<|im_end|>" not in res.text
        assert "".join(tiny.stream("sort: 8 2 7 9 2 6", chat=True)) == res.text


def test_generate_reports_truthful_stats(gen):
    res = gen.generate(prompt_ids=[5, 17, 42], **SMALL)
    s = res.stats
    assert len(res.token_ids) == 32 and len(res.steps) == 32
    assert s.forward_count == sum(s.forwards.values()) > 0
    assert s.tokens_per_forward == pytest.approx(s.tokens / s.forward_count)
    assert s.wall_seconds == pytest.approx(s.runner_seconds + s.loop_seconds)
    assert 0 < s.runner_seconds < s.wall_seconds
    ar = gen.generate(prompt_ids=[5, 17, 42], gen_length=32, mode="ar")
    assert ar.stats.forwards == {"prefill": 1, "decode": len(ar.token_ids) - 1}


def test_ar_mode_checks_its_own_length_without_slot_padding(gen):
    ar = dict(gen_length=30, slot_size=32, serial_num_blocks=3, mode="ar")  # slot layout irrelevant to AR
    assert len(gen.generate(prompt_ids=[5] * 482, **ar).token_ids) == 30  # 482 + 30 = 512 positions
    with pytest.raises(RefusionError, match=r"maximum context length is 512 tokens\. However, you requested 513 tokens "
                                            r"\(483 in the prompt, 30 in the completion\)"):
        gen.generate(prompt_ids=[5] * 483, **ar)


def test_stream_yields_settled_text_in_order(gen):
    messages = [{"role": "user", "content": "The quick brown fox"}]
    final = gen.generate(messages=messages, **SMALL).text
    pieces = list(gen.stream(messages=messages, **SMALL))
    assert "".join(pieces) == final and len(pieces) > 1
    shown = ""
    for piece in pieces:
        shown += piece
        assert final.startswith(shown)


def test_chat_prompt_uses_the_template(gen):
    ids = gen.prompt_ids("hello", chat=True)
    assert ids == gen.tokenizer.encode(gen.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}]))


def test_kv_memory_is_prefix_plus_slots_never_a_copy_per_slot(gen):
    """n slots over a P-token prefix: one cache of P + gen + block tokens; every past is a view of it."""
    prompt = list(np.random.default_rng(0).integers(0, 300, 400))
    params = dict(gen_length=64, slot_size=4, serial_num_blocks=1, slot_threshold=0.0, token_threshold=1.0)
    runner = gen.runner
    pasts: list[tuple[int, int]] = []
    original = runner._run

    def spy(graph, rows):
        pasts.extend((r.past, r.input_ids.shape[1]) for r in rows)
        return original(graph, rows)

    runner._run = spy
    tracemalloc.start()
    try:
        res = gen.generate(prompt_ids=prompt, **params)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        del runner._run
    per_token = runner.kv_bytes_per_token
    capacity = 400 + 64 + 64
    assert runner.kv_bytes - gen.prefix_cache.reserved_bytes == capacity * per_token  # the request's region
    assert res.stats.forwards["infill_draft"] > 0  # the n-row infill really ran
    rows = 64 // 4  # slot_threshold 0: every slot of the block is chosen
    assert max(p + s for p, s in pasts) <= capacity
    per_slot_copy = rows * 400 * per_token  # what repeating the prefix's KV per row would hold
    assert peak < per_slot_copy / 2, f"traced peak {peak} B vs per-slot prefix copies {per_slot_copy} B"


@pytest.mark.parametrize("call, fragment", [
    (lambda g: g.generate(prompt_ids=[], **SMALL), "prompt is empty"),
    (lambda g: g.generate("", **SMALL), "prompt is empty"),
    (lambda g: g.generate(prompt_ids=[1] * 500, **SMALL), "maximum context length is 512 tokens"),
    (lambda g: g.generate(prompt_ids=[1, 2], **{**SMALL, "serial_num_blocks": 3}), "serial_num_blocks may be one of"),
    (lambda g: g.generate(prompt_ids=[1, 2], **{**SMALL, "token_threshold": 2.0}), "outside [0, 1]"),
    (lambda g: g.generate(prompt_ids=[1, 99999], **SMALL), "outside the vocabulary"),
    (lambda g: g.generate(prompt_ids=[1, 2], **{**SMALL, "temperature": 0.7, "top_k": 65}),
     "top_k=65 exceeds the 64 candidates this export's graphs emit; lower top_k, or re-export with"),
    (lambda g: g.generate(prompt_ids=[1, 2], **{**SMALL, "top_p": -0.1}), "top_p=-0.1 is outside [0, 1]"),
    (lambda g: g.generate(prompt_ids=[1, 2], **{**SMALL, "min_p": 1.0}), "min_p=1.0 is outside [0, 1) (0: no cut)"),
    (lambda g: g.generate(prompt_ids=[1, 2], chat=True, **SMALL),
     "chat=True does not combine with prompt_ids: token ids are fed exactly as given, without the chat template"),
    (lambda g: g.generate(prompt_ids=[1, 3.7], **SMALL), "prompt_ids[1]=3.7 is not an integer token id"),
    (lambda g: g.generate(prompt_ids=[1, 2.5], **SMALL), "prompt_ids[1]=2.5 is not an integer token id"),
    (lambda g: g.generate(prompt_ids=[True], **SMALL), "prompt_ids[0]=True is not an integer token id"),
    (lambda g: g.generate(prompt_ids="1,2", **SMALL), "prompt_ids='1,2' is not a list of integer token ids"),
    (lambda g: g.generate(prompt=123, **SMALL), "prompt=123 is not a string"),
    (lambda g: g.generate(messages="hi", **SMALL),
     "messages='hi' is not a list of {'role': ..., 'content': ...} dicts"),
    (lambda g: g.generate(messages=[{"role": "user"}], **SMALL), "is not a list of {'role'"),
    (lambda g: g.generate(prompt_ids=[1, 2], unknown_setting=1, **SMALL),
     "unknown setting unknown_setting=1; the decode settings are gen_length, slot_size"),
    (lambda g: g.generate(prompt_ids=[1, 2], stop=[""], **SMALL), "stop=[''] holds ''; each must be a non-empty string"),
    (lambda g: g.generate(prompt_ids=[1, 2], stop=3, **SMALL), "stop=3 must be a string or a list of non-empty strings"),
    (lambda g: g.generate(prompt_ids=[1, 2], stop_token_ids=[99999], **SMALL), "stop token id 99999 is outside"),
    (lambda g: g.generate(prompt_ids=[1, 2], stop_token_ids=[-1], **SMALL), "stop_token_ids=[-1] holds -1; it must be a list of integers >= 0"),
    (lambda g: g.generate(prompt_ids=[1, 2], **{**SMALL, "gen_length": "64"}), "gen_length='64' must be a positive"),
    (lambda g: g.generate(prompt_ids=[1, 2], **{**SMALL, "temperature": float("nan")}), "temperature=nan must be"),
    (lambda g: next(g.stream(prompt_ids=[1, 2], chat=True, **SMALL)), "chat=True does not combine with prompt_ids"),
])
def test_bad_requests_fail_clearly_and_leave_the_generator_usable(gen, call, fragment):
    with pytest.raises(RefusionError) as err:
        call(gen)
    assert fragment in str(err.value)
    assert len(gen.generate(prompt_ids=[5, 17, 42], **SMALL).token_ids) == 32


def test_numpy_prompt_ids_are_fine(gen):
    ids = np.array([5, 17, 42], dtype=np.int64)
    assert gen.generate(prompt_ids=ids, **SMALL).prompt_ids == [5, 17, 42]


@pytest.mark.parametrize("threads", [0, -1])
def test_threads_must_be_positive(export_dir, threads):
    with pytest.raises(RefusionError, match=f"threads={threads} \\(--threads\\) is not a positive number of "
                                            "onnxruntime threads; give 1 or more, or leave it out to use every core."):
        Generator.from_dir(export_dir, backend="ort-cpu", threads=threads)


def test_low_memory_turns_off_the_arena_on_onnxruntime_only(export_dir):
    with Generator.from_dir(export_dir, backend="ort-cpu", threads=1, low_memory=True) as g:
        options = g.runner.sessions["planner"].get_session_options()
        assert not options.enable_cpu_mem_arena
        assert len(g.generate(prompt_ids=[5, 17, 42], **SMALL).token_ids) == 32
    with pytest.raises(RefusionError, match="low_memory=True \\(--low-memory\\) is an onnxruntime option .* "
                                            "does not apply to the trt backend; drop it, or choose --backend"):
        Generator.from_dir(export_dir, backend="trt", low_memory=True)


def test_unknown_and_unavailable_backends_name_the_fix(export_dir):
    with pytest.raises(RefusionError, match="backend 'tpu' is unknown"):
        Generator.from_dir(export_dir, backend="tpu")
    with pytest.raises(RefusionError, match=r"refusion-trt\[ort-gpu\]"):
        Generator.from_dir(export_dir, backend="ort-cuda")


def test_not_an_export_and_corrupt_graph(tmp_path, export_dir):
    with pytest.raises(RefusionError, match="refusion.json is missing"):
        Generator.from_dir(tmp_path, backend="ort-cpu")
    broken = tmp_path / "broken"
    shutil.copytree(export_dir, broken)
    (broken / "infiller.onnx").write_bytes(b"not a protobuf")
    with pytest.raises(RefusionError, match=r"infiller.onnx has 14 bytes, \d+ recorded \(truncated or replaced\)"):
        Generator.from_dir(broken, backend="ort-cpu")
    size = (export_dir / "infiller.onnx").stat().st_size  # same size, not a graph: only onnxruntime can tell
    (broken / "infiller.onnx").write_bytes(b"\xff" * size)
    with pytest.raises(RefusionError, match="infiller.onnx could not be loaded by onnxruntime"):
        Generator.from_dir(broken, backend="ort-cpu")
    with pytest.raises(RefusionError, match=r"infiller.onnx has sha256 .* recorded \(modified or damaged\)"):
        Generator.from_dir(broken, backend="ort-cpu", verify=True)
    (broken / "planner.onnx").unlink()
    with pytest.raises(RefusionError, match="planner.onnx is missing"):
        Generator.from_dir(broken, backend="ort-cpu")


def test_cli_generate_json_and_errors(export_dir):
    runner = CliRunner()
    args = ["generate", str(export_dir), "--prompt-ids", "5,17,42", "--gen-length", "32", "--slot-size", "4",
            "--serial-num-blocks", "2", "--backend", "ort-cpu", "--json"]
    out = runner.invoke(cli, args)
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert len(data["token_ids"]) == 32 and data["stats"]["forward_count"] > 0
    ar = json.loads(runner.invoke(cli, args + ["--mode", "ar"]).stdout)
    assert ar["stats"]["mode"] == "ar"
    bad = runner.invoke(cli, args[:-1] + ["--slot-threshold", "3"])
    assert bad.exit_code == 1 and "slot_threshold=3.0 is outside [0, 1]" in bad.stderr
    bad = runner.invoke(cli, ["generate", str(export_dir), "--prompt-ids", "1,x"])
    assert bad.exit_code == 1 and "--prompt-ids" in bad.stderr
    text = runner.invoke(cli, ["generate", str(export_dir), "Hello", "--chat", "--stream", "--gen-length", "16",
                               "--slot-size", "4", "--serial-num-blocks", "1", "--backend", "ort-cpu"])
    assert text.exit_code == 0, text.output


@pytest.mark.parametrize("call", [
    lambda g: g.generate("sort: \udcff 3", **SMALL),  # what Python makes of the byte 0xff in argv or stdin
    lambda g: g.generate("sort: \ud800 3", chat=True, **SMALL),
    lambda g: g.generate(messages=[{"role": "system", "content": "\udcff"}, {"role": "user", "content": "hi"}],
                         **SMALL),
])
def test_text_that_is_not_utf8_is_refused_as_such(gen, call):
    with pytest.raises(RefusionError, match=r"the prompt is not valid text: character \d+ is a lone surrogate"):
        call(gen)


def test_a_prompt_too_long_in_bytes_is_refused_before_it_is_tokenized(export_dir, monkeypatch):
    with Generator.from_dir(export_dir, backend="ort-cpu", threads=1) as g:
        tok = g.tokenizer
        # The bound holds for the worst text: the longest vocabulary entry at every position.
        longest = max(tok._backend.get_vocab(), key=lambda t: len(t.encode()))
        assert len((longest * g.manifest.max_positions).encode()) <= g.max_prompt_bytes
        monkeypatch.setattr(tok, "encode", lambda text: pytest.fail("an over-long prompt was tokenized"))
        monkeypatch.setattr(tok, "apply_chat_template", lambda *a, **k: pytest.fail("an over-long prompt was rendered"))
        over = "ab" * (g.max_prompt_bytes // 2 + 1)
        for call in (lambda: g.generate(over, **SMALL), lambda: g.generate(over, chat=True, **SMALL),
                     lambda: g.generate(messages=[{"role": "user", "content": over}], **SMALL)):
            with pytest.raises(ContextLengthError, match=rf"maximum context length is {g.manifest.max_positions} "
                                                         rf"tokens\. However, the prompt is {len(over)} bytes of UTF-8.*"
                                                         rf"no text over {g.max_prompt_bytes} bytes fits the model's"):
                call()


def test_cli_generate_refuses_a_prompt_that_is_not_utf8_in_one_line(export_dir):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "refusion.tools.run_cli", "generate", str(export_dir).encode(),
                           b"sort: \xff 3", b"--backend", b"ort-cpu"], capture_output=True)
    assert done.returncode == 1 and done.stdout == b""
    last = done.stderr.decode().splitlines()[-1]
    assert last.startswith("error: the prompt is not valid text: character 6 is a lone surrogate")
    assert b"Traceback" not in done.stderr
