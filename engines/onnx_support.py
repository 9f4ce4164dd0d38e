"""Static check: do the exported graphs use only ops and dtypes TensorRT's ONNX parser documents?

The documented matrix is data (`trt_onnx_ops.json`, with its source inside). A graph passes
when its opsets are in the documented range, every node is in the default domain, and each
node's checked tensors have a type listed for its op. Checked tensors are the op's data
inputs (input 0, or the value inputs of Where) plus every floating-point or bool tensor it
touches; integer side inputs (axes, shapes, indices) and integer index outputs (ArgMax) are
not data in the matrix's sense and are left out. DequantizeLinear's data is its quantized input
alone (its float scale and output are the dequantization, not data); an INT4 one must be the
blocked weight-only pattern TensorRT documents (the json's `int4` section), which is also what
lets a graph use opset 21.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from refusion.runtime.core.errors import RefusionError

OPS_FILE = Path(__file__).with_name("trt_onnx_ops.json")

# ONNX TensorProto element type -> the matrix's type names
_TYPE_NAMES = {1: "FP32", 2: "UINT8", 3: "INT8", 6: "INT32", 7: "INT64", 9: "BOOL", 10: "FP16", 11: "DOUBLE", 16: "BF16",
               17: "FP8", 21: "UINT4", 22: "INT4"}
_FLOATING_OR_BOOL = {"FP32", "FP16", "BF16", "DOUBLE", "BOOL"}
_DATA_INPUTS = {"Where": (1, 2)}  # ops whose data is not input 0


@dataclass(frozen=True)
class Finding:
    graph: str
    node: str
    problem: str

    def __str__(self) -> str:
        return f"{self.graph}: node {self.node}: {self.problem}"


@lru_cache(maxsize=1)
def documented() -> dict[str, Any]:
    return json.loads(OPS_FILE.read_text())


def check_model(model: Any, graph: str) -> list[Finding]:
    """Findings for one onnx.ModelProto (loaded without external data); empty when it parses."""
    import onnx

    doc = documented()
    findings = []
    types = _tensor_types(onnx.shape_inference.infer_shapes(model))
    int4 = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and types.get(n.input[0]) == "INT4"]
    for opset in model.opset_import:
        if opset.domain not in doc["domains"]:
            findings.append(Finding(graph, "-", f"opset domain {opset.domain!r} is not the standard ONNX domain"))
        elif not (doc["opset"]["min"] <= opset.version <= doc["opset"]["max"]
                  or (int4 and opset.version == doc["int4"]["opset"])):
            findings.append(Finding(graph, "-", f"opset {opset.version} is outside the documented "
                                                f"{doc['opset']['min']}..{doc['opset']['max']} (and "
                                                f"{doc['int4']['opset']} for blocked INT4 weights)"))
    initializers = {i.name: i for i in model.graph.initializer}
    for node in int4:
        findings += [Finding(graph, node.name or node.output[0], p) for p in _int4_problems(node, initializers, doc)]
    for node in model.graph.node:
        name = node.name or node.output[0]
        if node.domain not in doc["domains"]:
            findings.append(Finding(graph, name, f"{node.domain}::{node.op_type} is a custom-domain op"))
            continue
        allowed = doc["ops"].get(node.op_type)
        if allowed is None:
            why = "documented as unsupported" if node.op_type in doc["unsupported"] else "not in the documented matrix"
            findings.append(Finding(graph, name, f"{node.op_type} is {why}"))
            continue
        data = _DATA_INPUTS.get(node.op_type, (0,))
        checked = [t for i, t in enumerate(node.input) if i in data and t]
        if node.op_type != "DequantizeLinear":
            checked += [t for t in list(node.input) + list(node.output) if types.get(t) in _FLOATING_OR_BOOL]
        for tensor in dict.fromkeys(checked):
            dtype = types.get(tensor)
            if dtype is None:
                findings.append(Finding(graph, name, f"type of {tensor!r} could not be inferred"))
            elif dtype not in allowed:
                findings.append(Finding(graph, name, f"{node.op_type} on {dtype} ({tensor!r}); documented types: "
                                                     f"{', '.join(allowed)}"))
    return findings


def _int4_problems(node: Any, initializers: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    """How an INT4 DequantizeLinear departs from the blocked weight-only pattern TensorRT documents."""
    from onnx import helper, numpy_helper

    rule = doc["int4"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    weight, scale = initializers.get(node.input[0]), initializers.get(node.input[1])
    if weight is None or scale is None:
        return ["INT4 weights and their scale must be initializers (TensorRT takes INT4 only as constant weights)"]
    problems = []
    if len(weight.dims) != rule["rank"]:
        problems.append(f"INT4 {weight.name!r} has {len(weight.dims)} dims; TensorRT documents "
                        f"{rule['rank']}-D INT4 weights")
    zero = initializers.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if (len(node.input) > 2 and node.input[2]) and (zero is None or numpy_helper.to_array(zero).any()):
        problems.append(f"INT4 {weight.name!r} has a zero point other than a constant 0; TensorRT takes symmetric "
                        "INT4 only")
    axis, block = attrs.get("axis", 1), attrs.get("block_size", 0)
    if axis != rule["axis"] or block not in rule["block_sizes"]:
        sizes = " or ".join(map(str, rule["block_sizes"]))
        problems.append(f"INT4 {weight.name!r} is blocked along axis {axis} by {block}; TensorRT documents blocks "
                        f"of {sizes} along axis {rule['axis']}: re-export with --block-size {rule['block_sizes'][-1]}")
    scale_type = _TYPE_NAMES.get(scale.data_type, f"onnx type {scale.data_type}")
    if scale_type not in rule["scale_types"]:
        problems.append(f"INT4 {weight.name!r} has {scale_type} scales; TensorRT documents "
                        f"{', '.join(rule['scale_types'])}")
    elif block and len(weight.dims) == 2 and list(scale.dims) != [weight.dims[0] // block, weight.dims[1]]:
        problems.append(f"INT4 {weight.name!r} {list(weight.dims)} has scale {list(scale.dims)}; blocks of {block} "
                        f"along axis 0 need [{weight.dims[0] // block}, {weight.dims[1]}]")
    return problems


def check_export(export_dir: str | Path) -> list[Finding]:
    """Findings for both graphs of an export directory."""
    import onnx

    from refusion.runtime.core.contract import GRAPH_NAMES
    from refusion.runtime.core.export_manifest import ExportManifest

    manifest = ExportManifest.load(export_dir)
    findings = []
    for graph in GRAPH_NAMES:
        model = onnx.load(str(manifest.graph_path(graph)), load_external_data=False)
        findings += check_model(model, graph)
    return findings


def require_supported(export_dir: str | Path) -> None:
    """Raise, before a long build, when the parser would reject the graphs."""
    findings = check_export(export_dir)
    if findings:
        source = documented()["source"]
        shown = "\n  ".join(str(f) for f in findings[:20])
        more = f"\n  ... and {len(findings) - 20} more" if len(findings) > 20 else ""
        raise RefusionError(
            f"{export_dir} uses ops or dtypes TensorRT's ONNX parser does not document "
            f"(TensorRT {source['tensorrt']}, {source['url']}):\n  {shown}{more}\n"
            "Re-export with this version of refusion-trt, or update engines/trt_onnx_ops.json from a newer matrix."
        )


def _tensor_types(model: Any) -> dict[str, str]:
    """Tensor name -> matrix type name, from graph inputs/outputs, initializers and inferred value_info."""
    types: dict[str, str] = {}
    graph = model.graph
    for value in list(graph.input) + list(graph.output) + list(graph.value_info):
        elem = value.type.tensor_type.elem_type
        if elem:
            types[value.name] = _TYPE_NAMES.get(elem, f"onnx type {elem}")
    for init in graph.initializer:
        types[init.name] = _TYPE_NAMES.get(init.data_type, f"onnx type {init.data_type}")
    return types
