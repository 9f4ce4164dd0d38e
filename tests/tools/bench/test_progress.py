"""`refusion-run bench` progress: the export by bytes, warm-up and the benchmark by runs (one method on
one prompt), the per-prompt lines kept, and --quiet."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from refusion.export.progress import ProgressEvent
from refusion.models import EMBEDDED_MODEL
from refusion.tools.bench import decoding as B
from refusion.tools.run_cli import cli

pytest.importorskip("onnxruntime")

ARGS = dict(n=2, gen_length=16, settings="4,2,0.5,0.1", diffusion="16,8", reference=False, warmup=1, plot=False)


class Events(list):
    ticks = True

    def __call__(self, event: ProgressEvent) -> None:
        self.append(event)


def test_bench_reports_runs_of_every_method_on_every_prompt():
    events = Events()
    B.run_bench(B.BenchConfig(model=EMBEDDED_MODEL, out=None, **ARGS), progress=events)
    runs = 2 * 3  # prompts x methods (AR, one ReFusion setting, one diffusion setting)
    bench = [e for e in events if e.stage == "bench"]
    assert [e.done for e in bench] == list(range(1, runs + 1)) and {e.total for e in bench} == {runs}
    assert [e.done for e in bench if e] == [3, 6]  # the per-prompt lines, at the end of each prompt
    assert bench[0] == "" and bench[2].startswith("[1/2] accuracy ar") and bench[-1].finished
    warmup = [e for e in events if e.stage == "warm-up"]
    assert [e.done for e in warmup] == [1, 2, 3] and warmup[-1].finished
    assert [e for e in events if e.stage == "weights"][-1].finished  # the checkpoint's export


def test_bench_quiet(tmp_path):
    args = ["bench", str(EMBEDDED_MODEL), "--n", "1", "--gen-length", "16", "--settings", "4,2,0.5,0.1",
            "--diffusion", "16,8", "--no-reference", "--warmup", "0", "--no-plot", "--out", str(tmp_path)]
    loud, quiet = CliRunner().invoke(cli, args), CliRunner().invoke(cli, [*args, "--quiet"])
    assert loud.exit_code == quiet.exit_code == 0, quiet.output
    assert "[1/1] accuracy ar" in loud.stderr and quiet.stderr == ""
    assert quiet.stdout.splitlines()[0] == loud.stdout.splitlines()[0]  # the results still print
