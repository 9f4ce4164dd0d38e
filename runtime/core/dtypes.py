"""The one dtype table: each element type under every name the project's formats and backends use.

refusion.json and the graph contract name types as numpy does ("float16"); the CLIs say
"fp16"; ONNX, onnxruntime, TensorRT, torch and safetensors each have their own spelling. Everything
converts through this table, so adding a type (int4 weights, say) is one row here.
numpy has no bfloat16: its bytes live in a same-width unsigned integer (`storage`), and
whoever hands them to torch or a device reinterprets them. int4 (quantized linear weights)
is packed two to a byte, so its sizes come from `nbytes` and `storage_shape`, not `itemsize`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refusion.runtime.core.errors import RefusionError


@dataclass(frozen=True)
class DType:
    name: str  # numpy-style name, as written in refusion.json and the contract
    flag: str | None  # CLI spelling of an export dtype (--dtype / --precision); None for other types
    onnx: int  # onnx.TensorProto.DataType value
    trt: str  # tensorrt.DataType member name
    torch: str  # torch attribute name
    safetensors: str | None  # dtype string in a safetensors header
    onnxruntime: str  # onnxruntime's type string of a session input or output
    storage: str  # numpy dtype that holds the bytes on the host
    per_item: int = 1  # elements per storage item: int4 packs two to a byte (ONNX order: first in the low nibble)

    @property
    def numpy(self) -> np.dtype:
        return np.dtype(self.storage)

    @property
    def itemsize(self) -> int:
        """Bytes of one storage item (for int4: of a byte holding two elements)."""
        return self.numpy.itemsize

    def nbytes(self, count: int) -> int:
        """Bytes that `count` elements take on disk (packed types round up to a whole item)."""
        return -(-count // self.per_item) * self.itemsize

    def storage_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the host array holding a tensor: the shape itself, or a flat run of packed items."""
        if self.per_item == 1:
            return shape
        count = 1
        for d in shape:
            count *= d
        return (-(-count // self.per_item),)


_TABLE = (
    DType("float32", "fp32", 1, "FLOAT", "float32", "F32", "tensor(float)", "float32"),
    DType("float16", "fp16", 10, "HALF", "float16", "F16", "tensor(float16)", "float16"),
    DType("bfloat16", "bf16", 16, "BF16", "bfloat16", "BF16", "tensor(bfloat16)", "uint16"),
    DType("int64", None, 7, "INT64", "int64", "I64", "tensor(int64)", "int64"),
    DType("int32", None, 6, "INT32", "int32", "I32", "tensor(int32)", "int32"),
    DType("bool", None, 9, "BOOL", "bool", "BOOL", "tensor(bool)", "bool"),
    DType("uint8", None, 2, "UINT8", "uint8", None, "tensor(uint8)", "uint8"),  # vocab_mask's bits
    # quantized weights (docs/quantization.md)
    DType("int4", None, 22, "INT4", "int4", None, "tensor(int4)", "uint8", per_item=2),
)
_BY_NAME = {d.name: d for d in _TABLE}

# The float types an export (weights and KV) can have, by CLI flag: fp32, fp16, bf16.
EXPORT_DTYPES: dict[str, DType] = {d.flag: d for d in _TABLE if d.flag is not None}


def dtype(name: str) -> DType:
    """The table row of a numpy-style type name; a RefusionError naming the known ones otherwise."""
    if isinstance(name, str) and name in _BY_NAME:
        return _BY_NAME[name]
    raise RefusionError(f"dtype {name!r} is unknown; expected one of {', '.join(_BY_NAME)}.")


def from_flag(flag: str) -> DType:
    """fp32 | fp16 | bf16 -> the export dtype."""
    if flag in EXPORT_DTYPES:
        return EXPORT_DTYPES[flag]
    raise RefusionError(f"dtype {flag!r} is not supported; choose one of {', '.join(EXPORT_DTYPES)}.")


def from_onnx(value: int) -> DType | None:
    return next((d for d in _TABLE if d.onnx == value), None)


def from_trt(member: str) -> DType | None:
    return next((d for d in _TABLE if d.trt == member), None)


def from_safetensors(name: str) -> DType | None:
    return next((d for d in _TABLE if d.safetensors == name), None)


def from_onnxruntime(type_string: str) -> DType | None:
    return next((d for d in _TABLE if d.onnxruntime == type_string), None)
