"""Per-token speed of two or more git revisions of this project on the same machine, interleaved: each revision
is checked out apart (a detached git worktree), exports the embedded model with its own exporter, and times AR
and ReFusion greedy decoding over the same held-out prompts on onnxruntime CPU (one thread); the revisions take
turns, one pass each, so a slow spell of the machine falls on all of them. Writes revisions.json and revisions.md
to --out (default results/revisions).

    python -m refusion.tools.bench.measure.revisions [--passes 5] [--prompts 40] [--instructions] [--out DIR] REV REV...

With --instructions, each revision's decodes also run under valgrind's callgrind, which counts the instructions
the process executes, whatever else the machine is doing (a revision decoding `--prompts` prompts, less the same
revision decoding none, over the tokens: instructions a token). Nearly, not exactly, the same count for the same
code and inputs: two runs of one revision read 3.384 M and 3.298 M an AR token on 2026-12-07 (3%), so read a
difference of a few percent between revisions as none. Slow: minutes a revision and mode.

A revision is imported through a package view (refusion/ -> the worktree's folders, as installed) placed ahead
of the installed package on sys.path, in a child process of this interpreter: its dependencies are this venv's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from refusion.tools.bench.common import cpu_model, host_info, write_report
from refusion.tools.cli_common import progress

OUT = Path("results/revisions")  # from the checkout's root
MODEL = "models/refusion-tiny"
PACKAGES = ("export", "runtime", "engines", "tools", "serve", "models")  # the top folders under refusion.*

# One pass in the child: load the revision's export, decode the prompts with both modes, print tokens/s.
_PASS = r"""
import json, sys, time
import refusion.runtime.generator
from refusion.runtime.generator import Generator
from refusion.tools.tasks import held_out
export, n, modes, rendered = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), int(sys.argv[4])
try:  # revisions before the prefix cache take no budget for it
    gen = Generator.from_dir(export, backend="ort-cpu", threads=1, prefix_cache_mb=0)
except TypeError:
    gen = Generator.from_dir(export, backend="ort-cpu", threads=1)
with gen:
    prompts = [gen.prompt_ids(ex.prompt, chat=True) for ex in held_out(rendered + 2)]  # all rendered, n decoded
    out = {}
    for mode in modes:
        for ids in prompts[-2:]:  # warm-up (never among the decoded)
            gen.generate(prompt_ids=ids, mode=mode)
        tokens, seconds, cpu, answers = 0, 0.0, 0.0, []
        for ids in prompts[:n]:
            t0, c0 = time.perf_counter(), time.process_time()
            result = gen.generate(prompt_ids=ids, mode=mode)
            seconds += time.perf_counter() - t0
            cpu += time.process_time() - c0
            tokens += result.stats.tokens
            answers.append(gen.tokenizer.decode(result.token_ids))
        out[mode] = {"tokens": tokens, "seconds": seconds, "cpu_seconds": cpu, "answers": answers}
print(json.dumps({**out, "imported": refusion.runtime.generator.__file__}))
"""


def _checkout(repo: Path, rev: str, root: Path) -> Path:
    tree = root / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), rev], check=True,
                   capture_output=True)
    view = root / f"view-{tree.name}" / "refusion"
    view.mkdir(parents=True)
    (view / "__init__.py").symlink_to(tree / "refusion" / "__init__.py")
    for name in PACKAGES:
        (view / name).symlink_to(tree / name, target_is_directory=True)
    return tree


# An editable install finds `refusion` ahead of sys.path: the child drops that finder, so the view is what it imports.
_OWN_CHECKOUT = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
                 "if not getattr(f, '__module__', '').startswith('__editable__')]\n")


def _run(tree: Path, args: list[str], code: str | None = None, wrapper: list[str] | None = None) -> str:
    """`code` (or the module `args[0]`, run as __main__) in a child importing the revision's view (under
    `wrapper`, a command that runs the child's command line)."""
    env = {**os.environ, "PYTHONPATH": str(tree.parent / f"view-{tree.name}")}
    if code is None:
        code, args = f"import runpy; runpy.run_module({args[0]!r}, run_name='__main__')", args[1:]
    command = [*(wrapper or []), sys.executable, "-c", _OWN_CHECKOUT + code, *args]
    # not from the checkout's root, whose own refusion/ (the package's __init__ alone) would come first on sys.path
    done = subprocess.run(command, env=env, cwd=tree.parent, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{tree.name}: {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def measure(repo: Path, revs: list[str], passes: int, prompts: int, instructions: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="refusion-revisions-") as tmp:
        root = Path(tmp)
        trees = {rev: _checkout(repo, rev, root) for rev in revs}
        try:
            exports = {}
            for rev, tree in trees.items():
                exports[rev] = root / f"export-{tree.name}"
                _run(tree, ["refusion.tools.export_cli", "onnx", str(repo / MODEL), "--output", str(exports[rev]),
                            "--quiet"])
            runs: dict[str, list[dict[str, Any]]] = {rev: [] for rev in revs}
            for p in range(passes):
                order = revs if p % 2 == 0 else revs[::-1]
                for rev in order:
                    run = json.loads(_run(trees[rev], [str(exports[rev]), str(prompts), "ar,refusion", str(prompts)],
                                          _PASS))
                    if not run["imported"].startswith(str(root / f"view-{trees[rev].name}")):  # not the installed one
                        raise RuntimeError(f"{rev}'s pass imported {run['imported']}, not its own checkout")
                    runs[rev].append(run)
                    print(f"pass {p + 1}/{passes}: {rev} done", file=sys.stderr)
            counted = {rev: {mode: _instructions(trees[rev], exports[rev], prompts, mode) for mode in ("ar", "refusion")}
                       for rev in revs} if instructions else {}
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)],
                               capture_output=True)
    rows = []
    for rev in revs:
        row: dict[str, Any] = {"rev": rev}
        for mode in ("ar", "refusion"):
            rates = [r[mode]["tokens"] / r[mode]["seconds"] for r in runs[rev]]
            cpu = [r[mode]["tokens"] / r[mode]["cpu_seconds"] for r in runs[rev]]
            row[mode] = {"median_tokens_per_s": statistics.median(rates), "passes": [round(x, 1) for x in rates],
                         "median_tokens_per_cpu_s": statistics.median(cpu), "cpu_passes": [round(x, 1) for x in cpu],
                         "same_answers_as_first": sum(a == b for a, b in zip(runs[rev][0][mode]["answers"],
                                                                          runs[revs[0]][0][mode]["answers"]))}
        for mode, (count, tokens) in counted.get(rev, {}).items():
            row[mode]["instructions_per_token"] = count / tokens
        rows.append(row)
    return {"cpu": cpu_model(), "host": host_info(), "passes": passes, "prompts": prompts, "revisions": rows}


def _instructions(tree: Path, export: Path, prompts: int, mode: str) -> tuple[int, int]:
    """(instructions, tokens) of `prompts` decodes in `mode`: a child decoding them less one decoding none, both
    under callgrind, each rendering the same prompts (their chat template's work is not the decode's)."""
    counts, tokens = [], 0
    for n in (0, prompts):
        with tempfile.NamedTemporaryFile(suffix=".callgrind") as out:
            valgrind = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out.name}"]
            run = json.loads(_run(tree, [str(export), str(n), mode, str(prompts)], _PASS, wrapper=valgrind))
            totals = next(line for line in Path(out.name).read_text().splitlines() if line.startswith("totals:"))
            counts.append(int(totals.split()[1]))
            tokens = run[mode]["tokens"]
    return counts[1] - counts[0], tokens


def render(report: dict[str, Any]) -> str:
    first = report["revisions"][0]
    lines = [f"Greedy tokens/s on onnxruntime CPU (1 thread), the embedded model exported by each revision, "
             f"{report['prompts']} held-out prompts, {report['passes']} interleaved passes (median), by the wall "
             f"clock and by the process's CPU time (what the other processes of a busy machine disturb least); "
             f"CPU {report['cpu']}.", "",
             "| revision | AR tokens/s | vs first | per CPU second | vs first | ReFusion tokens/s | vs first | "
             "per CPU second | vs first | answers as the first's |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["revisions"]:
        cells = []
        for mode in ("ar", "refusion"):
            for key in ("median_tokens_per_s", "median_tokens_per_cpu_s"):
                cells += [f"{row[mode][key]:.0f}", f"{row[mode][key] / first[mode][key]:.3f}x"]
        same = f"{row['ar']['same_answers_as_first']} / {row['refusion']['same_answers_as_first']}"
        lines.append(f"| {row['rev']} | {' | '.join(cells)} | {same} |")
    if "instructions_per_token" in first["ar"]:
        lines += ["", "Instructions a token (callgrind: however busy the machine; runs of one revision differ by up to ~3%):",
                  "", "| revision | AR | vs first | ReFusion | vs first |", "|---|---|---|---|---|"]
        for row in report["revisions"]:
            cells = [f"{row[m]['instructions_per_token'] / 1e6:.3f} M | "
                     f"{row[m]['instructions_per_token'] / first[m]['instructions_per_token']:.3f}x" for m in ("ar", "refusion")]
            lines.append(f"| {row['rev']} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("revs", nargs="+", help="git revisions, the first the baseline")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--instructions", action="store_true", help="also count instructions a token (callgrind)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    repo = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True).stdout.strip())
    report = measure(repo, args.revs, args.passes, args.prompts, args.instructions)
    markdown = render(report)
    write_report(args.out, "revisions", markdown, report, None, progress)
    print(markdown, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
