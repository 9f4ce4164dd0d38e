"""`refusion.json`: everything the runtime needs about an export, read without torch or the HF config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refusion.runtime.core.contract import GRAPH_NAMES, GraphName, GraphSpec
from refusion.runtime.core.errors import RefusionError

MANIFEST_NAME = "refusion.json"
FORMAT = "refusion-onnx"
FORMAT_VERSION = 1


def check_format(raw: dict[str, Any], file: Path, fmt: str, version: int, redo: str) -> None:
    """A manifest written by another format or version is refused, saying what to redo."""
    if raw.get("format") != fmt or raw.get("format_version") != version:
        raise RefusionError(
            f"{file}: format {raw.get('format')!r} v{raw.get('format_version')!r} is not {fmt!r} "
            f"v{version}; {redo} with this version of refusion-trt."
        )


@dataclass(frozen=True)
class WeightEntry:
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ExportManifest:
    """What `refusion-export onnx` wrote: model dims, token ids, graph contracts, weight index."""

    path: Path  # the export directory
    model: dict[str, Any]
    dtype: str
    mask_token_id: int
    eos_token_id: int
    graphs: dict[GraphName, GraphSpec]
    graph_files: dict[GraphName, str]
    weights_file: str
    weights: dict[str, WeightEntry]
    tokenizer_files: tuple[str, ...]
    has_logits: bool
    raw: dict[str, Any]

    @property
    def num_layers(self) -> int:
        return int(self.model["num_layers"])

    @property
    def kv_heads(self) -> int:
        return int(self.model["kv_heads"])

    @property
    def head_dim(self) -> int:
        return int(self.model["head_dim"])

    @property
    def max_positions(self) -> int:
        return int(self.model["max_position_embeddings"])

    def graph_path(self, name: GraphName) -> Path:
        return self.path / self.graph_files[name]

    def require_files(self, *names: str) -> None:
        """Fail clearly when a file a backend needs is not in the directory."""
        for needed in names:
            if not (self.path / needed).is_file():
                raise RefusionError(
                    f"{self.path} is incomplete: {needed} is missing; re-run `refusion-export onnx`."
                )

    @staticmethod
    def load(path: str | Path) -> ExportManifest:
        path = Path(path)
        file = path / MANIFEST_NAME
        if not path.is_dir():
            raise RefusionError(f"{path} is not a directory; pass the output directory of `refusion-export onnx`.")
        if not file.is_file():
            raise RefusionError(
                f"{path} is not a refusion export: {MANIFEST_NAME} is missing. "
                f"Create one with `refusion-export onnx CHECKPOINT --output {path}`."
            )
        try:
            raw = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RefusionError(f"{file} is not valid JSON ({e}); re-run `refusion-export onnx`.") from e
        check_format(raw, file, FORMAT, FORMAT_VERSION, "re-export")
        graphs = {name: GraphSpec.from_json(name, raw["graphs"][name]) for name in GRAPH_NAMES}
        manifest = ExportManifest(
            path=path,
            model=raw["model"],
            dtype=raw["dtype"],
            mask_token_id=int(raw["tokens"]["mask_token_id"]),
            eos_token_id=int(raw["tokens"]["eos_token_id"]),
            graphs=graphs,
            graph_files={name: raw["graphs"][name]["file"] for name in GRAPH_NAMES},
            weights_file=raw["weights"]["file"],
            weights={
                n: WeightEntry(e["dtype"], tuple(e["shape"]), int(e["offset"]), int(e["nbytes"]))
                for n, e in raw["weights"]["tensors"].items()
            },
            tokenizer_files=tuple(raw["tokenizer"]["files"]),
            has_logits=bool(raw["graphs"]["planner"].get("logits", False)),
            raw=raw,
        )
        return manifest
