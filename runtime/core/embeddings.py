"""Where an export keeps its token embedding: in the graphs (a Gather over an initializer, the default) or on
the host (`refusion-export onnx --embeddings host`), as `embeddings.bin` beside the graphs.

A host table is raw, row-major `[vocab, hidden]` in the export dtype, refusion.json's `embeddings` section
records its file, dtype and shape, and the graphs take `inputs_embeds` [batch, seq, hidden] instead of
gathering it themselves. The runtime maps the file read-only and gathers the rows of the ids it feeds
(`EmbeddingTable.gather`, the one place that does), so only the pages of rows looked up become resident: on a
Jetson, where the CPU and the GPU share DRAM, the table costs the rows a request touches, not vocab x hidden.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from refusion.runtime.core.contract import INPUTS_EMBEDS
from refusion.runtime.core.dims import ModelDims
from refusion.runtime.core.dtypes import dtype
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.fields import Fields

Placement = Literal["graph", "host"]
PLACEMENTS: tuple[Placement, ...] = ("graph", "host")
EMBEDDING_WEIGHT = "model.embed_tokens.weight"  # the checkpoint's and weights.bin's name of the table
TABLE_FILE = "embeddings.bin"
TABLE_LAYOUT = "row-major [vocab, hidden]"


@dataclass(frozen=True)
class Embeddings:
    """refusion.json's `embeddings` section: the placement and, on the host, the table's dtype and shape."""

    placement: Placement = "graph"
    dtype: str = ""  # host: the export dtype
    shape: tuple[int, int] = (0, 0)  # host: (vocab, hidden)

    @property
    def on_host(self) -> bool:
        return self.placement == "host"

    @property
    def nbytes(self) -> int:
        return dtype(self.dtype).nbytes(self.shape[0] * self.shape[1]) if self.on_host else 0

    @property
    def fed_hidden(self) -> int | None:
        """The hidden size of the graphs' inputs_embeds (graph_specs' embeds_hidden): None where they gather."""
        return self.shape[1] if self.on_host else None

    @property
    def files(self) -> tuple[str, ...]:
        """The files of the section: the table's, on the host."""
        return (TABLE_FILE,) if self.on_host else ()

    @staticmethod
    def for_export(placement: str, dims: ModelDims, export_dtype: str) -> Embeddings:
        """What an export of `dims` writes for `--embeddings placement`; refused before any work when it cannot."""
        if placement not in PLACEMENTS:
            raise RefusionError(f"--embeddings {placement!r} is unknown; choose one of {', '.join(PLACEMENTS)}.")
        if placement == "graph":
            return Embeddings()
        if dims.tie_word_embeddings:
            raise RefusionError(
                "--embeddings host: this checkpoint ties its lm_head to the embedding (tie_word_embeddings), so the "
                "graphs' vocabulary head reads the whole table and it must stay on the device; export it with "
                "--embeddings graph (the default).")
        return Embeddings.implied(placement, dims, export_dtype)

    @staticmethod
    def implied(placement: str, dims: ModelDims, export_dtype: str) -> Embeddings:
        """The section a placement implies for these dims and dtype."""
        return Embeddings("host", export_dtype, (dims.vocab_size, dims.hidden_size)) if placement == "host" \
            else Embeddings()

    def to_json(self) -> dict[str, Any]:
        if not self.on_host:
            return {"placement": self.placement}
        return {"placement": self.placement, "file": TABLE_FILE, "layout": TABLE_LAYOUT, "dtype": self.dtype,
                "shape": list(self.shape)}

    @staticmethod
    def read(f: Fields, at: str, dims: ModelDims, export_dtype: str) -> Embeddings:
        """The section as recorded must be what the dims and the dtype imply."""
        placement = f.str(f"{at}.placement", PLACEMENTS)
        want = Embeddings.implied(placement, dims, export_dtype)
        if want.to_json() != f.object(at):
            raise f.fail(at, f.object(at), f"{want.to_json()} (from the model dims and dtype)")
        if want.on_host and dims.tie_word_embeddings:
            raise f.fail(f"{at}.placement", placement, "graph: a tied lm_head reads the table in the graphs")
        return want


class EmbeddingTable:
    """A host table mapped read-only; `gather` reads the rows of the ids asked, nothing else. Pages come in as
    rows are looked up (the map is advised random access, so no readahead brings their neighbours)."""

    def __init__(self, path: Path, embeddings: Embeddings):
        assert embeddings.on_host, "a graph-placed embedding has no table file"
        self.path = path
        self.embeddings = embeddings
        self._map: mmap.mmap | None = None
        self._rows: np.ndarray | None = None

    @property
    def rows(self) -> np.ndarray:
        """The table as a read-only [vocab, hidden] array over the map (mapped on first use)."""
        if self._rows is None:
            self._rows = self._mapped()
        return self._rows

    def load(self) -> None:
        """Map the table now (a runner's activation: a missing or damaged file is refused before any request)."""
        _ = self.rows

    def _mapped(self) -> np.ndarray:
        """The file mapped read-only, its size checked against the section; its cached pages dropped first."""
        e = self.embeddings
        try:
            file = open(self.path, "rb")
        except OSError as err:
            raise RefusionError(f"{self.path} cannot be read ({err.strerror}): the export's embedding table is "
                                "missing; re-export it (an engines directory: rebuild it from the export).") from err
        with file:
            size = os.fstat(file.fileno()).st_size
            if size != e.nbytes:  # an empty file cannot even be mapped
                raise RefusionError(f"{self.path} holds {size} bytes; refusion.json's embeddings section says "
                                    f"{e.nbytes} ({list(e.shape)} {e.dtype}): the export is damaged, re-export it.")
            _drop_cached(file.fileno())
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(mmap, "MADV_RANDOM"):  # no readahead: a lookup reads its rows' pages, not their neighbours
            self._map.madvise(mmap.MADV_RANDOM)
        return np.frombuffer(self._map, dtype(e.dtype).numpy).reshape(e.shape)

    def gather(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """inputs_embeds for `ids` [batch, seq]: [batch, seq, hidden] in the export dtype, a fresh array or `out`
        (a runner's pinned host memory, the upload's source)."""
        vocab = self.embeddings.shape[0]
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise RefusionError(f"token ids {int(ids.min())}..{int(ids.max())} lie outside the embedding table's "
                                f"{vocab} rows.")
        return np.take(self.rows, ids, axis=0, out=out)

    def close(self) -> None:
        """Let the map go (it is unmapped once nothing views it; a later gather maps again)."""
        self._rows = self._map = None

    @staticmethod
    def of(export_dir: Path, embeddings: Embeddings) -> EmbeddingTable | None:
        """The table of an export, or None where the graphs hold it."""
        return EmbeddingTable(export_dir / TABLE_FILE, embeddings) if embeddings.on_host else None


def _drop_cached(fd: int) -> None:
    """Drop the table's pages from the page cache before mapping it, where the OS allows. Whatever wrote or
    copied the file last (the exporter, the engine build, a copy to the device) left it cached, and on kernels
    whose page cache holds large folios (ext4 from Linux 6.x) a fault maps a whole cached folio: looking up 420
    rows made 99.9% of a 74 MiB table resident here (docs/runtime.md). Dropped, each lookup faults in its own
    pages. Pages other processes map stay; dirty ones are written back first."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:  # a filesystem without either: the cache stays as it is
        pass


def token_feed(table: EmbeddingTable | None, ids: np.ndarray, out: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The inputs a forward's token ids become: always `input_ids` (the verification head reads the next token's
    id), and `inputs_embeds` from the table where the export keeps it on the host (gathered into `out` if given)."""
    return {"input_ids": ids} if table is None else {"input_ids": ids, INPUTS_EMBEDS: table.gather(ids, out)}
