"""The exported graphs use only what TensorRT's ONNX parser documents; the checker catches what it does not."""

from __future__ import annotations

import numpy as np
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


def test_int4_exports_with_documented_blocks_are_supported(peaky_int4, peaky_int4_head):
    assert check_export(peaky_int4[64]) == []
    assert check_export(peaky_int4_head) == []  # the logits MatMul reads an INT4 DequantizeLinear too
    findings = check_export(peaky_int4[32])
    assert findings and all("blocked along axis 0 by 32" in str(f) and "--block-size 128" in str(f) for f in findings)
    with pytest.raises(RefusionError, match=r"blocks of 64 or 128 along axis 0"):
        require_supported(peaky_int4[32])


def _int4_model(weight_dims, scale_dims, scale_type=TensorProto.FLOAT16, zero_point=None, axis=0, block=64):
    inits = [helper.make_tensor("w", TensorProto.INT4, weight_dims, [0] * int(np.prod(weight_dims))),
             helper.make_tensor("s", scale_type, scale_dims, [1.0] * int(np.prod(scale_dims)))]
    if zero_point is not None:
        inits.append(helper.make_tensor("z", TensorProto.INT4, scale_dims, [zero_point] * int(np.prod(scale_dims))))
    inputs = ["w", "s", "z"] if zero_point is not None else ["w", "s"]
    dq = helper.make_node("DequantizeLinear", inputs, ["wf"], name="dq", axis=axis, block_size=block)
    mm = helper.make_node("MatMul", ["x", "wf"], ["y"], name="mm")
    x = helper.make_tensor_value_info("x", scale_type, [1, weight_dims[0]])
    y = helper.make_tensor_value_info("y", scale_type, [1, None])
    graph = helper.make_graph([dq, mm], "g", [x], [y], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_int4_variants_tensorrt_does_not_document_are_named():
    assert check_model(_int4_model([128, 8], [2, 8]), "g") == []
    assert check_model(_int4_model([128, 8], [1, 8], block=128), "g") == []
    assert check_model(_int4_model([128, 8], [2, 8], zero_point=0), "g") == []
    cases = {"has a zero point other than a constant 0": _int4_model([128, 8], [2, 8], zero_point=1),
             "blocked along axis 1 by 64": _int4_model([8, 128], [8, 2], axis=1),
             "has 3 dims": _int4_model([2, 128, 8], [2, 2, 8]),
             "has scale [4, 8]; blocks of 64 along axis 0 need [2, 8]": _int4_model([128, 8], [4, 8]),
             "has BF16 scales": _int4_model([128, 8], [2, 8], scale_type=TensorProto.BFLOAT16)}
    for problem, model in cases.items():
        assert any(problem in str(f) for f in check_model(model, "g")), problem


def test_opset_21_needs_int4_weights():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    relu = _model([helper.make_node("Relu", ["x"], ["z"], name="r")], [x],
                  [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])], opset=21)
    assert any("opset 21 is outside" in str(f) for f in check_model(relu, "g"))
