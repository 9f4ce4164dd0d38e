"""`refusion.json`: everything the runtime needs about an export, read without torch or the HF config.

One writer (`ExportManifest.write`, used by the exporter) and one reader (`load`). The
reader trusts nothing: each field is type-checked, the contract and the weight index must
be the ones the dims imply, ids must lie inside the vocabulary, every listed file must have
its recorded size (and sha256 with `verify=True`), and a per-section digest catches edits
that are consistent but not what the exporter wrote (a raised max_position_embeddings).
Every failure is one RefusionError naming the file, the field, and the fix: re-export.

The exporter first writes `refusion.pending.json`, validates, and renames it to
`refusion.json` as its very last step, so a directory left by a killed export never loads.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from refusion.runtime.core.contract import (
    GRAPH_NAMES,
    GRAPH_OPS,
    ORT_OPSET,
    VOCAB_MASK,
    GraphName,
    GraphSpec,
    TensorSpec,
    graph_specs,
)
from refusion.runtime.core.defaults import DecodeDefaults
from refusion.runtime.core.dims import ModelDims
from refusion.runtime.core.dtypes import EXPORT_DTYPES, dtype
from refusion.runtime.core.embeddings import EMBEDDING_WEIGHT, Embeddings
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.fields import Fields
from refusion.runtime.core.files import FileRecord
from refusion.runtime.core.quantization import INT4_OPSET, Quantization, weight_index

MANIFEST_NAME = "refusion.json"
PENDING_NAME = "refusion.pending.json"
FORMAT = "refusion-onnx"
FORMAT_VERSION = 7  # 3: the quantization section; 4: the top-K sampling outputs (graphs.*.candidates); 5: heads at
# head_positions only, input_probs as the next token's probability, the lean graphs; 6: the embeddings section
# (the table in the graphs, or on the host with inputs_embeds); 7: the graphs take vocab_mask (structured output)
READABLE_VERSIONS = (6, FORMAT_VERSION)  # a v6 export still runs, without structured output
REEXPORT = "re-export with `refusion-export onnx CHECKPOINT --output DIR --force`"
WEIGHTS_LAYOUT = "linear weights [in, out]"
_SECTIONS = ("model", "dtype", "quantization", "embeddings", "tokens", "defaults", "graphs", "weights", "tokenizer", "files")


def check_format(fields: Fields, fmt: str, version: int, redo: str, readable: tuple[int, ...] = ()) -> None:
    """A manifest written by another format or version (`version`, or one of `readable`) is refused, saying what to
    redo."""
    raw = fields.raw
    if raw.get("format") != fmt or raw.get("format_version") not in (version, *readable):
        older = "".join(f" (or v{v})" for v in readable if v != version)
        raise RefusionError(
            f"{fields.file}: format {raw.get('format')!r} v{raw.get('format_version')!r} is not {fmt!r} "
            f"v{version}{older}, the one this version of refusion-trt reads (CHANGELOG.md says what changed); {redo}."
        )


@dataclass(frozen=True)
class WeightEntry:
    dtype: str  # the export dtype, or int4 for quantized linear weights
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "offset": self.offset, "nbytes": self.nbytes}


@dataclass(frozen=True)
class ExportManifest:
    """What `refusion-export onnx` wrote: model dims, token ids, graph contracts, weight index, files."""

    path: Path  # the export directory
    dims: ModelDims
    dtype: str  # weights and KV: float32 | float16 | bfloat16 (of an int4 export: scales, other weights, KV)
    mask_token_id: int
    eos_token_id: int
    defaults: DecodeDefaults
    graphs: dict[GraphName, GraphSpec]
    opset: int
    has_logits: bool
    candidates: int  # K: the graphs' top_ids / top_logprobs hold the K most likely tokens at each position
    weights: dict[str, WeightEntry]
    tokenizer_files: tuple[str, ...]
    files: dict[str, FileRecord]  # every file above by name: graphs, weights.bin, tokenizer files
    quantization: Quantization | None = None  # int4 linear weights: method, bits, block size, calibration
    embeddings: Embeddings = Embeddings()  # in the graphs, or a table on the host (inputs_embeds)
    ops: str = "standard"  # the graphs' ops: GRAPH_OPS (contract.py)
    source: dict[str, Any] = field(default_factory=dict)  # checkpoint path and dtype, export time: informative
    format_version: int = FORMAT_VERSION  # as written: READABLE_VERSIONS

    graph_files = {"planner": "planner.onnx", "infiller": "infiller.onnx"}
    weights_file = "weights.bin"

    @property
    def num_layers(self) -> int:
        return self.dims.num_layers

    @property
    def kv_heads(self) -> int:
        return self.dims.kv_heads

    @property
    def head_dim(self) -> int:
        return self.dims.head_dim

    @property
    def vocab_size(self) -> int:
        return self.dims.vocab_size

    @property
    def max_positions(self) -> int:
        return self.dims.max_position_embeddings

    @property
    def precision(self) -> str:
        """The dtype, and the int4 quantization of an int4 export: "float32, int4-awq block 64" (", int4 lm_head"
        when the head is int4 too)."""
        q = self.quantization
        return f"{self.dtype}, {q.method} block {q.block_size}{', int4 lm_head' if q.head else ''}" if q else self.dtype

    @property
    def takes_masks(self) -> bool:
        """The graphs take vocab_mask (format 7 on): what structured output needs."""
        return any(t.name == VOCAB_MASK for t in self.graphs["infiller"].inputs)

    def graph_path(self, name: GraphName) -> Path:
        return self.path / self.graph_files[name]

    @property
    def fingerprint(self) -> str:
        """A digest of the files the export lists (graphs, weights, tokenizer): the same files, the same
        fingerprint (the OpenAI server's system_fingerprint)."""
        return "fp_" + _digest({name: record.to_json() for name, record in self.files.items()})

    # -- files -----------------------------------------------------------------------------
    @property
    def model_files(self) -> tuple[str, ...]:
        """What the backends load: both graphs, the weights and a host embedding table."""
        return (*self.graph_files.values(), self.weights_file, *self.embeddings.files)

    def file_problems(self, verify: bool = False, names: tuple[str, ...] | None = None) -> list[str]:
        """Every listed file (or those of `names`) whose size, and with `verify` sha256, differs from the record."""
        chosen = self.files if names is None else names
        found = (self.files[name].problem(self.path / name, verify) for name in chosen)
        return [p for p in found if p]

    def check_files(self, verify: bool = False, names: tuple[str, ...] | None = None) -> None:
        problems = self.file_problems(verify, names)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise RefusionError(f"{problems[0]}{more}; the export is damaged: {REEXPORT}.")

    # -- writer ------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": {"architecture": "Qwen3ForCausalLM", **self.dims.to_json()},
            "dtype": self.dtype,
            "quantization": self.quantization.to_json() if self.quantization else None,
            "embeddings": self.embeddings.to_json(),
            "tokens": {"mask_token_id": self.mask_token_id, "eos_token_id": self.eos_token_id},
            "defaults": self.defaults.to_json(),
            "graphs": {name: {"file": self.graph_files[name], "ops": self.ops, "opset": self.opset,
                              "logits": self.has_logits,
                              "candidates": self.candidates, **self.graphs[name].to_json()} for name in GRAPH_NAMES},
            "weights": {"file": self.weights_file, "layout": WEIGHTS_LAYOUT,
                        "tensors": {n: e.to_json() for n, e in self.weights.items()}},
            "tokenizer": {"files": list(self.tokenizer_files)},
            "files": {name: record.to_json() for name, record in self.files.items()},
        }
        return {"format": FORMAT, "format_version": self.format_version, **body,
                "digests": {k: _digest(body[k]) for k in _SECTIONS}, "source": self.source}

    def write(self, pending: bool = False) -> Path:
        """Write into self.path: as refusion.pending.json while the export is not yet validated."""
        file = self.path / (PENDING_NAME if pending else MANIFEST_NAME)
        file.write_text(json.dumps(self.to_json(), indent=1))
        return file

    # -- reader ------------------------------------------------------------------------------
    @staticmethod
    def load(path: str | Path, *, verify: bool = False, pending: bool = False) -> ExportManifest:
        """Read and check an export directory (sizes always, sha256 with `verify`); `pending` reads
        an unpublished export's refusion.pending.json (the exporter's own validation)."""
        path = Path(path)
        manifest = ExportManifest.read(path, pending)
        manifest.check_files(verify)
        return manifest

    @staticmethod
    def read(path: Path, pending: bool = False) -> ExportManifest:
        """Parse and cross-check refusion.json without touching the other files."""
        file = path / (PENDING_NAME if pending else MANIFEST_NAME)
        if not path.is_dir():
            aside = sorted(path.parent.glob(f".{path.name}.*-*")) if path.parent.is_dir() else []
            hint = (f" An interrupted export left {aside[0].name} beside it; re-run the same `refusion-export onnx` "
                    "to restore or replace it." if aside else "")
            raise RefusionError(f"{path} is not a directory; pass the output directory of `refusion-export onnx`.{hint}")
        if not file.is_file():
            if (path / PENDING_NAME).is_file():
                raise RefusionError(
                    f"{path} is an unfinished export ({PENDING_NAME}, no {MANIFEST_NAME}): it was interrupted or "
                    "failed validation and must not be used. Delete it and re-run `refusion-export onnx`."
                )
            raise RefusionError(f"{path} is not a refusion export: {MANIFEST_NAME} is missing. {_instead(path)}")
        try:
            raw = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
            raise RefusionError(f"{file} is not valid JSON ({e}); {REEXPORT}.") from e
        fields = Fields(file, raw, REEXPORT)
        engines = (path / "engines.json").is_file()  # an engines directory (engines_manifest imports this module)
        check_format(fields, FORMAT, FORMAT_VERSION,
                     REEXPORT + (", then rebuild the engines from it with `refusion-export build`" if engines else ""),
                     READABLE_VERSIONS)
        return _parse(path, fields)


def _instead(path: Path) -> str:
    """What to pass instead of a directory without refusion.json: an export one level down (`refusion-export
    demo` writes out/demo/onnx), the export of a checkpoint, or a new export."""
    below = sorted(p.parent for p in path.glob(f"*/{MANIFEST_NAME}") if not p.parent.name.startswith("."))
    if below:
        shown = " and ".join(map(str, below[:3])) + (" ..." if len(below) > 3 else "")
        return f"{shown} {'is an export' if len(below) == 1 else 'are exports'}: pass {'it' if len(below) == 1 else 'one'}."
    if (path / "config.json").is_file():
        out = Path("out") / f"{path.resolve().name}-onnx"
        return (f"It is a checkpoint (config.json): export it first with `refusion-export onnx {path} --output {out}`, "
                f"then pass {out}.")
    return f"Create one with `refusion-export onnx CHECKPOINT --output {path}`."


def _digest(section: Any) -> str:
    return hashlib.sha256(json.dumps(section, sort_keys=True).encode()).hexdigest()[:16]


def _parse(path: Path, f: Fields) -> ExportManifest:
    f.str("model.architecture", ("Qwen3ForCausalLM",))
    dims = ModelDims.read(f, "model")
    export_dtype = f.str("dtype", tuple(d.name for d in EXPORT_DTYPES.values()))
    quantization = Quantization.read(f, "quantization", dims, export_dtype)
    embeddings = Embeddings.read(f, "embeddings", dims, export_dtype)
    vocab = dims.vocab_size
    logits = f.bool("graphs.planner.logits")
    candidates = f.int("graphs.planner.candidates", 1, vocab + 1)
    ops = _ops(f, "planner")
    opset = f.positive_int("graphs.planner.opset")
    if ops == "onnxruntime" and opset != ORT_OPSET:
        raise f.fail("graphs.planner.opset", opset, f"{ORT_OPSET} for --ops onnxruntime (Attention, RMSNormalization, "
                                                    "RotaryEmbedding)")
    if ops == "standard" and quantization and opset != INT4_OPSET:
        raise f.fail("graphs.planner.opset", opset,
                     f"{INT4_OPSET} for an int4 export (INT4 and blocked DequantizeLinear)")
    graphs: dict[GraphName, GraphSpec] = {}
    version = f.raw["format_version"]
    expected = graph_specs(dims.num_layers, dims.kv_heads, dims.head_dim, vocab, export_dtype, logits, candidates,
                           embeddings.fed_hidden, vocab_mask=version >= 7)
    for name in GRAPH_NAMES:
        f.str(f"graphs.{name}.file", (ExportManifest.graph_files[name],))
        if (graph_ops := _ops(f, name)) != ops:
            raise f.fail(f"graphs.{name}.ops", graph_ops, f"{ops}, as for the planner")
        if f.positive_int(f"graphs.{name}.opset") != opset:
            raise f.fail(f"graphs.{name}.opset", f.get(f"graphs.{name}.opset"), f"{opset}, as for the planner")
        if f.bool(f"graphs.{name}.logits") != logits:
            raise f.fail(f"graphs.{name}.logits", not logits, f"{logits}, as for the planner")
        if f.int(f"graphs.{name}.candidates", 1, vocab + 1) != candidates:
            raise f.fail(f"graphs.{name}.candidates", f.get(f"graphs.{name}.candidates"),
                         f"{candidates}, as for the planner")
        graphs[name] = _read_spec(f, name, expected[name])
    f.str("weights.file", (ExportManifest.weights_file,))
    f.str("weights.layout", (WEIGHTS_LAYOUT,))
    weights = _read_weights(f, dims, export_dtype, quantization, embeddings)
    tokenizer_files = tuple(_name(f, "tokenizer.files", x) for x in f.list("tokenizer.files"))
    listed = {*ExportManifest.graph_files.values(), ExportManifest.weights_file, *embeddings.files, *tokenizer_files}
    files_raw = f.object("files")
    if set(files_raw) != listed:
        raise f.fail("files", sorted(files_raw), f"records for exactly {sorted(listed)}")
    files = {name: FileRecord(f.int(("files", name, "bytes")), f.str(("files", name, "sha256"))) for name in sorted(listed)}
    manifest = ExportManifest(
        path=path,
        dims=dims,
        dtype=export_dtype,
        mask_token_id=f.int("tokens.mask_token_id", 0, vocab),
        eos_token_id=f.int("tokens.eos_token_id", 0, vocab),
        defaults=DecodeDefaults.read(f, "defaults"),
        graphs=graphs,
        opset=opset,
        has_logits=logits,
        candidates=candidates,
        weights=weights,
        tokenizer_files=tokenizer_files,
        files=files,
        quantization=quantization,
        embeddings=embeddings,
        ops=ops,
        source=f.raw.get("source") if isinstance(f.raw.get("source"), dict) else {},
        format_version=version,
    )
    _check_weights_fit(f, manifest)
    for name in embeddings.files:
        if files[name].bytes != embeddings.nbytes:
            raise f.fail(("files", name, "bytes"), files[name].bytes,
                         f"{embeddings.nbytes} ({list(embeddings.shape)} {embeddings.dtype}, the embeddings section)")
    if manifest.defaults.gen_length >= dims.max_position_embeddings:
        raise f.fail("defaults.gen_length", manifest.defaults.gen_length,
                     f"fewer than max_position_embeddings {dims.max_position_embeddings}")
    # What the exporter wrote, section by section: catches consistent edits the checks above allow.
    for section in _SECTIONS:
        recorded, content = f.str(f"digests.{section}"), _digest(f.get(section))
        if recorded != content:
            raise RefusionError(
                f"{f.file}: section {section!r} differs from what the exporter wrote (digest {recorded}, content "
                f"{content}); refusion.json is not meant to be edited. {REEXPORT[0].upper()}{REEXPORT[1:]}."
            )
    return manifest


def _ops(f: Fields, graph: GraphName) -> str:
    """The graph's ops; "standard" where absent (v6 exports written before --ops)."""
    return f.str(f"graphs.{graph}.ops", GRAPH_OPS) if "ops" in f.object(f"graphs.{graph}") else "standard"


def _name(f: Fields, at: str, value: Any) -> str:
    """A plain file name inside the export directory (no paths)."""
    if not isinstance(value, str) or not value or "/" in value or "\\" in value or value in (".", ".."):
        raise f.fail(at, value, "plain file names")
    return value


def _read_spec(f: Fields, name: GraphName, expected: GraphSpec) -> GraphSpec:
    """The contract as recorded must be the one the dims imply, tensor by tensor."""
    for kind in ("inputs", "outputs"):
        recorded = f.list(f"graphs.{name}.{kind}")
        want: tuple[TensorSpec, ...] = getattr(expected, kind)
        for i, spec in enumerate(want):
            at = f"graphs.{name}.{kind}.{i}"
            if i >= len(recorded):
                raise RefusionError(f"{f.file}: field graphs.{name}.{kind} ends after {len(recorded)} tensors; "
                                    f"the model dims need {len(want)} (next: {spec.name}); {REEXPORT}.")
            got = recorded[i]
            if not isinstance(got, dict) or got != spec.to_json():
                raise f.fail(at, got, f"{spec.to_json()} (from the model dims)")
        if len(recorded) > len(want):
            raise f.fail(f"graphs.{name}.{kind}.{len(want)}", recorded[len(want)],
                         f"nothing: the model dims need {len(want)} tensors")
    return expected


def _read_weights(f: Fields, dims: ModelDims, export_dtype: str, quantization: Quantization | None,
                  embeddings: Embeddings) -> dict[str, WeightEntry]:
    """The index must hold exactly the tensors the dims and the quantization imply: in the export dtype,
    linear ones [in, out]; in an int4 export the decoder layers' linear weights (and lm_head with
    quantization.head) int4, each with its scales [K / block_size, N]; the embedding only where the graphs
    hold it."""
    tensors = f.object("weights.tensors")
    expected = graph_weights(weight_index(dims, export_dtype, quantization), embeddings)
    missing = [n for n in expected if n not in tensors]
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        what = f"lacks {missing[0]!r}" if missing else f"has unexpected {extra[0]!r}"
        kind = f", {quantization.method} block {quantization.block_size}" if quantization else ""
        kind += ", int4 lm_head" if quantization and quantization.head else ""
        raise RefusionError(f"{f.file}: field weights.tensors {what} for a {dims.num_layers}-layer model "
                            f"(tie_word_embeddings={dims.tie_word_embeddings}{kind}); {REEXPORT}.")
    block = f" and block_size {quantization.block_size}" if quantization else ""
    index = {}
    for name, (tensor_dtype, shape) in expected.items():
        at = ("weights", "tensors", name)
        f.str((*at, "dtype"), (tensor_dtype,))
        recorded = f.list((*at, "shape"))
        if recorded != list(shape):
            raise f.fail((*at, "shape"), recorded, f"{list(shape)} (from the model dims{block})")
        nbytes = f.int((*at, "nbytes"), 1)
        count = 1
        for d in shape:
            count *= d
        want = dtype(tensor_dtype).nbytes(count)
        if nbytes != want:
            raise f.fail((*at, "nbytes"), nbytes, f"{want} ({list(shape)} {tensor_dtype})")
        index[name] = WeightEntry(tensor_dtype, shape, f.int((*at, "offset")), nbytes)
    return index


def _check_weights_fit(f: Fields, m: ExportManifest) -> None:
    """Tensors lie inside weights.bin's recorded size and do not overlap."""
    size = m.files[m.weights_file].bytes
    end = 0
    for name, e in sorted(m.weights.items(), key=lambda item: item[1].offset):
        if e.offset < end or e.offset + e.nbytes > size:
            raise f.fail(("weights", "tensors", name, "offset"), e.offset,
                         f"a range inside {m.weights_file}'s {size} bytes that overlaps no other tensor")
        end = e.offset + e.nbytes


def graph_weights(index: dict[str, tuple[str, tuple[int, ...]]],
                  embeddings: Embeddings) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors of a weight index that weights.bin holds: all but a table kept on the host."""
    return {name: entry for name, entry in index.items() if not (embeddings.on_host and name == EMBEDDING_WEIGHT)}


def with_files(manifest: ExportManifest) -> ExportManifest:
    """The manifest with sizes and sha256 of its files as they are now on disk (the exporter's last step)."""
    names = [*manifest.model_files, *manifest.tokenizer_files]
    return replace(manifest, files={name: FileRecord.of(manifest.path / name) for name in sorted(names)})
