"""The served tensors, the server's settings and the launcher's checks: no Triton needed."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from refusion.runtime.core.errors import RefusionError
from refusion.serve.triton import launcher
from refusion.serve.triton.launcher import Ports, TritonInstall, TritonServer
from refusion.serve.triton.settings import SETTINGS_FILE, ServeSettings
from refusion.serve.triton.tensors import INPUTS, OUTPUTS, config_pbtxt, read_json, read_request
from refusion.tools.run_cli import cli


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def test_a_full_request_reads_into_prompt_and_settings():
    job = read_request({
        "text_input": text("héllo"), "max_tokens": np.array([[64]], dtype=np.int32), "stream": np.array([True]),
        "chat": np.array([True]), "mode": text("ar"), "slot_size": np.array([8], np.int32),
        "serial_num_blocks": np.array([2], np.int32), "slot_threshold": np.array([0.9], np.float32),
        "token_threshold": np.array([0.3], np.float32), "temperature": np.array([0.0], np.float32),
        "seed": np.array([7], np.int64), "timeout_s": np.array([2.5], np.float32),
        "stop_words": np.array([b"\n\n", "User:".encode()], dtype=np.object_),
        "stop_token_ids": np.array([5, 9], np.int32), "gen_length": np.array([32], np.int32),
        "top_k": np.array([40], np.int32), "top_p": np.array([0.9], np.float32), "min_p": np.array([0.05], np.float32),
        "return_log_probs": np.array([True])})
    assert (job.prompt, job.stream, job.chat) == ("héllo", True, True)
    # float32 thresholds arrive as the decimals the client wrote, not 0.8999999761...
    assert job.settings == {"max_tokens": 64, "stop": ["\n\n", "User:"], "stop_token_ids": [5, 9], "mode": "ar",
                            "slot_size": 8, "serial_num_blocks": 2, "slot_threshold": 0.9, "token_threshold": 0.3,
                            "gen_length": 32, "temperature": 0.0, "top_k": 40, "top_p": 0.9, "min_p": 0.05,
                            "logprobs": True, "seed": 7, "timeout_s": 2.5}  # a setting like the others
    assert all(type(v) in (int, float, str, bool) or isinstance(v, list) for v in job.settings.values())
    assert read_request({"text_input": text("hi"), "stop_words": np.array([], dtype=np.object_)}).settings == {"stop": []}


def test_settings_left_out_are_left_to_the_export():
    job = read_request({"text_input": text("hi")})
    assert (job.stream, job.chat, job.settings) == (False, False, {})


@pytest.mark.parametrize("tensors, message", [
    ({"max_tokens": np.array([8], np.int32)}, "text_input is missing"),
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "text_input holds 2 values"),
    ({"text_input": text("hi"), "max_tokens": np.array([8.0], np.float32)}, "max_tokens is float32"),
    ({"text_input": text("hi"), "stream": text("yes")}, "stream is object"),
    ({"text_input": np.array([1], np.int32)}, "text_input is int32"),
    ({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, "text_input is not valid UTF-8"),
    ({"text_input": text("hi"), "slot_size": np.array([], np.int32)}, "slot_size holds 0 values"),
    ({"text_input": text("hi"), "stop_words": np.array([1, 2], np.int32)}, "stop_words is int32"),
])
def test_bad_tensors_are_refused_naming_the_tensor(tensors, message):
    with pytest.raises(RefusionError, match=message):
        read_request(tensors)


def test_the_config_is_a_valid_triton_model_config():
    pytest.importorskip("tritonclient.grpc", reason="the serve extra's tritonclient carries Triton's config proto")
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(config_pbtxt("refusion"), model_config_pb2.ModelConfig())
    assert config.backend == "python" and config.max_batch_size == 0
    assert config.model_transaction_policy.decoupled
    assert [i.name for i in config.input] == [s.name for s in INPUTS]
    assert [i.name for i in config.input if not i.optional] == ["text_input"]
    assert [o.name for o in config.output] == [s.name for s in OUTPUTS]
    assert not config.parameters  # clients may read the config: no host path in it


def test_settings_travel_in_a_file_beside_the_model(tmp_path):
    settings = ServeSettings('/models/a "quoted" dir', "ort-cpu", threads=2, max_queue=5, work_dir="/w",
                             launcher_pid=7)
    settings.write(tmp_path / SETTINGS_FILE)
    assert ServeSettings.read(tmp_path / SETTINGS_FILE) == settings
    assert settings.drain_file == Path("/w/drain")


@pytest.mark.parametrize("text, message", [
    ("{", "cannot be read"), ("[]", "not a settings file"), ('{"threads": 2}', "not a settings file"),
    ('{"model_dir": "x", "colour": 1}', "not a settings file"), ('{"model_dir": "x", "max_queue": -1}', "max_queue=-1"),
])
def test_settings_refuse_a_bad_file(tmp_path, text, message):
    (tmp_path / SETTINGS_FILE).write_text(text)
    with pytest.raises(RefusionError, match=message):
        ServeSettings.read(tmp_path / SETTINGS_FILE)


def test_a_json_body_is_read_against_the_tensors():
    body = {"text_input": "hi", "max_tokens": 8, "stream": True, "slot_threshold": 0.5, "seed": 2**40, "mode": "ar"}
    assert read_json(body, streaming=True) == body
    assert read_json({"text_input": "hi", "temperature": 1}, streaming=False)["temperature"] == 1


@pytest.mark.parametrize("body, message", [
    ({"text_input": "hi", "max_token": 5}, "'max_token' is not an input of this model; did you mean 'max_tokens'?"),
    ({"text_input": "hi", "foo": 1}, "'foo' is not an input of this model; it takes text_input, stream, chat, gen_length"),
    ({"max_tokens": 5}, "text_input is missing"),
    ({"text_input": "hi", "stream": True}, '"stream": true needs generate_stream'),
    ({"text_input": "hi", "max_tokens": 2**31}, r"max_tokens=2147483648 does not fit TYPE_INT32 \[-2147483648, 2147483647\]"),
    ({"text_input": "hi", "seed": 2**64 - 1}, "seed=18446744073709551615 does not fit TYPE_INT64"),
    ({"text_input": "hi", "max_tokens": "64"}, "max_tokens is a JSON str"),
    ({"text_input": "hi", "max_tokens": 64.5}, "max_tokens is a JSON float"),
    ({"text_input": "hi", "max_tokens": True}, "max_tokens is a JSON bool"),
    ({"text_input": "hi", "chat": "yes"}, "chat is a JSON str"),
    ({"text_input": "hi", "chat": 1}, "chat is a JSON int"),
    ({"text_input": None}, "text_input is a JSON NoneType"),
    ({"text_input": 5}, "text_input is a JSON int"),
    ({"text_input": {"a": 1}}, "text_input is a JSON dict"),
    ({"text_input": ["hi"]}, "text_input is a JSON list"),
    ({"text_input": "hi", "temperature": 1e39}, r"temperature=1e\+39 is not a finite float32"),
    ({"text_input": "a\udcffb"}, "text_input holds a lone surrogate"),
])
def test_a_bad_json_body_is_refused_naming_the_field(body, message):
    with pytest.raises(RefusionError, match=message):
        read_json(body, streaming=False)


@pytest.mark.parametrize("make, message", [
    (lambda d: Ports(8000, 8000, 8002), "the ports must differ"),
    (lambda d: Ports(0, 8001, 8002), "--http-port 0 is not a TCP port"),
    (lambda d: TritonServer(d, model_name="../x"), "--model-name '../x'"),
    (lambda d: TritonServer(d, drain_timeout_s=-1), "--drain-timeout -1"),
])
def test_launcher_arguments_are_checked(tmp_path, make, message):
    with pytest.raises(RefusionError, match=message):
        make(tmp_path)


def test_a_directory_without_an_export_fails_before_triton_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(TritonInstall, "find", lambda: pytest.fail("Triton looked up before the export was checked"))
    with pytest.raises(RefusionError, match="refusion.json"):
        TritonServer(tmp_path).start()


def test_missing_triton_or_stub_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RefusionError, match=r"pip install -e '\.\[serve\]'"):
        TritonInstall.find()
    package = tmp_path / "pytriton"
    (package / "tritonserver" / "python_backend_stubs" / "3.9").mkdir(parents=True)
    found = SimpleNamespace(submodule_search_locations=[str(package)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: found)
    with pytest.raises(RefusionError, match=r"no Triton Python-backend stub for Python 3\.\d+ \(it has 3\.9\)"):
        TritonInstall.find()


def test_serve_cli_reports_a_bad_directory_in_one_line(tmp_path):
    for api in ("triton", "openai"):
        result = CliRunner().invoke(cli, ["serve", str(tmp_path), "--api", api, "--http-port", "18000"])
        assert result.exit_code == 1 and result.output.startswith("error: ") and "refusion.json" in result.output
    help_text = CliRunner().invoke(cli, ["serve", "--help"]).output
    for flag in ("--api", "--model-name", "--http-port", "--grpc-port", "--metrics-port", "--max-batch", "--max-queue",
                 "--backend", "--drain-timeout"):
        assert flag in help_text


def test_the_repository_holds_our_model_and_the_stub(tmp_path):
    install = TritonInstall(Path("/x/tritonserver"), tmp_path / "backend", tmp_path / "stub", tmp_path / "libs")
    install.python_backend.mkdir()
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        (install.python_backend / name).write_text(name)
    install.stub.write_text("stub")
    models, backends = launcher.write_repository(tmp_path / "root", "m", ServeSettings("/e"), install)
    assert "from refusion.serve.triton.model import TritonPythonModel" in (models / "m" / "1" / "model.py").read_text()
    assert "/e" not in (models / "m" / "config.pbtxt").read_text()
    assert ServeSettings.read(models / "m" / "1" / SETTINGS_FILE) == ServeSettings("/e")
    assert (backends / "python" / "triton_python_backend_stub").read_text() == "stub"
    assert json.dumps(sorted(p.name for p in (backends / "python").iterdir())) == json.dumps(
        ["libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"])


def test_runner_options_are_checked_before_triton_starts(served_export, monkeypatch):
    monkeypatch.setattr(TritonInstall, "find", lambda: pytest.fail("Triton looked up before the options were checked"))
    for api in ("triton", "openai"):
        result = CliRunner().invoke(cli, ["serve", str(served_export), "--api", api, "--backend", "ort-cpu",
                                          "--max-requests", "4", "--max-batch", "32"])
        assert result.exit_code == 1
        assert result.output == "error: max_batch=32 exceeds max_requests=4: a forward packs requests in flight; " \
                                "raise max_requests or lower max_batch.\n"


def test_the_guides_are_inputs_and_one_the_engine_cannot_enforce_is_refused_before_any_work(tiny_export):
    """json_schema (its JSON text), regex, choice (a list) and grammar read into the settings; Triton's model submits
    them through the frontend, which refuses what cannot be enforced (a 400, INVALID_ARGUMENT)."""
    pytest.importorskip("llguidance")
    from refusion.runtime.generator import Generator
    from refusion.serve.frontend import Frontend

    job = read_request({"text_input": text("sort: 3 1 2"), "chat": np.array([True]),
                        "json_schema": text('{"type": "array", "items": {"type": "integer"}}'),
                        "choice": np.array([b"a", "b".encode()], dtype=np.object_)})
    assert job.settings == {"json_schema": '{"type": "array", "items": {"type": "integer"}}', "choice": ["a", "b"]}
    assert read_json({"text_input": "hi", "regex": r"\d+", "grammar": 'start: "a"', "choice": ["x", "y"]},
                     streaming=False)["choice"] == ["x", "y"]
    with Generator.from_dir(tiny_export, backend="ort-cpu", threads=1) as gen:
        frontend = Frontend(gen, max_queue=2)
        for settings, message in (({"json_schema": '{"type": "integer"}', "choice": ["1"]}, "both ask"),
                                  ({"regex": "(a"}, "regex is not a guide")):
            assert frontend.admit() is None
            with pytest.raises(RefusionError, match=message):
                frontend.submit(replace(job, settings=settings), handle=None)
        assert frontend.metrics().requests_in_flight == 0 and gen.scheduler.in_flight == 0
        assert frontend.admit() is None
        request = frontend.submit(replace(job, settings={"json_schema": job.settings["json_schema"]}), handle=None)
        finals: list = []
        frontend.respond(request, False, lambda piece: None, finals.append)
        assert isinstance(json.loads(finals[0].result.text), list)
        frontend.close(5)
