"""The one dtype table agrees with what ONNX, onnxruntime, torch, safetensors and numpy call each type."""

from __future__ import annotations

import numpy as np
import pytest

from refusion.runtime.core import dtypes
from refusion.runtime.core.errors import RefusionError

onnx = pytest.importorskip("onnx")
torch = pytest.importorskip("torch")


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16", "int64", "int32", "bool", "uint8"])
def test_every_spelling_names_the_same_type(name):
    row = dtypes.dtype(name)
    assert onnx.helper.tensor_dtype_to_string(row.onnx) == "TensorProto." + {
        "float32": "FLOAT", "float16": "FLOAT16", "bfloat16": "BFLOAT16"}.get(name, name.upper())
    torch_type = getattr(torch, row.torch)
    assert torch.empty(0, dtype=torch_type).element_size() == row.itemsize
    assert dtypes.from_onnx(row.onnx) is row and dtypes.from_trt(row.trt) is row
    assert dtypes.from_safetensors(row.safetensors) is row
    assert dtypes.from_onnxruntime(row.onnxruntime) is row
    if name != "bfloat16":  # numpy has no bfloat16: its bytes are held as uint16
        assert row.numpy == np.dtype(name)


def test_onnxruntime_names_are_those_of_its_sessions(tmp_path):
    """What an onnxruntime session reports as each input's type is the table's onnxruntime column."""
    ort = pytest.importorskip("onnxruntime")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", [f"x{i}"], [f"y{i}"]) for i in range(5)], "types",
        [onnx.helper.make_tensor_value_info(f"x{i}", dtypes.dtype(name).onnx, [1])
         for i, name in enumerate(("float32", "float16", "int64", "int32", "bool"))],
        [onnx.helper.make_tensor_value_info(f"y{i}", dtypes.dtype(name).onnx, [1])
         for i, name in enumerate(("float32", "float16", "int64", "int32", "bool"))])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert [dtypes.from_onnxruntime(i.type).name for i in session.get_inputs()] == [
        "float32", "float16", "int64", "int32", "bool"]
    assert dtypes.from_onnxruntime("tensor(string)") is None


def test_export_flags_and_errors():
    assert {f: d.name for f, d in dtypes.EXPORT_DTYPES.items()} == {
        "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
    with pytest.raises(RefusionError, match=r"dtype 'fp8' is not supported; choose one of fp32, fp16, bf16"):
        dtypes.from_flag("fp8")
    with pytest.raises(RefusionError, match=r"dtype 'half' is unknown"):
        dtypes.dtype("half")
