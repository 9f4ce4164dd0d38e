"""The exported graphs use only what TensorRT's ONNX parser documents; the checker catches what it does not."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from refusion.engines.onnx_support import (
    check_export,
    check_model,
    documented,
    require_supported,
)
from refusion.runtime.core.errors import RefusionError


def test_op_list_names_its_source():
    source = documented()["source"]
    assert source["url"].startswith("https://github.com/onnx/onnx-tensorrt/") and source["tensorrt"]
    assert "MatMul" in documented()["ops"] and "Bernoulli" in documented()["unsupported"]


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_fixture_exports_are_supported(exports, dtype):
    assert check_export(exports[dtype]) == []
    require_supported(exports[dtype])


def _model(nodes, inputs, outputs, opset=17, domain=""):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=opsets)


def test_unsupported_ops_types_domains_and_opsets_are_found():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    i = helper.make_tensor_value_info("i", TensorProto.INT64, [2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, [None, None])
    m = _model([helper.make_node("Bernoulli", ["x"], ["y"], name="b")], [x], [y])
    assert "documented as unsupported" in str(check_model(m, "g")[0])
    m = _model([helper.make_node("MatMul", ["i", "i"], ["y"], name="mm")], [i], [y])
    assert "MatMul on INT64" in str(check_model(m, "g")[0])
    fused = helper.make_node("FusedMatMul", ["x", "x"], ["y"], name="fm", domain="com.microsoft")
    found = check_model(_model([fused], [x], [y], domain="com.microsoft"), "g")
    assert any("custom-domain" in str(f) for f in found)
    found = check_model(_model([helper.make_node("Relu", ["x"], ["z"], name="r")], [x],
                               [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])], opset=21), "g")
    assert any("opset 21" in str(f) for f in found)


def test_require_supported_names_the_node_and_the_source(exports, tmp_path, monkeypatch):
    from refusion.engines import onnx_support

    doc = dict(documented())
    doc["ops"] = {k: v for k, v in doc["ops"].items() if k != "Softmax"}
    monkeypatch.setattr(onnx_support, "documented", lambda: doc)
    with pytest.raises(RefusionError, match=r"(?s)onnx-tensorrt.*Softmax is not in the documented matrix"):
        require_supported(exports["fp32"])
    assert onnx.load(str(exports["fp32"] / "planner.onnx"), load_external_data=False)
