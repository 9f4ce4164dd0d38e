"""The TensorRT check for a machine with a GPU, TensorRT, cuda-python and onnxruntime.

    python -m refusion.tools.checks.gpu [--workdir DIR] [--weakly-typed]
    python -m refusion.tools.checks.gpu --cuda-only     # CUDA and cuda-python alone (tools/checks/cuda_memory.py)

On a fixture checkpoint (tools/checks/fixtures) exported fp16, fp32, int4, int4 with an int4 lm_head
(`--quantize-head`), fp16 with its embedding table on the host and fp16 in onnxruntime's fused ops, it builds
engines and checks them, one PASS/FAIL line each (INFO lines report what is not judged), exit 0 only if all
pass. The steps follow the order of a first run on a new device (docs/tensorrt.md), each resting on the ones before:
1. the versions (driver, TensorRT, Polygraphy, cuda-python, onnxruntime-gpu), a Polygraphy that builds on this
   TensorRT and an onnxruntime CUDA session on CUDA, not fallen back to the CPU; the device memory checks of
   --cuda-only;
2. the fp16 engine (strongly typed unless --weakly-typed): no weight converted between types in TensorRT's build
   log (each build's own log: Polygraphy logs a warning once per process), the fp32 islands' layers in fp32 as the
   engine inspector reports them, one engine whose profiles serve both roles, the comparator against onnxruntime,
   the fp32 export at the top of the position range (where half-precision rotary tables would show), generation
   token-identical to the onnxruntime Runner, per-forward latency;
3. the int4 engines, the lm_head int4 too: the same checks, and their sizes and lm_head layers reported;
4. a prefill over a prefix cache hit, which runs in decode-profile chunks: against onnxruntime, the cache on
   against off, its time against one prefill (tools/checks/chunked.py);
5. requests batched (--max-batch 4, on TensorRT and on onnxruntime CUDA), each with its tokens alone, and the
   packed latency; the embedding table on the host (inputs_embeds): the fp16 checks and the fp16 engine's tokens;
6. attention fusion: the inspector's attention kernels and Softmax layers, prefill latency by length (reported);
7. fp32: the engine against onnxruntime with TF32 off; onnxruntime CUDA on the fp32 export with TF32 off and the
   CPU provider's tokens;
then the fp16 engine in the other typing mode (build log, islands, comparator; TensorRT 11 builds strongly typed
networks only) and the onnxruntime-ops export on onnxruntime CUDA. The fixture's KV (256 bytes per token and layer)
is aligned, so present KV is written straight into the cache, as for real models.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from refusion.export.compare import CaseRunner, Feed, Outputs
from refusion.runtime.core.contract import GraphName
from refusion.tools.checks.verdict import line

# Positions up to max_prompt + gen_length + a block (64) - 1 = 1023, the fixture's last (max_position_embeddings 1024).
LIMITS = dict(max_prompt=832, gen_length=128, slot_size=8, serial_blocks=2, max_batch=4)
WEIGHT_CONVERSION = "converting weights between types"  # TensorRT's warning, e.g. fp32 weights stored as fp16
# (gen_length, slot_size, serial_num_blocks, slot_threshold, token_threshold) for the parity runs
DECODES = ((64, 8, 2, 0.9, 0.4), (32, 4, 4, 0.0, 0.0), (64, 8, 4, 0.2, 0.7))
PROMPTS = ([5, 17, 42, 99, 7, 3, 12], list(range(40, 88)))
INT4_BLOCK = 64  # a block size TensorRT documents for INT4 weights (64, 128) that divides the fixture's dims
INT4_EXPORTS = {"int4": False, "int4-head": True}  # name -> the lm_head int4 too


def fixture(work: Path) -> tuple[Path, Path, dict[str, Path], Path, Path]:
    """The fixture checkpoint's fp16 and fp32 exports, its int4 ones (fp16 scales) by name: the layers'
    linears int4 ("int4"), and the lm_head too ("int4-head"), fp16 with its embedding table on the host
    (--embeddings host), and fp16 in onnxruntime's fused ops (--ops onnxruntime)."""
    from refusion.export.exporter import export_onnx
    from refusion.export.quantize import QuantizeOptions
    from refusion.tools.checks.fixtures.checkpoints import TinySpec, make_checkpoint

    # confident enough to commit; linear inputs 64, 256, 128: INT4_BLOCK divides each
    spec = TinySpec(num_heads=4, kv_heads=2, head_dim=64, intermediate_size=128, weight_scale=3.0)
    ckpt = make_checkpoint(work / "ckpt", spec)
    return (export_onnx(ckpt, work / "onnx-fp16", dtype="fp16", force=True, progress=print),
            export_onnx(ckpt, work / "onnx-fp32", dtype="fp32", force=True, progress=print),
            {name: export_onnx(ckpt, work / f"onnx-{name}", dtype="fp16", force=True, progress=print,
                               quantize=QuantizeOptions("int4-rtn", INT4_BLOCK, head=head))
             for name, head in INT4_EXPORTS.items()},
            export_onnx(ckpt, work / "onnx-fp16-host", dtype="fp16", force=True, progress=print, embeddings="host"),
            export_onnx(ckpt, work / "onnx-fp16-ort", dtype="fp16", force=True, progress=print, ops="onnxruntime"))


def build(export: Path, work: Path, strongly_typed: bool, name: str = "engines") -> tuple[Path, list[str]]:
    """The engines directory, and TensorRT's warnings (from its log, kept as work/tensorrt-build-NAME.log) that
    weights were converted between types."""
    from polygraphy.logger import G_LOGGER

    from refusion.engines.build import build_engines, plan_build
    from refusion.runtime.core.profiles import DecodeLimits

    plan = plan_build(export, work / name, DecodeLimits(**LIMITS), strongly_typed=strongly_typed,
                      timing_cache=work / "timing.cache")
    log = work / f"tensorrt-build-{name}.log"
    G_LOGGER.log_file = str(log)  # TensorRT's builder logs through Polygraphy's logger
    G_LOGGER.once_logged.clear()  # which logs each warning once a process: this build's must reach its log
    t0 = time.perf_counter()
    try:
        out = build_engines(plan, force=True, report=print)
    finally:
        G_LOGGER.log_file = None
    print(f"built in {time.perf_counter() - t0:.0f} s: {out}")
    return out, weight_conversions(log.read_text())


def weight_conversions(log: str) -> list[str]:
    """The lines of a TensorRT build log that report weights converted between types, with the
    per-issue counts that follow the warning."""
    lines = log.splitlines()
    found = [i for i, text in enumerate(lines) if WEIGHT_CONVERSION in text.lower()]
    return [text for i in found for text in [lines[i]] + [t for t in lines[i + 1:i + 6] if "weights are affected" in t]]


HALF = re.compile(r"\b(half|fp16|bf16|bfloat16)\b", re.IGNORECASE)  # in a layer's "Format/Datatype"
_NODES = re.compile(r"\[ONNX Layer: ([^|\]]+?)(?: \|[^\]]*)?\]")


def island_layers(info: dict[str, Any], island: set[str]) -> tuple[int, int, list[str]]:
    """Of the engine inspector's layers (`info`: its JSON) that compute only nodes of the fp32 island: how
    many have fp32 outputs, how many are fused into Myelin nodes (whose inner precisions it does not show)
    or beside other nodes, and which have a half-precision output."""
    layers = info.get("Layers", [])
    if any(not isinstance(layer, dict) for layer in layers):
        raise RuntimeError("the engine inspector gives layer names only: the build's profiling verbosity is not "
                           "DETAILED (Polygraphy's default)")
    fp32, opaque, half = 0, 0, []
    for layer in layers:
        name = str(layer.get("Name", ""))
        nodes = set(_NODES.findall(str(layer.get("Metadata", "")))) or set(name.split(" + "))
        if not nodes & island:
            continue
        if layer.get("LayerType") == "Myelin" or name.startswith("{ForeignNode") or not nodes <= island:
            opaque += 1
            continue
        formats = [str(out.get("Format/Datatype", "")) for out in layer.get("Outputs", [])]
        if any(HALF.search(f) for f in formats):
            half.append(f"{name}: {formats}")
        else:
            fp32 += 1
    return fp32, opaque, half


def islands_in_fp32(export: Path, engines: Path) -> bool:
    """The fp32 islands' layers as the engine inspector shows them after a prefill and a verify: none with a
    half-precision output. The layers fused into Myelin nodes, whose inner precisions it does not show, are
    counted, not judged (the long-position comparison judges their numbers)."""
    import onnx

    from refusion.engines.build import fp32_island
    from refusion.runtime.core.export_manifest import ExportManifest
    from refusion.runtime.decode.masks import causal_after
    from refusion.runtime.runners.tensorrt import TensorRTRunner

    manifest = ExportManifest.load(export)
    island = fp32_island(onnx.load(str(manifest.graph_path("infiller")), load_external_data=False))
    runner = TensorRTRunner.from_dir(engines)
    fp32, opaque, half = 0, 0, []
    with runner:
        runner.allocate_kv(64)
        runner.run("infiller", np.zeros((1, 16), np.int64), np.arange(16)[None], causal_after(0, 16), 0, 0)
        runner.run("infiller", np.zeros((1, 8), np.int64), np.arange(16, 24)[None], causal_after(16, 8), 16, 16)
        for profile in (0, 1):
            seen = island_layers(runner.layer_information(profile), island)
            fp32, opaque, half = fp32 + seen[0], opaque + seen[1], half + seen[2]
    detail = "".join(f"\n  {h}" for h in half[:10])
    return line(not half and fp32 + opaque > 0,
                f"fp32 islands ({engines.name}): {fp32} layers with fp32 outputs, {opaque} fused with others (not "
                f"shown), {len(half)} in half precision{detail}")


def one_engine(export: Path, engines: Path) -> bool:
    """The build made one engine, whose profiles serve both roles; prints the device memory the
    active runner holds (weights once, activations, contexts; the KV cache comes later) beside the
    engine's and weights.bin's sizes. On the tiny fixture TensorRT's own overhead dominates that
    figure, so it is reported, not judged; on ReFusion-8B it shows the weights held once."""
    from refusion.runtime.core.engines_manifest import EngineManifest
    from refusion.runtime.core.export_manifest import ExportManifest
    from refusion.runtime.runners.cuda import cudart
    from refusion.runtime.runners.tensorrt import TensorRTRunner

    manifest = EngineManifest.load(engines)
    files = sorted(p.name for p in engines.glob("*.engine"))
    profiles = [(p.name, p.graph) for p in manifest.engine.profiles]
    free = cudart().cudaMemGetInfo()[1]
    with TensorRTRunner.from_dir(engines):
        held = free - cudart().cudaMemGetInfo()[1]
    weights = export / ExportManifest.weights_file
    mib = 2**20
    print(f"device memory held by the active runner: {held / mib:.1f} MiB (engine {manifest.engine.bytes / mib:.1f} "
          f"MiB, {weights.name} {weights.stat().st_size / mib:.1f} MiB)")
    return line(files == [manifest.engine.file] and {g for _, g in profiles} == {"planner", "infiller"},
                f"one engine for both roles: {files}, profiles {profiles}")


def long_positions(export16: Path, export32: Path, engines: Path) -> bool:
    """The fp16 engines against onnxruntime on the fp32 export at the top of the engines' range:
    a prefill of the longest prompt plus a block, and a block over the longest past, the last
    token at position max_prompt + gen_length + block - 1 (random tokens and past KV), the heads where the loop
    reads them (the prefill's at its block, the block's at every token)."""
    from refusion.engines.check import TensorRTCases
    from refusion.export.compare import Case, OrtSessions, Tolerance, compare_runners, every_token
    from refusion.runtime.core.contract import GRAPH_NAMES, past_key_name, past_value_name
    from refusion.runtime.core.export_manifest import ExportManifest
    from refusion.runtime.core.profiles import DecodeLimits
    from refusion.runtime.decode.masks import causal_after
    from refusion.runtime.runners.tensorrt import TensorRTRunner

    limits = DecodeLimits(**LIMITS)
    p, g, b = limits.max_prompt, limits.gen_length, limits.block_length
    m = ExportManifest.load(export16)
    rng = np.random.default_rng(0)

    def case(name: str, graphs: tuple[GraphName, ...], past: int, seq: int) -> Case:
        feed = {"input_ids": rng.integers(0, m.vocab_size, (1, seq)).astype(np.int64),
                "position_ids": np.arange(past, past + seq, dtype=np.int64)[None],
                "attention_mask": causal_after(past, seq),
                "head_positions": np.arange(max(seq - b, 0), seq, dtype=np.int64)[None], **every_token(m)}
        for i in range(m.num_layers):
            for kv in (past_key_name(i), past_value_name(i)):
                feed[kv] = rng.standard_normal((1, past, m.kv_heads, m.head_dim)).astype(np.float16)
        return Case(name, graphs, feed)

    cases = [case(f"prefill of {p + b} tokens", ("infiller",), 0, p + b),
             case(f"{b} tokens over {p + g}", GRAPH_NAMES, p + g, b)]
    # fp16 against fp32, measured on CPU with onnxruntime: present K differs by 4e-3 (of 4) with the
    # islands kept, by 0.2 from position ~900 on with inv_freq rounded to fp16.
    tolerance = Tolerance(1e-2, 1e-2, 0.05)  # argmax: near ties of a random model may flip
    reference = Fp32Past(OrtSessions(ExportManifest.load(export32)))  # CPU: no TF32 in the reference
    result = compare_runners(TensorRTCases(TensorRTRunner.from_dir(engines)), reference, cases, tolerance, "float16")
    print(result.text())
    return line(result.ok and not result.left_out,
                f"TensorRT fp16 vs onnxruntime fp32 up to position {p + g + b - 1}")


class Fp32Past(CaseRunner):
    """A comparator runner of an fp32 export, fed the cases' float16 past KV as float32."""

    def __init__(self, runner: CaseRunner):
        self.runner, self.name = runner, f"{runner.name} fp32"

    def __call__(self, graph: GraphName, feed: Feed) -> Outputs:
        return self.runner(graph, {k: v.astype(np.float32) if k.startswith("past_key_values.") else v
                                   for k, v in feed.items()})

    def unsupported(self, graph: GraphName, feed: Feed) -> str:
        return self.runner.unsupported(graph, feed)

    def close(self) -> None:
        self.runner.close()


def parity(export: Path, engines: Path) -> bool:
    """Generation on the TensorRT Runner token-identical to the onnxruntime Runner's. For an int4
    export the onnxruntime Runner runs at the exact accuracy level (fp32 over the dequantized
    weights, as TensorRT's float GEMM): its default level quantizes activations to int8."""
    from unittest import mock

    from refusion.runtime.core.export_manifest import ExportManifest
    from refusion.runtime.generator import Generator
    from refusion.runtime.runners import onnxruntime, ort_session
    from refusion.runtime.runners.tensorrt import TensorRTRunner

    level = ort_session.EXACT_ACCURACY_LEVEL
    ort = Generator(ExportManifest.load(export), onnxruntime.OrtRunner(ExportManifest.load(export)), None)
    trt = Generator(ExportManifest.read(engines), TensorRTRunner.from_dir(engines), None)  # no graphs there
    ok = True
    with mock.patch.object(ort_session, "RUNTIME_ACCURACY_LEVEL", level), ort.runner, trt.runner:
        runs = [dict(gen_length=g, slot_size=k, serial_num_blocks=b, slot_threshold=st, token_threshold=tt)
                for g, k, b, st, tt in DECODES] + [dict(gen_length=32, mode="ar")]
        for prompt in PROMPTS:
            for params in runs:
                want = ort.generate(prompt_ids=prompt, **params)
                got = trt.generate(prompt_ids=prompt, **params)
                same = got.token_ids == want.token_ids
                where = "" if same else f", first difference at token {_first_difference(got.token_ids, want.token_ids)}"
                ok &= line(same, f"generation parity, prompt {len(prompt)} tokens, {params}: "
                                 f"{len(got.token_ids)} tokens, branches {got.stats.branches}{where}")
    return ok


def batched(export: Path, engines: Path, cuda_runner: Any = None) -> bool:
    """Every parity request submitted at once, served up to --max-batch per forward: each gets the
    tokens it gets alone on the same runner, on TensorRT and on the onnxruntime CUDA runner (over the
    export; `cuda_runner`: its class, for the CPU fakes' test). Fails if no forward packed two rows."""
    from refusion.runtime.core.engines_manifest import EngineManifest
    from refusion.runtime.core.export_manifest import ExportManifest
    from refusion.runtime.runners.onnxruntime import OrtCudaRunner
    from refusion.runtime.runners.ort_session import import_onnxruntime
    from refusion.runtime.runners.tensorrt import TensorRTRunner

    n = EngineManifest.load(engines).limits.max_batch
    jobs = [(prompt, dict(gen_length=g, slot_size=k, serial_num_blocks=b, slot_threshold=st, token_threshold=tt))
            for prompt in PROMPTS for g, k, b, st, tt in DECODES]
    jobs += [(prompt, dict(gen_length=32, mode="ar")) for prompt in PROMPTS]
    runners = {"TensorRT": (TensorRTRunner.from_dir(engines, 1, 1), TensorRTRunner.from_dir(engines))}
    cuda = cuda_runner or OrtCudaRunner
    if cuda_runner is None and "CUDAExecutionProvider" not in import_onnxruntime().get_available_providers():
        print("SKIP: onnxruntime CUDA batched requests (onnxruntime here has no CUDAExecutionProvider; "
              "pip install 'refusion-trt[ort-gpu]' or '[ort-gpu-cu13]')")
    else:
        manifest = ExportManifest.load(export)
        runners["onnxruntime CUDA"] = (cuda(manifest), cuda(manifest, max_requests=n, max_batch=n))
    ok = True
    for name, (alone, together) in runners.items():
        want = _serve(alone, jobs)
        got = _serve(together, jobs)
        counted = together.stats.total  # the runner's own count of its forwards and their rows
        differ = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
        ok &= line(not differ and counted.rows > counted.forwards,
                   f"{name}: {len(jobs)} requests together, {counted.rows / counted.forwards:.2f} rows per forward "
                   f"(--max-batch {n}), each with its tokens alone{f'; request(s) {differ} differ' if differ else ''}")
    return ok


def same_tokens(graph_engines: Path, host_engines: Path) -> bool:
    """The engine of the host-embedding export generates the tokens of the graph-embedding export's engine
    (the same checkpoint, dtype and limits), on every parity request."""
    from refusion.runtime.generator import Generator

    jobs = [(prompt, dict(gen_length=g, slot_size=k, serial_num_blocks=b, slot_threshold=st, token_threshold=tt))
            for prompt in PROMPTS for g, k, b, st, tt in DECODES] + [(p, dict(gen_length=32, mode="ar")) for p in PROMPTS]
    tokens = []
    for engines in (graph_engines, host_engines):
        with Generator.from_dir(engines) as gen:
            tokens.append([gen.generate(prompt_ids=prompt, **params).token_ids for prompt, params in jobs])
    differ = [i for i, (a, b) in enumerate(zip(*tokens)) if a != b]
    return line(not differ, f"embeddings host: {len(jobs)} generations token-identical to the graph-embedding "
                            f"engine's{f'; request(s) {differ} differ' if differ else ''}")


def ort_ops_on_cuda(export: Path, standard: Path, provider: str = "CUDAExecutionProvider") -> bool:
    """The --ops onnxruntime export on onnxruntime CUDA against the same graphs on its CPU provider (the
    comparator's cases, the export validation's fp16 tolerance), then each parity request's tokens beside the
    standard export's on CUDA (a count: the two graphs round differently, so a near-tie may go either way). A
    fused op CUDA lacks runs on the CPU provider instead: still right, only slower, which the 1-token forward
    time beside the standard graph's says. `provider`: the CPU one for the CPU test."""
    from refusion.export.compare import OrtSessions, cases, compare_runners
    from refusion.export.validate import TOLERANCE
    from refusion.runtime.core.export_manifest import ExportManifest
    from refusion.runtime.generator import Generator
    from refusion.runtime.runners.ort_session import import_onnxruntime

    if provider not in import_onnxruntime().get_available_providers():
        print(f"SKIP: --ops onnxruntime on onnxruntime CUDA (onnxruntime here has no {provider}; "
              "pip install 'refusion-trt[ort-gpu]' or '[ort-gpu-cu13]')")
        return True
    manifest = ExportManifest.load(export)
    report = compare_runners(OrtSessions(manifest, (provider,)), OrtSessions(manifest), cases(manifest),
                             TOLERANCE[manifest.dtype], manifest.precision)
    print(report.text())
    ok = line(report.ok, f"--ops onnxruntime on {provider} vs the CPU provider (comparator)")
    backend = "ort-cpu" if provider == "CPUExecutionProvider" else "ort-cuda"
    jobs = [(prompt, dict(gen_length=g, slot_size=k, serial_num_blocks=b, slot_threshold=st, token_threshold=tt))
            for prompt in PROMPTS for g, k, b, st, tt in DECODES] + [(p, dict(gen_length=32, mode="ar")) for p in PROMPTS]
    tokens, seconds = [], []
    for path in (export, standard):
        with Generator.from_dir(path, backend=backend) as gen:
            tokens.append([gen.generate(prompt_ids=prompt, **params).token_ids for prompt, params in jobs])
            t0 = time.perf_counter()
            for _ in range(20):
                gen.generate(prompt_ids=PROMPTS[0], gen_length=16, mode="ar")
            seconds.append((time.perf_counter() - t0) / (20 * 16))
    same = sum(a == b for a, b in zip(*tokens))
    print(f"INFO: --ops onnxruntime on {backend}: {same}/{len(jobs)} generations token-identical to the standard "
          f"export's; AR {seconds[0] * 1e3:.2f} ms a token against {seconds[1] * 1e3:.2f} ms")
    return ok


def _serve(runner: Any, jobs: list[tuple[list[int], dict[str, Any]]]) -> list[list[int]]:
    """The jobs' tokens, all submitted at once to a Generator over `runner`."""
    from refusion.runtime.generator import Generator

    runner.activate()
    with Generator(runner.manifest, runner, None) as gen:
        requests = [gen.submit(prompt_ids=prompt, **params) for prompt, params in jobs]
        return [r.result(timeout=600).token_ids for r in requests]


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def latency(engines: Path, repeats: int = 50) -> None:
    """Median wall time per forward at the profiles' typical shapes (a tiny model: launch-bound), each with
    the heads the loop reads (a ReFusion prefill: its block; AR's: one); the planner's includes the present
    KV and input_probs it writes to scratch."""
    from refusion.runtime.core.profiles import DecodeLimits
    from refusion.runtime.runners.tensorrt import TensorRTRunner

    limits = DecodeLimits(**LIMITS)
    runner = TensorRTRunner.from_dir(engines)
    with runner:
        runner.allocate_kv(limits.kv_capacity)
        prompt, block, k = 48, limits.block_length, limits.slot_size

        def forward(graph: GraphName, seq: int, past: int, write_at: int | None, heads: int) -> float:
            ids = np.zeros((1, seq), dtype=np.int64)
            pos = np.arange(past, past + seq, dtype=np.int64)[None]
            mask = np.ones((1, seq, past + seq), dtype=bool)
            at = np.arange(seq - heads, seq, dtype=np.int64)[None]
            times = []
            for _ in range(repeats + 5):
                t0 = time.perf_counter()
                runner.run(graph, ids, pos, mask, past, write_at, heads=at)
                times.append(time.perf_counter() - t0)
            return statistics.median(times[5:]) * 1e3

        shapes: tuple[tuple[str, GraphName, int, int, int | None, int], ...] = (
            ("infiller prefill (prompt + block)", "infiller", prompt + block, 0, 0, block),
            ("infiller AR prefill (one head)", "infiller", prompt, 0, 0, 1),
            ("planner plan (a block, plan profile)", "planner", block, prompt, None, block),
            ("infiller verify (one slot)", "infiller", k, prompt, prompt, k),
            ("infiller AR step", "infiller", 1, prompt, prompt, 1),
        )
        for name, graph, seq, past, at, heads in shapes:
            ms = forward(graph, seq, past, at, heads)
            print(f"latency: {name:36s} seq {seq:3d} past {past:3d}: {ms:7.3f} ms")
        packed_latency(runner, limits, prompt, repeats)


def packed_latency(runner: Any, limits: Any, past: int, repeats: int) -> None:
    """Median wall time of one slot's verify for each of max_batch requests packed into one forward
    (pasts gathered, presents scattered): against the single verify line above, what a row costs."""
    from refusion.runtime.decode.masks import causal_after
    from refusion.runtime.runners.rows import RowFeed

    n, k = runner.max_batch, limits.slot_size
    if n < 2:
        return
    for region in range(1, n):
        runner.allocate_kv(limits.kv_capacity, region)
    feed = (np.zeros((1, k), np.int64), np.arange(past, past + k, dtype=np.int64)[None], causal_after(past, k))
    rows = [RowFeed(*feed, past, past, region) for region in range(n)]
    times = []
    for _ in range(repeats + 5):
        t0 = time.perf_counter()
        runner.run_batch("infiller", rows)
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times[5:]) * 1e3
    print(f"latency: infiller verify, {n} requests packed        seq {k:3d} past {past:3d}: {ms:7.3f} ms "
          f"({ms / n:.3f} ms a request)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the export, engines and timing cache here")
    parser.add_argument("--weakly-typed", action="store_true",
                        help="build the main fp16 and int4 engines weakly typed (the other fp16 build is then "
                             "strongly typed); TensorRT 10 only")
    parser.add_argument("--cuda-only", action="store_true",
                        help="only the device memory checks, on a machine with CUDA and cuda-python but neither "
                             "TensorRT nor onnxruntime-gpu (tools/checks/cuda_memory.py)")
    args = parser.parse_args(argv)
    if args.cuda_only:
        from refusion.tools.checks import cuda_memory

        return 0 if cuda_memory.run() else 1
    from refusion.runtime.core.errors import RefusionError
    from refusion.runtime.runners.trt_loader import require_tensorrt

    try:
        require_tensorrt()
    except RefusionError as e:
        parser.error(f"{e} Without TensorRT, --cuda-only checks the device memory code with CUDA and cuda-python.")
    import tensorrt

    if args.weakly_typed and int(str(tensorrt.__version__).split(".")[0]) >= 11:
        parser.error(f"--weakly-typed: TensorRT {tensorrt.__version__} builds strongly typed networks only")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="refusion-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ok = run_steps(work, strongly=not args.weakly_typed)
    line(ok, f"GPU check ({time.perf_counter() - t0:.0f} s, work directory {work})")
    return 0 if ok else 1


def run_steps(work: Path, strongly: bool) -> bool:
    """The steps in the order of a first run on a new device (docs/tensorrt.md): each rests on the ones before."""
    from refusion.engines.check import check_engines
    from refusion.tools.checks import cuda_memory, stack
    from refusion.tools.checks.chunked import chunked_prefill

    export, export32, int4, export_host, export_ort = fixture(work)
    print("== 1. versions, and the device memory the runners use", flush=True)
    ok = stack.versions(export) & cuda_memory.run()
    print("== 2. the fp16 engine, strongly typed by default", flush=True)
    engines, good = built(export, work, strongly, "engines")
    ok &= good & one_engine(export, engines)
    ok &= line(check_engines(engines), "TensorRT fp16 engines vs onnxruntime (comparator)")
    ok &= long_positions(export, export32, engines)
    ok &= parity(export, engines)
    latency(engines)
    print("== 3. int4 engines, the lm_head int4 too", flush=True)
    for name, export4 in int4.items():
        engines4, good = built(export4, work, strongly, f"engines-{name}")
        ok &= good & one_engine(export4, engines4)
        int4_sizes(engines, engines4)
        head = ", int4 lm_head" if INT4_EXPORTS[name] else ""
        ok &= line(check_engines(engines4), f"TensorRT int4 (block {INT4_BLOCK}{head}) engine vs onnxruntime "
                                            "(comparator)")
        ok &= parity(export4, engines4)
        latency(engines4)
    print("== 4. a prefill over a prefix cache hit, in chunks", flush=True)
    ok &= chunked_prefill(export, engines)
    print("== 5. requests batched; the embedding table on the host", flush=True)
    ok &= batched(export, engines)
    engines_host, good = built(export_host, work, strongly, "engines-host")  # inputs_embeds, the table on the host
    ok &= good & one_engine(export_host, engines_host)
    ok &= line(check_engines(engines_host), "TensorRT fp16 engine, embeddings host, vs onnxruntime (comparator)")
    ok &= parity(export_host, engines_host)
    ok &= same_tokens(engines, engines_host)
    print("== 6. attention fusion", flush=True)
    attention_fusion(engines)
    print("== 7. fp32: TensorRT and onnxruntime CUDA with TF32 off", flush=True)
    engines32, _ = build(export32, work, True, "engines-fp32")
    ok &= line(check_engines(engines32), "TensorRT fp32 engines vs onnxruntime with TF32 off (comparator)")
    ok &= fp32_on_ort_cuda(export32)
    print("== then: the other typing mode, onnxruntime's fused ops on CUDA", flush=True)
    ok &= other_typing(export, work, not strongly)
    ok &= ort_ops_on_cuda(export_ort, export)
    return ok


ATTENTION_KERNEL = re.compile(r"mha|flash|attention", re.IGNORECASE)  # in a layer's name or tactic


def attention_fusion(engines: Path, repeats: int = 20) -> None:
    """What TensorRT made of the attention subgraph (review 4, S1; export/onnx_graph.py `_attention`): the engine
    inspector's layers after the longest prefill, those whose name or tactic names an attention kernel, and the
    Softmax layers left standing (each an unfused attention, its fp32 scores written and read again); then the
    prefill's time at growing lengths, whose attention part grows as tokens x context. Reported, not judged: how
    the inspector names fused kernels (inside Myelin nodes it shows none) differs between TensorRT versions."""
    from refusion.runtime.decode.masks import causal_after
    from refusion.runtime.runners.tensorrt import TensorRTRunner

    with TensorRTRunner.from_dir(engines) as runner:
        block, longest = runner.limits.block_length, runner.limits.max_prompt + runner.limits.block_length
        runner.allocate_kv(longest)
        lengths = sorted({*(block << i for i in range(8) if block << i < longest), longest})
        for seq in lengths:
            ids, pos = np.zeros((1, seq), np.int64), np.arange(seq, dtype=np.int64)[None]
            heads = np.arange(seq - block, seq, dtype=np.int64)[None]
            times = []
            for _ in range(repeats + 3):
                t0 = time.perf_counter()
                runner.run("infiller", ids, pos, causal_after(0, seq), 0, 0, heads=heads)
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times[3:]) * 1e3
            print(f"latency: prefill of {seq:4d} tokens: {ms:8.3f} ms, {ms * 1e3 / seq:7.2f} us a token, "
                  f"{ms * 1e6 / seq / seq:7.3f} ns a token x context", flush=True)
        layers = runner.layer_information(0).get("Layers", [])
    fused = [str(layer.get("Name")) for layer in layers if isinstance(layer, dict)
             and ATTENTION_KERNEL.search(f"{layer.get('Name', '')} {layer.get('TacticName', '')}")]
    softmax = [layer for layer in layers if isinstance(layer, dict) and layer.get("LayerType") == "SoftMax"]
    myelin = [layer for layer in layers if isinstance(layer, dict) and layer.get("LayerType") == "Myelin"]
    print(f"INFO: attention: {len(layers)} engine layers, {len(fused)} naming an attention kernel "
          f"{fused[:4]}, {len(softmax)} Softmax layers, {len(myelin)} Myelin nodes (their kernels not shown)",
          flush=True)


def int4_sizes(engines16: Path, engines4: Path) -> None:
    """The int4 engine's bytes beside the fp16 engine's and the exports' weights (no dequantized fp16 copy in
    the engine: about the int4 weights' size, plus what TensorRT's kernels take, which on the fixture is most of
    it), and the layers that read the lm_head as the inspector shows them (a weight-only GEMM, with --quantize-head).
    Reported, not judged."""
    import json

    from refusion.runtime.core.engines_manifest import EngineManifest
    from refusion.runtime.core.export_manifest import ExportManifest
    from refusion.runtime.decode.masks import causal_after
    from refusion.runtime.runners.tensorrt import TensorRTRunner

    mib = 2**20
    sizes = {path: EngineManifest.load(path).engine.bytes / mib for path in (engines16, engines4)}
    weights = {path: Path(EngineManifest.load(path).source["export"]) / ExportManifest.weights_file
               for path in (engines16, engines4)}
    with TensorRTRunner.from_dir(engines4) as runner:
        runner.allocate_kv(16)
        runner.run("infiller", np.zeros((1, 16), np.int64), np.arange(16)[None], causal_after(0, 16), 0, 0)
        layers = [layer for layer in runner.layer_information(0).get("Layers", []) if isinstance(layer, dict)]
    head = [f"{layer.get('Name')} ({layer.get('LayerType')}, {layer.get('TacticName', '?')})" for layer in layers
            if "lm_head" in json.dumps(layer)]
    print(f"INFO: {engines4.name}: engine {sizes[engines4]:.1f} MiB (weights.bin {weights[engines4].stat().st_size / mib:.1f}"
          f" MiB) against the fp16 engine's {sizes[engines16]:.1f} MiB (weights.bin "
          f"{weights[engines16].stat().st_size / mib:.1f} MiB); layers reading lm_head: {head[:3]}", flush=True)


def fp32_on_ort_cuda(export32: Path) -> bool:
    """`--backend ort-cuda` on the fp32 export (review 4, W2): its session runs with TF32 off, and its generations
    are the CPU provider's token for token. Skipped where onnxruntime has no CUDA provider."""
    from refusion.runtime.generator import Generator
    from refusion.runtime.runners.ort_session import CUDA_PROVIDER, import_onnxruntime

    if CUDA_PROVIDER not in import_onnxruntime().get_available_providers():
        print("SKIP: fp32 on onnxruntime CUDA (onnxruntime here has no CUDAExecutionProvider)", flush=True)
        return True
    jobs = [(prompt, dict(gen_length=g, slot_size=k, serial_num_blocks=b, slot_threshold=st, token_threshold=tt))
            for prompt in PROMPTS for g, k, b, st, tt in DECODES] + [(p, dict(gen_length=32, mode="ar")) for p in PROMPTS]
    tokens, options = [], {}
    for backend in ("ort-cuda", "ort-cpu"):
        with Generator.from_dir(export32, backend=backend) as gen:
            tokens.append([gen.generate(prompt_ids=prompt, **params).token_ids for prompt, params in jobs])
            if backend == "ort-cuda":
                options = gen.runner.sessions["infiller"].get_provider_options().get(CUDA_PROVIDER, {})
    differ = [i for i, (a, b) in enumerate(zip(*tokens)) if a != b]
    ok = line(options.get("use_tf32") == "0", f"fp32 on onnxruntime CUDA: use_tf32 {options.get('use_tf32')!r}")
    return ok & line(not differ, f"fp32 on onnxruntime CUDA: {len(jobs)} generations token-identical to the CPU "
                                 f"provider's{f'; request(s) {differ} differ' if differ else ''}")


def built(export: Path, work: Path, strongly_typed: bool, name: str) -> tuple[Path, bool]:
    """A build, its log searched for converted weights and its fp32 islands inspected."""
    engines, converted = build(export, work, strongly_typed, name)
    detail = "".join(f"\n  {c}" for c in converted)
    typing = "strongly" if strongly_typed else "weakly"
    ok = line(not converted, f"{name} ({typing} typed): no weights converted between types by the builder{detail}")
    return engines, ok & islands_in_fp32(export, engines)


def other_typing(export: Path, work: Path, strongly_typed: bool) -> bool:
    """The fp16 engine in the other typing mode: its build, its islands and the comparator. TensorRT 11
    builds strongly typed networks only: there a weakly typed build is skipped."""
    import tensorrt

    from refusion.engines.check import check_engines

    if not strongly_typed and int(str(tensorrt.__version__).split(".")[0]) >= 11:
        print(f"SKIP: a weakly typed build (TensorRT {tensorrt.__version__} builds strongly typed networks only)")
        return True
    engines, ok = built(export, work, strongly_typed, "engines-" + ("strong" if strongly_typed else "weak"))
    return ok & line(check_engines(engines), f"TensorRT fp16 engines, {'strongly' if strongly_typed else 'weakly'} "
                                             "typed, vs onnxruntime (comparator)")


if __name__ == "__main__":
    sys.exit(main())
