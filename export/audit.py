"""Everything that can disagree with refusion.json in an export directory, listed, not raised.

`refusion-export check` refuses an export with any problem before it runs a number;
`refusion-export inspect` prints them all. The manifest itself is read strictly first
(ExportManifest.read raises one RefusionError for a damaged refusion.json); then each file
is checked against its recorded size and sha256, and each graph's inputs, outputs and weight
initializers against the contract and the weight index; then the tokenizer is loaded.
"""

from __future__ import annotations

from refusion.runtime.core.contract import GRAPH_NAMES, GraphName
from refusion.runtime.core.dtypes import from_onnx
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.tokenizer import Tokenizer


def audit(manifest: ExportManifest, verify: bool = True) -> list[str]:
    """Every problem found: files against their records, then graphs against the manifest."""
    problems = manifest.file_problems(verify)
    for graph in GRAPH_NAMES:
        if manifest.files[manifest.graph_files[graph]].problem(manifest.graph_path(graph), verify=False) is None:
            problems += graph_problems(manifest, graph)
    if manifest.tokenizer_files and not problems:  # files that match their records may still not load
        try:
            Tokenizer.from_dir(manifest.path)
        except RefusionError as e:
            problems.append(f"the tokenizer does not load: {e}")
    return problems


def graph_io(manifest: ExportManifest, graph: GraphName) -> list[tuple[str, str, str, list[str | int]]]:
    """(in|out, name, dtype, axes) of each graph input and output as the ONNX file declares them."""
    import onnx

    model = onnx.load(str(manifest.graph_path(graph)), load_external_data=False)
    found = []
    for kind, values in (("in", model.graph.input), ("out", model.graph.output)):
        for v in values:
            t = v.type.tensor_type
            row = from_onnx(t.elem_type)
            found.append((kind, v.name, row.name if row else f"onnx type {t.elem_type}",
                          [d.dim_param or d.dim_value for d in t.shape.dim]))
    return found


def graph_problems(manifest: ExportManifest, graph: GraphName) -> list[str]:
    """The graph file against refusion.json: inputs and outputs, and every weight it reads."""
    import onnx

    file = manifest.graph_path(graph)
    try:
        model = onnx.load(str(file), load_external_data=False)
        found = graph_io(manifest, graph)
    except Exception as e:  # noqa: BLE001 - onnx raises DecodeError and others for a damaged protobuf
        return [f"{file} is not a readable ONNX graph ({type(e).__name__})"]
    spec = manifest.graphs[graph]
    declared = [("in", t.name, t.dtype, list(t.axes)) for t in spec.inputs]
    declared += [("out", t.name, t.dtype, list(t.axes)) for t in spec.outputs]
    problems = [f"{file}: {kind}put {name} {dtype} {axes} is not in refusion.json's contract"
                for kind, name, dtype, axes in found if (kind, name, dtype, axes) not in declared]
    problems += [f"{file}: lacks {kind}put {name} {dtype} {axes} of refusion.json's contract"
                 for kind, name, dtype, axes in declared if (kind, name, dtype, axes) not in found]
    for init in model.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL:
            continue  # small constants (rotary frequencies, eps) live in the graph
        ext = {e.key: e.value for e in init.external_data}
        entry = manifest.weights.get(init.name)
        row = from_onnx(init.data_type)
        if entry is None:
            problems.append(f"{file}: weight {init.name} is not in refusion.json's index")
            continue
        got = (ext.get("location"), int(ext.get("offset", -1)), int(ext.get("length", -1)), tuple(init.dims),
               row.name if row else init.data_type)
        want = (manifest.weights_file, entry.offset, entry.nbytes, entry.shape, entry.dtype)
        if got != want:
            problems.append(f"{file}: weight {init.name} is (file, offset, bytes, shape, dtype) {got}, "
                            f"refusion.json records {want}")
    return problems
