"""Both CLIs: --version from the package metadata, and the README's shell-completion lines work."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from click.testing import CliRunner

from refusion.tools import export_cli, run_cli

REPO = Path(__file__).resolve().parents[2]
CLIS = {"refusion-export": "refusion.tools.export_cli", "refusion-run": "refusion.tools.run_cli"}


@pytest.mark.parametrize("name, cli", [("refusion-export", export_cli.cli), ("refusion-run", run_cli.cli)])
def test_version(name, cli):
    result = CliRunner().invoke(cli, ["--version"], prog_name=name)
    assert result.exit_code == 0 and result.stdout == f"{name} {version('refusion-trt')}\n"


def test_readme_completion_lines_produce_completion_scripts():
    readme = (REPO / "README.md").read_text()
    lines = re.findall(r'eval "\$\((_REFUSION_\w+_COMPLETE)=bash_source (refusion-\w+)\)"', readme)
    assert sorted(name for _, name in lines) == sorted(CLIS)
    for var, name in lines:
        script = subprocess.run([sys.executable, "-m", CLIS[name]], env={**os.environ, var: "bash_source"},
                                capture_output=True, text=True, timeout=120, cwd=REPO)
        assert script.returncode == 0, script.stderr
        assert f"-F _{name.replace('-', '_')}_completion {name}" in script.stdout
    completed = subprocess.run([sys.executable, "-m", CLIS["refusion-run"]], capture_output=True, text=True,
                               env={**os.environ, "_REFUSION_RUN_COMPLETE": "bash_complete",
                                    "COMP_WORDS": "refusion-run ch", "COMP_CWORD": "1"}, timeout=120, cwd=REPO)
    assert completed.stdout.split() == ["plain,chat"]
