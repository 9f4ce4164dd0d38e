"""What an int4 export records (refusion.json's `quantization` section) and the weight index it implies.

int4 weight-only quantization: every decoder layer's linear weight W[K, N] (q, k, v, o, gate,
up, down; stored [in, out]) is symmetric INT4, packed two to a byte in weights.bin, with one
scale per block of `block_size` input rows per output column: `<weight>_scale` [K/B, N] in the
export's float dtype, no zero point. With `head` (`--quantize-head`) an untied lm_head [hidden, vocab]
is quantized the same way; embeddings and norms stay float. The graphs read each as
DequantizeLinear(axis 0, block_size B) -> MatMul (opset 21), the pattern TensorRT and onnxruntime
both take. docs/quantization.md has the methods and the measurements.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from refusion.runtime.core.dims import ModelDims, expected_weights, is_linear_weight
from refusion.runtime.core.fields import Fields

METHODS = ("int4-rtn", "int4-awq")
CALIBRATED = ("int4-awq",)  # the methods that run calibration prompts
BITS = 4
INT4_OPSET = 21  # INT4 and DequantizeLinear's block_size are opset 21
INT4_DTYPES = ("float32", "float16")  # scale (and graph) dtypes: TensorRT documents fp32/fp16 scales, ORT CPU runs both
MIN_BLOCK = 16  # onnxruntime fuses DequantizeLinear -> MatMul into MatMulNBits for powers of two >= 16
SCALE_SUFFIX = "_scale"
HEAD = "lm_head.weight"


def is_quantized_weight(name: str) -> bool:
    """The decoder layers' linear weights, quantized by every int4 export (lm_head only with
    Quantization.head: Quantization.quantizes)."""
    return name.startswith("model.layers.") and is_linear_weight(name)


def tied_head_problem() -> str:
    """Why a tied head cannot be int4 (the one sentence the exporter and the reader both say)."""
    return ("the model ties lm_head to the embedding (tie_word_embeddings=true), so the head is the float table the "
            "embedding Gather reads; an int4 copy of it would add a second vocab x hidden tensor instead of "
            "saving one. Drop --quantize-head (the layers' linears are still int4)")


def scale_name(weight: str) -> str:
    return weight + SCALE_SUFFIX


def input_sizes(dims: ModelDims) -> dict[str, int]:
    """The K (input size) of each quantized linear, by the dims that set it."""
    return {"hidden_size": dims.hidden_size, "num_heads x head_dim": dims.q_size,
            "intermediate_size": dims.intermediate_size}


def largest_block(dims: ModelDims) -> int | None:
    """The largest power-of-two block (>= MIN_BLOCK) dividing every K; None when there is none."""
    block = None
    b = MIN_BLOCK
    while all(k % b == 0 for k in input_sizes(dims).values()):
        block, b = b, b * 2
    return block


def block_problem(dims: ModelDims, block: int) -> str:
    """Why `block` cannot quantize a model of `dims` (empty when it can)."""
    if block < MIN_BLOCK or block & (block - 1):
        return (f"block size {block} is not a power of two >= {MIN_BLOCK} "
                "(onnxruntime fuses only those into MatMulNBits)")
    bad = [f"{name} {k}" for name, k in input_sizes(dims).items() if k % block]
    if not bad:
        return ""
    sizes = ", ".join(f"{name} {k}" for name, k in input_sizes(dims).items())
    fit = largest_block(dims)
    hint = (f"the largest power of two that divides all of {sizes} is {fit}" if fit
            else f"no power of two >= {MIN_BLOCK} divides all of {sizes}, so this model cannot be quantized")
    return f"block size {block} does not divide {' and '.join(bad)} (linear input sizes); {hint}"


@dataclass(frozen=True)
class Quantization:
    method: str  # one of METHODS
    block_size: int
    calibration_samples: int = 0  # int4-awq: prompts run through the torch definition
    calibration_sha256: str | None = None  # int4-awq: of the calibration set (export/calibration.py says of what)
    head: bool = False  # lm_head int4 too (untied heads only)

    bits = BITS

    def quantizes(self, name: str) -> bool:
        """Whether weights.bin holds `name` as int4: the layers' linears, and lm_head with `head`."""
        return is_quantized_weight(name) or (self.head and name == HEAD)

    def flags(self) -> str:
        """The refusion-export onnx flags that make this quantization again."""
        return f"--quantize {self.method} --block-size {self.block_size}{' --quantize-head' if self.head else ''}"

    def to_json(self) -> dict[str, Any]:
        calibration = ({"samples": self.calibration_samples, "sha256": self.calibration_sha256}
                       if self.method in CALIBRATED else None)
        return {"method": self.method, "bits": self.bits, "block_size": self.block_size, "head": self.head,
                "calibration": calibration}

    @staticmethod
    def read(f: Fields, at: str, dims: ModelDims, export_dtype: str) -> Quantization | None:
        """The section as recorded (None: a float export), checked against the dims and the dtype."""
        if f.get(at) is None:
            return None
        f.object(at)
        method = f.str(f"{at}.method", METHODS)
        f.int(f"{at}.bits", BITS, BITS + 1)
        block = f.positive_int(f"{at}.block_size")
        problem = block_problem(dims, block)
        if problem:
            raise f.fail(f"{at}.block_size", block, f"a block size the model's dims allow ({problem})")
        if export_dtype not in INT4_DTYPES:
            raise f.fail("dtype", export_dtype, f"one of {', '.join(INT4_DTYPES)} for an int4 export")
        # absent in exports made before --quantize-head (same format version): their lm_head is float
        head = f.bool(f"{at}.head") if "head" in f.get(at) else False
        if head and dims.tie_word_embeddings:
            raise f.fail(f"{at}.head", head, f"false: {tied_head_problem()}")
        if method not in CALIBRATED:
            if f.get(f"{at}.calibration") is not None:
                raise f.fail(f"{at}.calibration", f.get(f"{at}.calibration"), f"null for {method}")
            return Quantization(method, block, head=head)
        samples = f.positive_int(f"{at}.calibration.samples")
        sha = f.str(f"{at}.calibration.sha256")
        if not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise f.fail(f"{at}.calibration.sha256", sha, "64 lowercase hex digits")
        return Quantization(method, block, samples, sha, head)


def weight_index(dims: ModelDims, export_dtype: str,
                 quantization: Quantization | None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor in weights.bin, in writing order: linear weights [in, out],
    each quantized one (Quantization.quantizes) followed by its scales [K / block, N]."""
    index: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, hf_shape in expected_weights(dims).items():
        shape = tuple(reversed(hf_shape)) if is_linear_weight(name) else hf_shape
        if quantization is not None and quantization.quantizes(name):
            k, n = shape
            index[name] = ("int4", shape)
            index[scale_name(name)] = (export_dtype, (k // quantization.block_size, n))
        else:
            index[name] = (export_dtype, shape)
    return index
