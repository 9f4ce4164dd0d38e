"""tools/bench/measure/revisions.py times each revision's own code: its child imports the revision's checkout,
not the installed package, and the report says what it measured."""

from __future__ import annotations

import subprocess

import pytest

from refusion.tools.bench.measure.revisions import measure, render
from tests.helpers import REPO

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")


@pytest.mark.slow
def test_two_checkouts_are_measured_each_from_its_own_code():
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    before = _worktrees()
    report = measure(REPO, [head, "HEAD"], passes=1, prompts=2)  # measure() refuses a pass that imported another
    assert [row["rev"] for row in report["revisions"]] == [head, "HEAD"]  # one commit twice: a shallow clone has one
    for row in report["revisions"]:
        assert row["ar"]["median_tokens_per_s"] > 0 and row["refusion"]["same_answers_as_first"] == 2
    assert render(report).count("\n| ") == 3  # the header and a row each
    assert _worktrees() == before  # its checkouts are removed (others' may come and go: compared as a set)


def _worktrees() -> set[str]:
    out = subprocess.run(["git", "-C", str(REPO), "worktree", "list", "--porcelain"], capture_output=True, text=True,
                         check=True).stdout
    return {line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("worktree ")}
