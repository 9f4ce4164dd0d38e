"""`--embeddings host` at run time: every runner gets the rows through the Runner interface and decodes the tokens
of the graph-embedding export of the same checkpoint (greedy, AR and ReFusion); only looked-up rows are resident."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.runners.onnxruntime import OrtRunner
from refusion.runtime.runners.tensorrt import TensorRTRunner
from refusion.tools.bench.measure.embedding_memory import mapped_rss, row_pages
from tests.fakes import CpuBoundCudaRunner
from tests.helpers import MIXED_SETTINGS, PEAKY_JOBS, REPO, chat_jobs, decode_alone, decode_alone_on, export_unvalidated, fake_engines
from tests.runtime.runners.test_batching import LIMITS, count_packed, serve_together

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny_host(tmp_path_factory) -> Path:
    """The embedded model with its table on the host."""
    return export_unvalidated(REPO / "models" / "refusion-tiny", tmp_path_factory.mktemp("tiny-host") / "onnx", embeddings="host")


@pytest.fixture(scope="module")
def jobs(tiny_export) -> list[tuple[list[int], dict]]:
    return chat_jobs(tiny_export, 10, MIXED_SETTINGS)


@pytest.fixture(scope="module")
def graph_tokens(tiny_export, jobs) -> list[list[int]]:
    """The oracle: the graph-embedding export, each job alone on onnxruntime CPU."""
    return decode_alone(tiny_export, jobs)


def test_the_export_keeps_the_table_beside_the_graphs(tiny_export, tiny_host):
    graph, host = ExportManifest.load(tiny_export), ExportManifest.load(tiny_host, verify=True)
    assert "model.embed_tokens.weight" in graph.weights and "model.embed_tokens.weight" not in host.weights
    table = (tiny_host / "embeddings.bin").read_bytes()
    e = graph.weights["model.embed_tokens.weight"]
    with open(tiny_export / "weights.bin", "rb") as f:
        f.seek(e.offset)
        assert table == f.read(e.nbytes)  # the same rows, raw and row-major, nothing else in the file
    assert host.embeddings.to_json() == {"placement": "host", "file": "embeddings.bin",
                                         "layout": "row-major [vocab, hidden]", "dtype": "float32",
                                         "shape": [host.vocab_size, host.dims.hidden_size]}
    spec = host.graphs["infiller"].input("inputs_embeds")
    assert (spec.dtype, spec.axes) == ("float32", ("batch", "seq", host.dims.hidden_size))
    assert [t.name for t in host.graphs["planner"].inputs][:2] == ["input_ids", "inputs_embeds"]


def test_tokens_as_the_graph_export_on_onnxruntime_cpu(tiny_host, jobs, graph_tokens):
    assert decode_alone(tiny_host, jobs) == graph_tokens
    manifest = ExportManifest.load(tiny_host)
    runner = OrtRunner(manifest, threads=1, max_requests=4, max_batch=4)
    packed = count_packed(runner, "_run_packed")
    with runner:
        assert [r.token_ids for r in serve_together(runner, manifest, jobs)] == graph_tokens
    assert packed and max(packed) >= 2  # packed rows gather their padded ids' rows too


def test_tokens_as_the_graph_export_on_onnxruntime_cuda(tiny_host, jobs, graph_tokens, fakes):
    _, cudart = fakes
    manifest = ExportManifest.load(tiny_host)
    with CpuBoundCudaRunner(manifest, threads=1) as alone:
        assert decode_alone_on(alone, manifest, jobs) == graph_tokens
    runner = CpuBoundCudaRunner(manifest, threads=1, max_requests=4, max_batch=4)
    with runner:
        assert [r.token_ids for r in serve_together(runner, manifest, jobs)] == graph_tokens
    assert cudart.allocations == {}


def test_tokens_as_the_graph_export_on_tensorrt(tiny_host, jobs, graph_tokens, fakes, tmp_path):
    """The engines directory carries the table; the engine takes inputs_embeds over its profiles (hidden fixed),
    uploaded from pinned memory the rows are gathered into (one upload an execution; the fake refuses freeing that
    memory, as it grows, while an upload from it is queued)."""
    _, cudart = fakes
    engines = fake_engines(tiny_host, tmp_path / "engines", LIMITS)
    assert (engines / "embeddings.bin").read_bytes() == (tiny_host / "embeddings.bin").read_bytes()
    manifest = ExportManifest.read(engines)
    with TensorRTRunner.from_dir(engines) as alone:
        assert decode_alone_on(alone, manifest, jobs) == graph_tokens
        executions = sum(context.runs for context in alone._contexts)
    assert cudart.pinned_uploads == executions > 0
    runner = TensorRTRunner.from_dir(engines, max_requests=4, max_batch=4)
    packed = count_packed(runner, "_run_packed")
    with runner:
        assert [r.token_ids for r in serve_together(runner, manifest, jobs)] == graph_tokens
    assert packed and max(packed) >= 2
    for profile in runner.engines.engine.profiles:  # the ids' batch and seq ranges, the hidden size fixed
        shapes = profile.shapes(manifest.graphs["infiller"])
        assert shapes["inputs_embeds"] == tuple((*ids, manifest.dims.hidden_size) for ids in shapes["input_ids"])


@pytest.mark.parametrize("dtype, quantize", [("fp32", None), ("fp16", None), ("fp16", "int4-rtn")])
def test_tokens_as_the_graph_export_of_a_test_checkpoint(peaky_export, tmp_path, dtype, quantize):
    """The peaky tiny checkpoint (confident drafts: every branch of the loop), at fp32, fp16 and int4."""
    from refusion.export.quantize import QuantizeOptions

    ckpt = peaky_export.parent / "ckpt0"
    options = dict(dtype=dtype, quantize=QuantizeOptions(quantize, 32) if quantize else None)
    graph = peaky_export if dtype == "fp32" else export_unvalidated(ckpt, tmp_path / "graph", **options)
    host = export_unvalidated(ckpt, tmp_path / "host", embeddings="host", **options)
    assert decode_alone(host, PEAKY_JOBS) == decode_alone(graph, PEAKY_JOBS)


def test_only_the_rows_looked_up_become_resident(tmp_path):
    """A tiny model with a 131,072-token vocabulary (a 32 MiB fp32 table): after AR and ReFusion generations the
    table's mapping holds about the pages of the rows fed, a small fraction of it. The bound is 16 pages a looked-up
    page (a filesystem whose cache cannot be dropped, tmpfs, lets the kernel's fault-around map up to 16 cached
    neighbours; here, on ext4, it is 1.03 x), never the machine's speed. Without the drop of the cached pages this
    fails here (a fault maps a whole large folio)."""
    if not Path("/proc/self/smaps").is_file():
        pytest.skip("needs Linux's /proc/self/smaps")
    from refusion.runtime.generator import Generator
    from refusion.tools.checks.fixtures.checkpoints import TinySpec, make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ckpt", TinySpec(num_layers=1, vocab_size=131_072, intermediate_size=64))
    export = export_unvalidated(ckpt, tmp_path / "host", embeddings="host")
    table = export / "embeddings.bin"
    fed: set[int] = set()
    with Generator.from_dir(export, backend="ort-cpu", threads=1) as gen:
        for prompt, settings in PEAKY_JOBS[:4]:
            fed |= set(prompt) | set(gen.generate(prompt_ids=prompt, **settings).token_ids)
        rss, size = mapped_rss(table)
        rows = gen.runner.embeddings.rows
    least = row_pages(fed, rows.shape[1] * rows.itemsize)
    assert size >= rows.nbytes == 131_072 * 64 * 4
    assert least <= rss <= 16 * least, (rss, least, len(fed))
    assert rss / rows.nbytes < 0.15, (rss, len(fed))  # 0.8% here (80 ids); 12.5% at the fault-around bound


def test_ids_outside_the_table_are_refused(tiny_host):
    from refusion.runtime.core.embeddings import EmbeddingTable
    from refusion.runtime.core.errors import RefusionError

    manifest = ExportManifest.load(tiny_host)
    table = EmbeddingTable.of(manifest.path, manifest.embeddings)
    assert table is not None
    np.testing.assert_array_equal(table.gather(np.array([[3, 1]]))[0, 1], table.rows[1])
    vocab = manifest.vocab_size
    with pytest.raises(RefusionError, match=rf"token ids 3..{vocab} lie outside the embedding table's {vocab} rows"):
        table.gather(np.array([[3, vocab]]))


@pytest.mark.parametrize("damage", ["missing", "empty", "short"])
def test_an_engines_directory_with_a_damaged_table_is_refused(tiny_host, fakes, tmp_path, damage):
    """The engines directory's copy is checked by size against refusion.json when the runner activates, an empty
    file included (which cannot even be mapped): one RefusionError, before any device work."""
    from refusion.runtime.core.errors import RefusionError

    engines = fake_engines(tiny_host, tmp_path / "engines", LIMITS)
    table = engines / "embeddings.bin"
    if damage == "missing":
        table.unlink()
    else:
        table.write_bytes(b"" if damage == "empty" else table.read_bytes()[:-8])
    runner = TensorRTRunner.from_dir(engines)
    with pytest.raises(RefusionError, match="embeddings.bin (cannot be read|holds)"):
        runner.activate()
    assert not runner.is_active and fakes[1].allocations == {}
