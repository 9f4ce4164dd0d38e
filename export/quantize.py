"""int4 weight-only quantization: a pass over the weights on their way into weights.bin, one method a handler.

The layers (export/model.py) and the graph builder (export/onnx_graph.py) do not change with
precision: the pass decides what the weight file holds, and the builder's one linear hook reads
a quantized weight back through DequantizeLinear (as gpt-fast's quantize.py rewrites weights and
onnxruntime-genai's make_matmul dispatches on them). Each method is a `QuantMethod` in `QUANT_METHODS`
(gpt-fast's QuantHandler): its own checks and calibration before anything is written (`plan`), and the float
tensors it hands to the rounding (`tensors`); every method then ends in the same round-to-nearest
(export/int4.py), written by `write_weight`. Two methods:

- int4-rtn: symmetric round-to-nearest per block of `block_size` input rows: scale = absmax / 7,
  q = round(w / scale) in [-7, 7]. The block's absmax lands exactly on +-7; -8 is never produced
  (|w / scale| <= 7), which keeps the grid symmetric, needs no zero point (TensorRT requires
  none), and never clips a block's largest weight, as absmax / 8 with [-8, 7] would on one side.
- int4-awq: activation-aware scaling first (export/awq.py: the float weights are rescaled and
  clipped using calibration activations), then the same rounding.

docs/quantization.md has the format, the choices and the measurements.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from refusion.export.int4 import pack_int4, rtn
from refusion.export.progress import Progress, line
from refusion.runtime.core.dims import ModelDims, expected_weights, is_linear_weight
from refusion.runtime.core.dtypes import dtype
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.quantization import (
    INT4_DTYPES,
    MIN_BLOCK,
    Quantization,
    block_problem,
    input_sizes,
    scale_name,
    tied_head_problem,
)

if TYPE_CHECKING:
    import torch
    from onnx import TensorProto

    from refusion.export.checkpoint import Checkpoint
    from refusion.export.weights_file import WeightsWriter

TESTED_BLOCKS = (64, 128)  # the block sizes TensorRT documents for INT4 weight-only


@dataclass(frozen=True)
class QuantizeOptions:
    """What `refusion-export onnx --quantize ...` asked for."""

    method: str  # int4-rtn | int4-awq
    block_size: int | None = None  # None: the largest of TESTED_BLOCKS that divides the model (default_block)
    calibration: Path | None = None  # int4-awq: a text file, one prompt per line; None: the built-in set
    calibration_samples: int | None = None  # the first N prompts; None: export/calibration.py's default
    head: bool = False  # --quantize-head: lm_head int4 too (untied heads only)


@dataclass(frozen=True)
class QuantPlan:
    """A checked request: what refusion.json will record, and the calibration prompts as token ids."""

    quantization: Quantization
    prompts: list[list[int]]


def plan_quantization(options: QuantizeOptions, ckpt: Checkpoint, export_dtype: str,
                      progress: Progress) -> QuantPlan:
    """Every check before anything is written: method, dtype, block size, then the method's own (calibration)."""
    method = QUANT_METHODS.get(options.method)
    if method is None:
        raise RefusionError(f"--quantize {options.method!r} is not supported; choose one of {', '.join(QUANT_METHODS)}.")
    if export_dtype not in INT4_DTYPES:
        raise RefusionError(
            f"--quantize {options.method} with --dtype {dtype(export_dtype).flag} is not supported: "
            "onnxruntime's CPU provider runs no bfloat16 MatMul (so the export cannot be validated) and TensorRT "
            "documents fp32 and fp16 scales only; use --dtype fp16 (TensorRT) or fp32.")
    if options.head and ckpt.dims.tie_word_embeddings:
        raise RefusionError(f"--quantize-head: {tied_head_problem()}.")
    block = default_block(ckpt.dims, progress) if options.block_size is None else options.block_size
    problem = block_problem(ckpt.dims, block)
    if problem:
        raise RefusionError(f"--block-size {block}: {problem}; pass another --block-size.")
    if block not in TESTED_BLOCKS:
        line(progress, f"note: --block-size {block}: TensorRT documents INT4 blocks of "
                       f"{' and '.join(map(str, TESTED_BLOCKS))} only; onnxruntime runs any power of two >= 16")
    return method.plan(options, ckpt, block, progress)


def default_block(dims: ModelDims, progress: Progress) -> int:
    """The largest block TensorRT documents (TESTED_BLOCKS: 128, else 64) that divides every linear's input,
    said in the progress output."""
    tested = sorted(TESTED_BLOCKS, reverse=True)
    for block in tested:
        if not block_problem(dims, block):
            sizes = ", ".join(f"{name} {k}" for name, k in input_sizes(dims).items())
            line(progress, f"int4 block size {block}: the largest of {' and '.join(map(str, tested))} that divides "
                           f"every linear's input ({sizes}); --block-size sets another")
            return block
    raise RefusionError(f"neither int4 block size {' nor '.join(map(str, tested))} (the ones TensorRT documents) "
                        f"fits: {block_problem(dims, tested[-1])}; pass --block-size (onnxruntime runs any power of "
                        f"two >= {MIN_BLOCK} that divides them).")


def float_tensors(ckpt: Checkpoint, plan: QuantPlan | None, progress: Progress) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors (HF layout) in weight-file order, as the planned method hands them to the rounding."""
    if plan is None:
        return ckpt.tensors(list(expected_weights(ckpt.dims)))
    return QUANT_METHODS[plan.quantization.method].tensors(ckpt, plan, progress)


def write_weight(writer: WeightsWriter, name: str, tensor: torch.Tensor,
                 quantization: Quantization | None) -> list[TensorProto]:
    """Write one checkpoint tensor (HF layout; linear weights become [in, out]); a quantized one as
    int4 plus its scales. Returns the initializers written."""
    t = tensor.T if is_linear_weight(name) else tensor
    if quantization is None or not quantization.quantizes(name):
        return [writer.add(name, t)]
    q, scale = rtn(t, quantization.block_size, writer.torch_dtype)
    return [writer.add_packed(name, pack_int4(q.numpy()), "int4", tuple(t.shape)),
            writer.add(scale_name(name), scale)]


class QuantMethod(ABC):
    """One --quantize method (gpt-fast's QuantHandler). `calibrated`: it runs calibration prompts, so refusion.json
    records them (the format's CALIBRATED lists the same methods: tests/export/test_quantize.py holds the two
    together). The default `tensors` are the checkpoint's own; a method that rewrites the float weights first
    (AWQ) hands out its rewritten ones."""

    name: ClassVar[str]
    calibrated: ClassVar[bool]

    @abstractmethod
    def plan(self, options: QuantizeOptions, ckpt: Checkpoint, block: int, progress: Progress) -> QuantPlan:
        """The method's own checks and preparation (calibration prompts), before anything is written."""

    def tensors(self, ckpt: Checkpoint, plan: QuantPlan, progress: Progress) -> Iterator[tuple[str, torch.Tensor]]:
        """The float tensors (HF layout, weight-file order) the rounding writes."""
        return ckpt.tensors(list(expected_weights(ckpt.dims)))


class RoundToNearest(QuantMethod):
    """int4-rtn: the checkpoint's weights, rounded as they are."""

    name, calibrated = "int4-rtn", False

    def plan(self, options: QuantizeOptions, ckpt: Checkpoint, block: int, progress: Progress) -> QuantPlan:
        if options.calibration is not None or options.calibration_samples is not None:
            calibrated = [m.name for m in QUANT_METHODS.values() if m.calibrated]
            raise RefusionError(f"--calibration and --calibration-samples apply to "
                                f"{', '.join(calibrated)} only, not {self.name}; drop them.")
        return QuantPlan(Quantization(self.name, block, head=options.head), [])


class ActivationAware(QuantMethod):
    """int4-awq: the float weights rescaled and clipped on calibration activations (export/awq.py), then rounded."""

    name, calibrated = "int4-awq", True

    def plan(self, options: QuantizeOptions, ckpt: Checkpoint, block: int, progress: Progress) -> QuantPlan:
        from refusion.export.calibration import calibration_set

        prompts, sha = calibration_set(ckpt, options.calibration, options.calibration_samples, progress)
        return QuantPlan(Quantization(self.name, block, len(prompts), sha, options.head), prompts)

    def tensors(self, ckpt: Checkpoint, plan: QuantPlan, progress: Progress) -> Iterator[tuple[str, torch.Tensor]]:
        from refusion.export.awq import awq_tensors  # torch at import: only when this method runs

        q = plan.quantization
        return awq_tensors(ckpt, plan.prompts, q.block_size, progress, q.head)


QUANT_METHODS: dict[str, QuantMethod] = {m.name: m for m in (RoundToNearest(), ActivationAware())}
