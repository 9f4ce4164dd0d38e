"""Weights in memory (docs/runtime.md, "Weights in memory"): one onnxruntime session serves both
roles, so the weights are resident once, prepacked (fastest); `low_memory` drops the memory arena."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from refusion.runtime.core.export_manifest import ExportManifest

pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[3]
# ~56 MiB of fp32 weights: two copies clearly exceed the bound below, one is well inside it.
SPEC = {"num_layers": 4, "hidden_size": 512, "num_heads": 8, "kv_heads": 4, "head_dim": 64,
        "intermediate_size": 1536, "vocab_size": 2048}
CHILD = """
import sys
from pathlib import Path
import onnxruntime
from refusion.runtime.generator import Generator

def rss():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS"))
    return int(line.split()[1]) * 1024

before = rss()
with Generator.from_dir(sys.argv[1], backend="ort-cpu", threads=1, low_memory=sys.argv[2] == "1") as g:
    g.generate(prompt_ids=[5, 17, 42], gen_length=32, slot_size=8)
    print(rss() - before)
"""


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    from refusion.export.exporter import export_onnx
    from refusion.export.quantize import QuantizeOptions
    from refusion.tools.checks.fixtures.checkpoints import TinySpec, make_checkpoint

    tmp = tmp_path_factory.mktemp("memory")
    ckpt = make_checkpoint(tmp / "ckpt", TinySpec(**SPEC))
    return {"fp32": export_onnx(ckpt, tmp / "fp32", validate=False),
            "int4": export_onnx(ckpt, tmp / "int4", validate=False, quantize=QuantizeOptions("int4-rtn", 128))}


def _prepacking(runner) -> list[bool]:
    assert runner.sessions["planner"] is runner.sessions["infiller"]  # one session, both roles
    return [s.get_session_options().get_session_config_entry("session.disable_prepacking") != "1"
            for s in runner.sessions.values()]


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_one_prepacked_session_serves_both_roles_and_low_memory_drops_the_arena(exports, precision):
    from refusion.runtime.runners.onnxruntime import OrtRunner

    m = ExportManifest.load(exports[precision])
    for low_memory in (False, True):
        with OrtRunner(m, threads=1, low_memory=low_memory) as runner:
            assert _prepacking(runner) == [True, True]
            assert [s.get_session_options().enable_cpu_mem_arena for s in runner.sessions.values()] == \
                [not low_memory] * 2


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_the_weights_are_resident_once(exports, precision):
    weights = (exports[precision] / "weights.bin").stat().st_size

    def grown(low_memory: bool) -> int:
        run = subprocess.run([sys.executable, "-c", CHILD, str(exports[precision]), "1" if low_memory else "0"],
                             capture_output=True, text=True, cwd=REPO, check=True)
        return int(run.stdout.split()[-1])

    for low_memory in (False, True):  # two copies would be 2 x weights: far over the bound
        rss = grown(low_memory)
        assert rss <= 1.3 * weights + 32 * 2**20, (f"low_memory={low_memory}: RSS grew {rss / 2**20:.0f} MiB for "
                                                   f"{weights / 2**20:.0f} MiB of weights: more than one copy")
