"""Strict loading of a ReFusion checkpoint directory (Hugging Face layout, safetensors only).

Weights are read lazily through memory-mapped safetensors, one tensor at a time, so the
exporter never holds the whole model in memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refusion.runtime.core.defaults import DecodeDefaults
from refusion.runtime.core.dims import ModelDims, expected_weights
from refusion.runtime.core.dtypes import from_safetensors
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.fields import Fields

if TYPE_CHECKING:
    import torch

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
SUPPORTED_DTYPES = ("BF16", "F16", "F32")  # safetensors names of the float types a checkpoint may hold
CONVERT_HINT = (
    "convert it once with transformers: "
    "AutoModelForCausalLM.from_pretrained(SRC).save_pretrained(DST, safe_serialization=True)"
)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: dict[str, Any]
    dims: ModelDims
    mask_token_id: int
    source_dtype: str  # dtype of the stored weights: bfloat16, float16 or float32
    files: dict[str, Path]  # tensor name -> safetensors file holding it

    @staticmethod
    def open(path: str | Path, mask_token_id: int | None = None) -> Checkpoint:
        path = Path(path)
        if not path.is_dir():
            raise RefusionError(f"checkpoint {path} is not a directory; pass a local Hugging Face model directory.")
        config = _read_json(path / "config.json", "a ReFusion checkpoint carries config.json")
        dims = ModelDims.from_hf_config(config, str(path / "config.json"))
        mask_id = _mask_token_id(config, mask_token_id, dims, path)
        files = _tensor_files(path)
        return Checkpoint(path, config, dims, mask_id, _check_tensors(path, dims, files), files)

    def tensors(self, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) one at a time, memory-mapped, in the order asked."""
        order = names if names is not None else list(expected_weights(self.dims))
        for name in order:
            # A handle per tensor: the pages a tensor touched count as our RSS while its shard stays mapped, and
            # the mapping goes with the handle and the tensor, not with the shard's last tensor (a one-shard
            # one-layer ReFusion-8B kept 2.8 GiB of file pages resident until the lm_head, the last tensor).
            with _open_safetensors(self.files[name]) as handle:
                tensor = handle.get_tensor(name)
            yield name, tensor
            del tensor  # before the next tensor is read, if the caller has dropped it too

    def decode_defaults(self) -> DecodeDefaults:
        """The checkpoint's own decode settings (`refusion_decode` in generation_config.json), else
        the paper's gsm8k row; the exporter clamps them to the model's positions."""
        file = self.path / "generation_config.json"
        if not file.is_file():
            return DecodeDefaults()
        raw = _read_json(file, "")
        if "refusion_decode" not in raw:
            return DecodeDefaults()
        return DecodeDefaults.read(Fields(file, raw, "fix or remove refusion_decode there"), "refusion_decode")

    def eos_token_id(self) -> int:
        """The id generation stops at: the tokenizer's eos_token, as upstream uses it."""
        from refusion.runtime.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(self.path)
        if tok.eos_token_id is not None:
            return tok.eos_token_id
        eos = self.config.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if not isinstance(eos, int):
            raise RefusionError(
                f"checkpoint {self.path}: no eos_token in tokenizer_config.json and no eos_token_id in config.json; "
                "add one so generation knows where to stop."
            )
        return eos


def _check_tensors(path: Path, dims: ModelDims, files: dict[str, Path]) -> str:
    """Every expected tensor present, with the right shape and one supported dtype; returns
    the checkpoint's weight dtype."""
    expected = expected_weights(dims)
    present = set(files)
    if dims.tie_word_embeddings:
        present.discard("lm_head.weight")  # some exporters store the tied copy too
    missing = [n for n in expected if n not in present]
    if missing:
        raise RefusionError(
            f"checkpoint {path}: {len(missing)} weight(s) missing, first {missing[0]!r}; "
            "the checkpoint is incomplete or not a Qwen3ForCausalLM (check every shard is there)."
        )
    unexpected = sorted(present - set(expected))
    if unexpected:
        raise RefusionError(
            f"checkpoint {path}: unexpected weight {unexpected[0]!r} ({len(unexpected)} in all); "
            "expected exactly the tensors of a plain Qwen3ForCausalLM."
        )
    dtypes: set[str] = set()
    for file, names in _group_by_file(files, expected).items():
        with _open_safetensors(file) as f:
            for name in names:
                sl = f.get_slice(name)
                shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
                if shape != expected[name]:
                    raise RefusionError(
                        f"checkpoint {path}: tensor {name!r} in {file.name} has shape {list(shape)}, "
                        f"expected {list(expected[name])} from config.json; config and weights disagree."
                    )
                row = from_safetensors(dtype)
                if dtype not in SUPPORTED_DTYPES or row is None:
                    raise RefusionError(
                        f"checkpoint {path}: tensor {name!r} has dtype {dtype}; "
                        f"expected one of {sorted(SUPPORTED_DTYPES)}."
                    )
                dtypes.add(row.name)
    # bf16 checkpoints commonly keep some norms in fp32; report the widest 16-bit type present.
    for d in ("bfloat16", "float16", "float32"):
        if d in dtypes:
            return d
    raise AssertionError("no tensors checked")


def _read_json(file: Path, why: str) -> dict[str, Any]:
    if not file.is_file():
        raise RefusionError(f"{file} not found; {why}.")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RefusionError(f"{file} is not valid JSON ({e}); restore it from the original checkpoint.") from e
    if not isinstance(raw, dict):
        raise RefusionError(f"{file} holds a JSON {type(raw).__name__}, not an object; restore it from the original checkpoint.")
    return raw


def _mask_token_id(config: dict[str, Any], override: int | None, dims: ModelDims, path: Path) -> int:
    mask_id = override if override is not None else config.get("mask_token_id")
    if mask_id is None:
        raise RefusionError(
            f"{path / 'config.json'} has no mask_token_id; ReFusion checkpoints carry one "
            "(151670 for GSAI-ML/ReFusion). Pass --mask-token-id ID if you know it."
        )
    if not isinstance(mask_id, int) or not 0 <= mask_id < dims.vocab_size:
        raise RefusionError(f"mask_token_id={mask_id!r} is outside the vocabulary [0, {dims.vocab_size}).")
    return mask_id


def _tensor_files(path: Path) -> dict[str, Path]:
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        weight_map = _read_json(index, "a sharded checkpoint carries its index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise RefusionError(f"{index} has no weight_map; restore it from the original checkpoint.")
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise RefusionError(f"shard {shard.name} listed in {index.name} is missing from {path}.")
        return files
    if single.is_file():
        with _open_safetensors(single) as f:
            return {name: single for name in f.keys()}
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise RefusionError(
            f"checkpoint {path} holds pickle weights ({', '.join(pickles)}), which refusion-trt refuses to load: "
            f"unpickling can run arbitrary code and cannot be memory-mapped. {CONVERT_HINT}."
        )
    raise RefusionError(f"checkpoint {path} has no model.safetensors or model.safetensors.index.json.")


def _open_safetensors(file: Path) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises its own SafetensorError or OSError
        raise RefusionError(
            f"{file} is not a readable safetensors file ({e}); it may be truncated: download or copy it again."
        ) from e


def _group_by_file(files: dict[str, Path], names: dict[str, Any]) -> dict[Path, list[str]]:
    groups: dict[Path, list[str]] = {}
    for name in names:
        groups.setdefault(files[name], []).append(name)
    return groups
