"""`refusion-export demo`: the README's main job, on the embedded model."""

from __future__ import annotations

from click.testing import CliRunner

from refusion.models import EMBEDDED_MODEL
from refusion.tools.export_cli import cli


def test_embedded_model_ships_with_the_repo():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (EMBEDDED_MODEL / name).is_file(), name
    size = sum(f.stat().st_size for f in EMBEDDED_MODEL.iterdir())
    assert size <= 20 * 2**20


def test_demo_runs_and_draws_the_decode(tmp_path):
    result = CliRunner().invoke(cli, ["demo", "--output", str(tmp_path), "--threads", "2"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "ReFusion / AR:" in out and "tokens/forward" in out
    page = (tmp_path / "decode.html").read_text()
    assert page.count("<h3>") == 4 and "iteration" in page
    assert "im_end" not in out and "im_end" not in page  # answers end before the EOS, special tokens not shown
    for step in ("[1/4]", "[2/4]", "[3/4]", "[4/4]"):
        assert step in result.stderr
