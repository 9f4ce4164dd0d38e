"""The one onnxruntime session path: every session comes from `open_session`, which refuses a
graph file whose inputs or outputs differ from refusion.json's contract before any forward."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from refusion.runtime.core.contract import graph_specs
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest

pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> ExportManifest:
    from tests.helpers import export_peaky

    return ExportManifest.load(export_peaky(tmp_path_factory.mktemp("sessions"), seed=0)[1])


def _with_contract(m: ExportManifest, **change) -> ExportManifest:
    """`m` whose contract is the one of other dims (the graph files stay those of `m`)."""
    dims = dict(num_layers=m.num_layers, kv_heads=m.kv_heads, head_dim=m.head_dim, vocab_size=m.vocab_size,
                kv_dtype=m.dtype, logits=m.has_logits) | change
    return dataclasses.replace(m, graphs=graph_specs(**dims))


@pytest.mark.parametrize("change, message", [
    (dict(kv_heads=4), r"infiller.onnx does not match refusion.json beside it: its input 5 is past_key_values.0.key "
                       r"float32 \['batch', 'past_seq', 2, 16\], the contract says past_key_values.0.key float32 "
                       r"\['batch', 'past_seq', 4, 16\]; the graph and refusion.json come from different exports"),
    (dict(num_layers=3), r"its input 9 is nothing, the contract says past_key_values.2.key"),
    (dict(kv_dtype="float16"), r"its input 5 is past_key_values.0.key float32 .* the contract says "
                               r"past_key_values.0.key float16"),
    (dict(logits=True), r"its output \d+ is nothing, the contract says logits float32 \['batch', 'heads', 384\]"),
])
def test_runner_refuses_a_graph_that_differs_from_the_contract(manifest, change, message):
    from refusion.runtime.runners.onnxruntime import OrtRunner

    runner = OrtRunner(_with_contract(manifest, **change))
    with pytest.raises(RefusionError, match=message + r".*re-export"):
        runner.activate()
    assert not runner.is_active


def test_matching_contract_loads_and_the_comparator_path_checks_too(manifest):
    from refusion.export.compare import OrtSessions, cases
    from refusion.runtime.runners.onnxruntime import OrtRunner

    with OrtRunner(manifest):
        pass
    feed = cases(manifest)[0].feed
    with OrtSessions(manifest) as sessions:
        assert sessions("planner", feed)["argmax_ids"].shape == feed["input_ids"].shape
    with pytest.raises(RefusionError, match="planner.onnx does not match refusion.json"):
        OrtSessions(_with_contract(manifest, kv_heads=1))("planner", feed)


def test_only_open_session_makes_onnxruntime_sessions():
    """validation, the engines check and the runners share one session path (tests may make their own)."""
    makers = []
    for package in ("export", "runtime", "engines", "tools"):
        for file in sorted((REPO / package).rglob("*.py")):
            if file.is_relative_to(REPO / "tools" / "bench" / "measure"):
                continue  # measurements of other ways to open a session, beside the one the code uses
            tree = ast.parse(file.read_text())
            for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
                for call in [n for n in ast.walk(function) if isinstance(n, ast.Call)]:
                    name = getattr(call.func, "attr", getattr(call.func, "id", None))
                    if name == "InferenceSession":
                        makers.append(f"{file.relative_to(REPO)}:{function.name}")
            assert "InferenceSession" not in file.read_text() or file == REPO / "runtime/runners/ort_session.py", file
    assert makers == ["runtime/runners/ort_session.py:open_session"]


class _SessionOn:
    """onnxruntime.InferenceSession as onnxruntime-gpu makes it: the graph run on the CPU provider here, the
    session reporting `providers` as its own (the CUDA one it got, or the CPU one it fell back to); records what
    it was asked for."""

    def __init__(self, providers: list[str]):
        import onnxruntime

        self.providers, self.real = providers, onnxruntime.InferenceSession
        self.asked: list[list] = []

    def __call__(self, path, options, providers):
        self.asked.append(providers)
        session = self.real(path, options, providers=["CPUExecutionProvider"])
        session.get_providers = lambda: self.providers
        return session


def test_a_session_that_fell_back_to_the_cpu_is_refused_with_the_install_command(manifest, fakes, monkeypatch):
    """onnxruntime-gpu >= 1.27 without its [cuda,cudnn] extras lists CUDA among its available providers, fails
    to load it, and makes a CPU session: the CUDA runner would bind device memory to it. Refused at activation,
    naming the extras; the engines check's reference too (it asks CUDA first where onnxruntime lists it)."""
    import onnxruntime

    from refusion.engines.check import reference_providers
    from refusion.export.compare import OrtSessions, cases
    from refusion.runtime.runners.onnxruntime import OrtCudaRunner

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(onnxruntime, "InferenceSession", _SessionOn(["CPUExecutionProvider"]))
    runner = OrtCudaRunner(manifest)
    install = (r"made a session on CPUExecutionProvider instead .* pip install 'refusion-trt\[ort-gpu\]' "
               r"\(onnxruntime-gpu\[cuda,cudnn\] < 1.27, built for CUDA 12\) or 'refusion-trt\[ort-gpu-cu13\]'")
    with pytest.raises(RefusionError, match=r"onnxruntime could not start CUDAExecutionProvider and " + install):
        runner.activate()
    assert not runner.is_active
    with pytest.raises(RefusionError, match=install), OrtSessions(manifest, reference_providers("float16")) as ref:
        ref("infiller", cases(manifest)[0].feed)


@pytest.mark.parametrize("dtype, asked", [("fp32", ("CUDAExecutionProvider", {"use_tf32": "0"})),
                                          ("fp16", "CUDAExecutionProvider")])
def test_the_cuda_runner_runs_fp32_exports_with_tf32_off(exports, fakes, monkeypatch, dtype, asked):
    """The CUDA provider turns TF32 on for fp32 GEMMs by default: an fp32 export on `--backend ort-cuda` would not
    be the fp32 reference it is on the CPU and on TensorRT fp32 engines (TF32 off). fp16 graphs have no TF32."""
    import onnxruntime

    from refusion.runtime.runners.onnxruntime import OrtCudaRunner

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    session = _SessionOn(["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(onnxruntime, "InferenceSession", session)
    with OrtCudaRunner(ExportManifest.load(exports[dtype])):
        pass
    assert session.asked == [[asked]]
