"""`engines.json`: what the engine was built from, for, and with; checked before any deserialization.

One engine, built from the export's infiller graph, serves both roles through its profiles
(runtime/core/profiles.py), so the weights are resident once. Format v1 described two engines,
planner and infiller, each holding all the weights; it is refused with the rebuild command.
Format v3 adds the batch dimension (`limits.max_batch`, each profile's `batch` range); a v2
manifest is read as what its engine is, batch 1 in every profile, so it needs no rebuild.

A TensorRT engine only runs on the GPU model and TensorRT version it was built with, and a
truncated or swapped file can crash the deserializer instead of failing cleanly. So loading
checks, in order: the manifest's format, the TensorRT version and GPU recorded against the
ones here, then the engine file's size, and its sha256 when asked to verify (`refusion-export check`,
`--verify`): hashing reads the whole engine, 16 GB for ReFusion-8B, seconds on every start.
Every refusal carries the exact command that rebuilds the engine here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from refusion.runtime.core.contract import GraphName
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import MANIFEST_NAME, check_format
from refusion.runtime.core.fields import Fields
from refusion.runtime.core.files import sha256_file
from refusion.runtime.core.profiles import DecodeLimits, ProfileSpec

ENGINES_MANIFEST = "engines.json"
FORMAT = "refusion-engines"
FORMAT_VERSION = 3  # v1: a planner and an infiller engine; v2: batch 1 only (still read)
READABLE_VERSIONS = (2, FORMAT_VERSION)
ENGINE_FILE = "model.engine"
ENGINE_GRAPH: GraphName = "infiller"  # the graph the engine is built from; planner forwards run on it too


@dataclass(frozen=True)
class Target:
    """Where engines run: the TensorRT version and the GPU they were built with."""

    tensorrt: str
    gpu: str
    compute_capability: str  # "major.minor"

    def to_json(self) -> dict[str, str]:
        return {"tensorrt": self.tensorrt, "gpu": self.gpu, "compute_capability": self.compute_capability}


@dataclass(frozen=True)
class EngineFile:
    file: str
    sha256: str
    bytes: int
    profiles: tuple[ProfileSpec, ...]

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "sha256": self.sha256, "bytes": self.bytes,
                "profiles": [p.to_json() for p in self.profiles]}


@dataclass(frozen=True)
class EngineManifest:
    path: Path  # the engines directory
    target: Target
    precision: str  # numpy dtype name of weights and KV: float32, float16, bfloat16
    strongly_typed: bool
    limits: DecodeLimits
    engine: EngineFile
    source: dict[str, Any]  # export directory and sha256 of its graphs and weights
    build: dict[str, Any]  # the command that made these engines, timings

    @property
    def rebuild_command(self) -> str:
        return str(self.build["command"])

    def write(self) -> None:
        data = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "target": self.target.to_json(),
            "precision": self.precision,
            "strongly_typed": self.strongly_typed,
            "limits": self.limits.to_json(),
            "engine": self.engine.to_json(),
            "source": self.source,
            "build": self.build,
        }
        (self.path / ENGINES_MANIFEST).write_text(json.dumps(data, indent=1))

    @staticmethod
    def load(path: str | Path) -> EngineManifest:
        path = Path(path)
        file = path / ENGINES_MANIFEST
        if not file.is_file():
            if (path / MANIFEST_NAME).is_file():  # an export: the engines go to a directory of their own
                engines = path.parent / "engines"
                raise RefusionError(
                    f"{path} holds no TensorRT engines ({ENGINES_MANIFEST} is missing): it is an export. Build them "
                    f"with `refusion-export build {path} --output {engines}` and pass {engines}, or run the export "
                    "itself on onnxruntime (--backend ort-cpu or ort-cuda).")
            raise RefusionError(
                f"{path} holds no TensorRT engines ({ENGINES_MANIFEST} is missing); build them with "
                f"`refusion-export build EXPORT_DIR --output {path}`."
            )
        try:
            raw = json.loads(file.read_text())
            if isinstance(raw, dict) and raw.get("format") == FORMAT and raw.get("format_version") == 1:
                raise RefusionError(
                    f"{file} describes v1 engines: a planner and an infiller engine, each holding all the weights. "
                    "This refusion-trt runs one engine that serves both and holds the weights once; rebuild with: "
                    f"{_v1_command(raw, path)}"
                )
            version = raw.get("format_version") if isinstance(raw, dict) else None
            readable = version if version in READABLE_VERSIONS else FORMAT_VERSION
            check_format(Fields(file, raw, "rebuild the engines"), FORMAT, readable, "rebuild the engines")
            if version != 2 and ("max_batch" not in raw["limits"]
                                 or any("batch" not in p for p in raw["engine"]["profiles"])):
                raise KeyError("max_batch or a profile's batch: v3 records the batch dimension")  # not v2's default
            entry = raw["engine"]
            engine = EngineFile(entry["file"], entry["sha256"], int(entry["bytes"]),
                                tuple(ProfileSpec.from_json(p) for p in entry["profiles"]))
            manifest = EngineManifest(
                path=path,
                target=Target(**raw["target"]),
                precision=raw["precision"],
                strongly_typed=bool(raw["strongly_typed"]),
                limits=DecodeLimits.from_json(raw["limits"]),
                engine=engine,
                source=raw["source"],
                build=raw["build"],
            )
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise RefusionError(f"{file} is damaged ({type(e).__name__}: {e}); rebuild the engines.") from e
        manifest.check_batch()
        return manifest

    def check_batch(self) -> None:
        """The profiles' batch ranges must reach limits.max_batch and no further (the runner sizes
        its batches by the limit, TensorRT refuses shapes by the profiles)."""
        widest = max((p.batch[2] for p in self.engine.profiles), default=0)
        if widest != self.limits.max_batch:
            raise RefusionError(
                f"{self.path / ENGINES_MANIFEST} is inconsistent: its limits say --max-batch {self.limits.max_batch} "
                f"but its profiles take at most {widest} rows; it was edited or damaged. Rebuild with: "
                f"{self.rebuild_command}"
            )

    def verify_target(self, here: Target) -> None:
        """Refuse engines built for another TensorRT or GPU, with the rebuild command."""
        built = self.target
        if built.tensorrt != here.tensorrt:
            what = f"TensorRT {built.tensorrt}, and this machine has TensorRT {here.tensorrt}"
        elif built.compute_capability != here.compute_capability or built.gpu != here.gpu:
            what = (f"a {built.gpu} (compute capability {built.compute_capability}), and this GPU is a "
                    f"{here.gpu} (compute capability {here.compute_capability})")
        else:
            return
        raise RefusionError(
            f"the engines in {self.path} were built with {what}; TensorRT engines only run where they were "
            f"built. Rebuild them here with: {self.rebuild_command}"
        )

    def verify_file(self, digest: bool = True) -> None:
        """Check the engine file's size and, with `digest`, its sha256 against the manifest. Hashing streams the
        file, so a 16 GiB engine is never held twice; run it before deserializing it."""
        file, entry = self.engine_path, self.engine
        if not file.is_file():
            raise RefusionError(f"{file} is missing; rebuild the engine with: {self.rebuild_command}")
        size = file.stat().st_size
        if size != entry.bytes:
            raise RefusionError(
                f"{file} has {size} bytes and {ENGINES_MANIFEST} records {entry.bytes}: the file is truncated "
                f"or was replaced. Rebuild with: {self.rebuild_command}"
            )
        if not digest:
            return
        found = sha256_file(file)
        if found != entry.sha256:
            raise RefusionError(
                f"{file} does not match {ENGINES_MANIFEST} (sha256 {found[:16]}..., recorded "
                f"{entry.sha256[:16]}...): the file was modified or damaged. Rebuild with: {self.rebuild_command}"
            )

    @property
    def engine_path(self) -> Path:
        return self.path / self.engine.file


def _v1_command(raw: dict[str, Any], path: Path) -> str:
    """The rebuild command a v1 engines.json recorded, or its general form."""
    build = raw.get("build")
    command = build.get("command") if isinstance(build, dict) else None
    return command if isinstance(command, str) else f"refusion-export build EXPORT_DIR --output {path} --force"
