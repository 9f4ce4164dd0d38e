"""The TensorRT check for a machine with a GPU, TensorRT, cuda-python and onnxruntime.

    python tools/gpu_check.py [--workdir DIR] [--strongly-typed]

Makes a tiny fixture checkpoint, exports it in fp16 (validated against torch), builds fp16
engines, compares them with onnxruntime on the shared cases of refusion.runtime.compare (as
`refusion-export check` does: the batch-1 cases inside the profiles; the report lists the
rest), checks that generation on the TensorRT Runner is token-identical to the onnxruntime
Runner, and prints per-forward latency of the planner and the infiller. One PASS/FAIL line per check; exit 0 only if all pass. Under 8 minutes:
the two engine builds dominate, and a timing cache in the work directory speeds reruns.
The fixture's KV is 256 bytes per token and layer (kv_heads 2 x head_dim 64 x fp16), so
present KV is written straight into the cache, as for real models.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # tests.fixtures, when run from a checkout

LIMITS = dict(max_prompt=64, gen_length=64, slot_size=8, serial_blocks=2)
# (gen_length, slot_size, serial_num_blocks, slot_threshold, token_threshold) for the parity runs
DECODES = ((64, 8, 2, 0.9, 0.4), (32, 4, 4, 0.0, 0.0), (64, 8, 4, 0.2, 0.7))
PROMPTS = ([5, 17, 42, 99, 7, 3, 12], list(range(40, 88)))


def line(ok: bool, what: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'}: {what}", flush=True)
    return ok


def fixture(work: Path) -> Path:
    from refusion.export.exporter import export_onnx
    from tests.fixtures.checkpoints import TinySpec, make_checkpoint

    spec = TinySpec(num_heads=4, kv_heads=2, head_dim=64, weight_scale=3.0)  # confident enough to commit
    ckpt = make_checkpoint(work / "ckpt", spec)
    return export_onnx(ckpt, work / "onnx-fp16", dtype="fp16", force=True, progress=print)


def build(export: Path, work: Path, strongly_typed: bool) -> Path:
    from refusion.engines.build import build_engines, plan_build
    from refusion.runtime.core.profiles import DecodeLimits

    plan = plan_build(export, work / "engines", DecodeLimits(**LIMITS), strongly_typed=strongly_typed,
                      timing_cache=work / "timing.cache")
    t0 = time.perf_counter()
    out = build_engines(plan, force=True, report=print)
    print(f"built in {time.perf_counter() - t0:.0f} s: {out}")
    return out


def parity(export: Path, engines: Path) -> bool:
    from refusion.runtime.core.export_manifest import ExportManifest
    from refusion.runtime.generator import Generator
    from refusion.runtime.runners.onnxruntime import OrtRunner
    from refusion.runtime.runners.tensorrt import TensorRTRunner

    ort = Generator(ExportManifest.load(export), OrtRunner(ExportManifest.load(export)), None)
    trt = Generator(ExportManifest.load(engines), TensorRTRunner.from_dir(engines), None)
    ok = True
    with ort.runner, trt.runner:
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


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def latency(engines: Path, repeats: int = 50) -> None:
    """Median wall time per forward at the profiles' typical shapes (a tiny model: launch-bound)."""
    from refusion.runtime.core.contract import GraphName
    from refusion.runtime.core.profiles import DecodeLimits
    from refusion.runtime.runners.tensorrt import TensorRTRunner

    limits = DecodeLimits(**LIMITS)
    runner = TensorRTRunner.from_dir(engines)
    with runner:
        runner.allocate_kv(limits.kv_capacity)
        prompt, block, k = 48, limits.block_length, limits.slot_size

        def forward(graph: GraphName, seq: int, past: int, write_at: int | None) -> float:
            ids = np.zeros((1, seq), dtype=np.int64)
            pos = np.arange(past, past + seq, dtype=np.int64)[None]
            mask = np.ones((1, seq, past + seq), dtype=bool)
            times = []
            for _ in range(repeats + 5):
                t0 = time.perf_counter()
                runner.run(graph, ids, pos, mask, past, write_at)
                times.append(time.perf_counter() - t0)
            return statistics.median(times[5:]) * 1e3

        shapes: tuple[tuple[str, GraphName, int, int, int | None], ...] = (
            ("infiller prefill (prompt + block)", "infiller", prompt + block, 0, 0),
            ("planner plan (one block of masks)", "planner", block, prompt, None),
            ("infiller verify (one slot)", "infiller", k, prompt, prompt),
            ("infiller AR step", "infiller", 1, prompt, prompt),
        )
        for name, graph, seq, past, at in shapes:
            print(f"latency: {name:36s} seq {seq:3d} past {past:3d}: {forward(graph, seq, past, at):7.3f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the export, engines and timing cache here")
    parser.add_argument("--strongly-typed", action="store_true", help="build strongly typed engines")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="refusion-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    from refusion.engines.check import check_engines

    export = fixture(work)
    engines = build(export, work, args.strongly_typed)
    ok = line(check_engines(engines), "TensorRT fp16 engines vs onnxruntime (comparator)")
    ok &= parity(export, engines)
    latency(engines)
    line(ok, f"GPU check ({time.perf_counter() - t0:.0f} s, work directory {work})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
