"""int4 arithmetic, shared by every quantization method and the validation model: symmetric round-to-nearest
per block (`rtn`), the nibble packing weights.bin holds (`pack_int4`, `unpack_int4`), and what the graphs'
DequantizeLinear computes from it (`dequantize`). A leaf: it imports nothing of ours, so the methods
(export/quantize.py, export/awq.py) and the torch model (export/model.py) all import it without a circle.
docs/quantization.md has the format and why the grid is [-7, 7].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

QMAX = 7  # symmetric: q in [-7, 7]


def rtn(w: torch.Tensor, block: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest of w [K, N] per block of `block` rows: (q int8 [K, N] in [-7, 7],
    scale [K / block, N] in `scale_dtype`). q is rounded against the stored (dtype-rounded) scale."""
    import torch

    k, n = w.shape
    blocks = w.float().reshape(k // block, block, n)
    scale = (blocks.abs().amax(dim=1) / QMAX).to(scale_dtype)
    scale = torch.where(scale.float() > 0, scale, torch.ones_like(scale))  # all-zero (or underflowing) blocks
    q = torch.round(blocks / scale.float()[:, None, :]).clamp(-QMAX, QMAX).to(torch.int8)
    return q.reshape(k, n), scale


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int8 values in [-8, 7] -> bytes, two per byte, the first element in the low nibble (ONNX's order)."""
    flat = q.reshape(-1).astype(np.uint8) & 0x0F
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return flat[0::2] | (flat[1::2] << 4)


def unpack_int4(packed: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """pack_int4's inverse: int8 values of `shape`."""
    nibbles = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(-1).astype(np.int8)
    count = int(np.prod(shape))
    return ((nibbles[:count] ^ 8) - 8).reshape(shape)  # sign-extend 4 bits


def dequantize(packed: np.ndarray, scale: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """What DequantizeLinear(axis 0, block_size K / scale rows) computes: q x scale, float32 [K, N]
    (exact: a 4-bit integer times a float16 or float32 scale fits in float32)."""
    k, _ = shape
    block = k // scale.shape[0]
    return unpack_int4(packed, shape).astype(np.float32) * np.repeat(scale.astype(np.float32), block, axis=0)

