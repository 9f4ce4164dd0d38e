"""Memory-mapped views of an export's weight file, shared by every session that needs them."""

from __future__ import annotations

import numpy as np

from refusion.runtime.core.dtypes import dtype
from refusion.runtime.core.export_manifest import ExportManifest


def map_weights(manifest: ExportManifest) -> dict[str, np.ndarray]:
    """name -> read-only view into weights file; nothing is copied or read until touched."""
    manifest.check_files(names=(manifest.weights_file,))  # the index lies inside the recorded size
    file = manifest.path / manifest.weights_file
    blob = np.memmap(file, dtype=np.uint8, mode="c")  # copy-on-write: writable views for torch, pages still shared
    views = {}
    for name, e in manifest.weights.items():  # bf16 tensors come as their raw uint16 bits, int4 as packed bytes
        row = dtype(e.dtype)
        views[name] = blob[e.offset : e.offset + e.nbytes].view(row.numpy).reshape(row.storage_shape(e.shape))
    return views
