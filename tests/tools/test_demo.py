"""`refusion-export demo`: the README's main job, on the embedded model."""

from __future__ import annotations

import json

from click.testing import CliRunner

from refusion.models import EMBEDDED_MODEL
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.request import GenerationResult
from refusion.runtime.runners import available_backend
from refusion.tools import demo, families
from refusion.tools.export_cli import cli


def test_embedded_model_ships_with_the_repo():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (EMBEDDED_MODEL / name).is_file(), name
    size = sum(f.stat().st_size for f in EMBEDDED_MODEL.iterdir())
    assert size <= 20 * 2**20


def test_demo_runs_and_draws_the_decode(tmp_path, monkeypatch):
    rows: list[demo.DemoRow] = []
    run = demo.run_demo
    monkeypatch.setattr(demo, "run_demo", lambda *args: rows.extend(run(*args)))
    result = CliRunner().invoke(cli, ["demo", "--output", str(tmp_path), "--threads", "2"])
    assert result.exit_code == 0, result.output
    # both timed decodes of a prompt read it from the prefix cache alike: neither pays a prefill the other is spared
    assert len(rows) == 6 and all(r.refusion.stats.cached_prompt_tokens == r.ar.stats.cached_prompt_tokens > 0
                                  for r in rows), [(r.refusion.stats.cached_prompt_tokens, r.ar.stats.cached_prompt_tokens) for r in rows]
    out = result.stdout
    assert "ReFusion / AR:" in out and "tokens/forward" in out
    page = (tmp_path / "decode.html").read_text()
    assert page.count("<h3>") == 6 and "iteration" in page
    for case in demo.demo_cases():  # every row shown, the structured ones labelled with their guide
        assert f"\n{case.title}\n" in out and case.title in page
    robot, tool = demo.demo_cases()[-2:]
    assert robot.title.startswith("robot command (json_schema ROBOT_SCHEMA): ")
    assert tool.title.startswith(f"tool call (tool_choice {demo.TOOL_CHOICE}; tools ")
    assert out.count(" tokens/forward, ") == 2 * 6  # ReFusion and AR, each row
    assert "/6\n" in out  # the summary counts all six answers, per mode
    assert "im_end" not in out and "im_end" not in page  # answers end before the EOS, special tokens not shown
    for step in ("[1/4]", "[2/4]", "[3/4]", "[4/4]", "prompt 6/6"):
        assert step in result.stderr
    # on onnxruntime's CPU the demo exports the fused-op graphs (results/cpu-forward: faster, the same tokens)
    cpu = available_backend(tmp_path / "onnx") == "ort-cpu"
    assert ExportManifest.read(tmp_path / "onnx").ops == ("onnxruntime" if cpu else "standard")


def test_demo_cases_are_fixed_held_out_examples():
    cases = demo.demo_cases()
    assert [c.example.task for c in cases] == [*demo.DEMO_TASKS, "robot", "tool"]
    robot, tool = cases[-2:]
    assert robot.example == families.held_out("robot", demo.ROBOT_EXAMPLE + 1)[-1]
    assert robot.request == {"json_schema": families.ROBOT_SCHEMA}
    assert tool.example == families.held_out("tool", demo.TOOL_EXAMPLE + 1)[-1] and tool.example.call is not None
    assert tool.request == {"tools": list(tool.example.tools), "tool_choice": demo.TOOL_CHOICE}


def _result(text: str, *calls: tuple[str, str]) -> GenerationResult:
    tool_calls = [{"id": "call_0", "type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return GenerationResult(text, [], [], None, [], tool_calls=tool_calls or None)  # type: ignore[arg-type]


def test_an_answer_is_judged_by_its_call_its_json_or_its_text():
    robot, tool = demo.demo_cases()[-2:]
    assert tool.example.call is not None
    name, arguments = tool.example.call
    assert families.correct(tool.example, _result("", (name, json.dumps(arguments, indent=1))))  # the call's value
    assert not families.correct(tool.example, _result(tool.example.answer))  # the call's text, not read as a call
    assert not families.correct(tool.example, _result("", (name, "{")))  # arguments cut short
    assert not families.correct(tool.example, _result("", (name, json.dumps(arguments)), (name, json.dumps(arguments))))
    command = json.loads(robot.example.answer)
    assert families.correct(robot.example, _result(json.dumps(dict(reversed(command.items())))))  # keys in any order
    assert not families.correct(robot.example, _result(robot.example.answer[:-1]))
    sort = demo.demo_cases()[0].example
    assert families.correct(sort, _result(f" {sort.answer}\n")) and not families.correct(sort, _result(sort.answer + " 1"))
    assert demo.answer(_result("", (name, '{"minutes": 63}'))) == f'{name}({{"minutes": 63}})'
