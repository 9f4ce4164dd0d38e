"""One weight file shared by both graphs, written one tensor at a time, and mapped back for validation.

Each tensor is converted to the export dtype (or arrives packed, as int4 weights do),
appended to `weights.bin` at a page-aligned offset (so backends can memory-map it), and
described by an ONNX initializer that points at it as external data. Both graphs reference
the same initializers, so the weights exist once on disk and the 2 GB protobuf limit never applies.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from onnx import TensorProto

from refusion.runtime.core.dtypes import dtype
from refusion.runtime.core.embeddings import EMBEDDING_WEIGHT, TABLE_FILE
from refusion.runtime.core.export_manifest import ExportManifest

if TYPE_CHECKING:
    import torch

ALIGNMENT = 4096

class WeightsWriter:
    def __init__(self, path: Path, dtype: str):
        self.path = path
        self.dtype = dtype
        self.initializers: dict[str, TensorProto] = {}
        self._file = open(path, "wb")
        self._offset = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, dtype(self.dtype).torch)

    def add(self, name: str, tensor: torch.Tensor) -> TensorProto:
        """Append `tensor` (converted to the export dtype) and return its initializer."""
        import torch

        # one copy even when transposed
        t = tensor.to(self.torch_dtype, memory_format=torch.contiguous_format).contiguous()
        # numpy has no bfloat16: write its raw bytes through a same-width integer view.
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
        return self._append(name, raw, self.dtype, tuple(t.shape))

    def add_packed(self, name: str, data: np.ndarray, dtype_name: str, shape: tuple[int, ...]) -> TensorProto:
        """Append bytes already in `dtype_name`'s storage (int4: two values a byte) for a tensor of `shape`."""
        row = dtype(dtype_name)
        count = 1
        for d in shape:
            count *= d
        assert data.dtype == row.numpy and data.nbytes == row.nbytes(count), (name, data.dtype, data.nbytes, shape)
        return self._append(name, data, dtype_name, shape)

    def _append(self, name: str, raw: np.ndarray, dtype_name: str, shape: tuple[int, ...]) -> TensorProto:
        pad = -self._offset % ALIGNMENT
        self._file.write(b"\0" * pad)
        self._offset += pad
        self._file.write(np.ascontiguousarray(raw).data)
        init = TensorProto()
        init.name = name
        init.data_type = dtype(dtype_name).onnx
        init.dims.extend(shape)
        init.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(self._offset)), ("length", str(raw.nbytes))):
            entry = init.external_data.add()
            entry.key, entry.value = key, value
        self._offset += raw.nbytes
        self.initializers[name] = init
        return init

    @property
    def bytes_written(self) -> int:
        return self._offset

    def close(self) -> int:
        """Flush to disk; returns the file size in bytes."""
        self._file.flush()
        self._file.close()
        return self._offset


def map_weights(manifest: ExportManifest) -> dict[str, np.ndarray]:
    """name -> view into the weights file (and a host embedding table's); nothing is copied or read until touched."""
    manifest.check_files(names=(manifest.weights_file, *manifest.embeddings.files))  # the index lies inside them
    file = manifest.path / manifest.weights_file
    blob = np.memmap(file, dtype=np.uint8, mode="c")  # copy-on-write: writable views for torch, pages still shared
    views = {}
    for name, e in manifest.weights.items():  # bf16 tensors come as their raw uint16 bits, int4 as packed bytes
        row = dtype(e.dtype)
        views[name] = blob[e.offset : e.offset + e.nbytes].view(row.numpy).reshape(row.storage_shape(e.shape))
    e = manifest.embeddings
    if e.on_host:  # the torch oracle embeds ids itself, from the same rows the runtime gathers
        views[EMBEDDING_WEIGHT] = np.memmap(manifest.path / TABLE_FILE, dtype(e.dtype).numpy, "c", shape=e.shape)
    return views
