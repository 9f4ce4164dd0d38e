"""README.md, docs/api.md and docs/serving.md stay true: every example runs on the embedded model and prints
what its doc shows (tools/doc_examples.py: the format, the masks, `make docs` to rewrite the output)."""

from __future__ import annotations

import importlib.util

import pytest
from click.testing import CliRunner

from refusion.runtime.core.errors import RefusionError
from refusion.tools import doc_examples as D
from tests.helpers import REPO

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

SERVING = pytest.mark.skipif(importlib.util.find_spec("pytriton") is None,
                             reason="serving needs the serve extra: pip install -e '.[serve]'")


@pytest.mark.parametrize("doc", [
    "docs/api.md",
    pytest.param("README.md", marks=[pytest.mark.slow, SERVING]),  # exports, benches, a Triton server
    pytest.param("docs/serving.md", marks=[pytest.mark.slow, SERVING]),  # a Triton server
])
def test_every_example_runs_and_prints_what_the_doc_shows(doc, tmp_path):
    run = D.run_doc(doc, tmp_path)
    assert not run.failures, "\n\n".join(run.failures)
    examples = D.parse(doc, (REPO / doc).read_text())
    assert len(run.outcomes) + len(run.skipped) == len(examples)  # every block ran, or says why not
    assert any(o.example.shown for o in run.outcomes)  # and some show what they print


def test_the_readme_test_command_that_is_not_run_here_is_what_ci_runs():
    skipped = [e for e in D.parse("README.md", (REPO / "README.md").read_text()) if e.directive == "not run"]
    suite = next(e for e in skipped if "python -m pytest -q" in e.code)
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    install_and_test = suite.code[suite.code.index("pip install torch"):].strip()  # in CI's own fresh venv
    assert install_and_test in ci and ci.count("python -m pytest -q") == 1  # that line, then the suite again


DOC = '''# a doc

```bash
export WHO=bash
echo "hello from $WHO in 0.52 s"
```

```text
hello from bash in 9.1 s
```

<!-- not run: needs a GPU -->
```bash
nvidia-smi
```

<!-- run from: echo -->
```bash
pip install nothing-at-all && echo "$WHO again" && ls models
```

```python
x = 41
```

```python
print(x + 1, "ort-cpu", {"wall_seconds": 0.25}, "1313.4 tokens/s")
```

```text
42 trt {'wall_seconds': 0.013} 99 tokens/s
```
'''


@pytest.fixture
def doc_root(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "doc.md").write_text(DOC)
    return tmp_path / "root"


def test_the_format(doc_root):
    examples = D.parse("doc.md", DOC)
    assert [(e.lang, e.directive, e.argument) for e in examples] == [
        ("bash", "", ""), ("bash", "not run", "needs a GPU"), ("bash", "run from", "echo"), ("python", "", ""),
        ("python", "", "")]
    assert examples[0].shown == "hello from bash in 9.1 s\n" and examples[0].line == 3
    assert examples[2].runnable_code().startswith("echo ") and examples[3].shown is None
    with pytest.raises(RefusionError, match=r"doc.md:2 \(bash\): `<!-- not run -->` needs a reason"):
        D.parse("doc.md", "<!-- not run -->\n```bash\nls\n```\n")
    with pytest.raises(RefusionError, match=r"`<!-- server -->` marks a bash block"):
        D.parse("doc.md", "<!-- server -->\n```python\nserve()\n```\n")


def test_masks_hide_what_varies_and_nothing_else():
    assert D.masked("8 tokens in 0.013 s, 524.5 tokens/s, 3.18x, ort-cpu") == "8 tokens in <time>, <rate>, <ratio>, <backend>"
    assert D.masked('{"wall_seconds": 0.0157, "tokens": 12}') == '{"wall_seconds": <time>, "tokens": 12}'
    assert D.masked("{'loop_share': 0.39}") == "{'loop_share': <time>}"
    assert D.masked("sort: 5 2 8 2 -> 2 2 5 8  \n") == "sort: 5 2 8 2 -> 2 2 5 8"  # answers stay compared


def test_a_run_that_differs_fails_naming_the_fix_and_write_makes_the_doc_true(doc_root, tmp_path):
    run = D.run_doc("doc.md", tmp_path / "first", doc_root)
    assert [o.stdout for o in run.outcomes] == [
        "hello from bash in 0.52 s\n", "bash again\nrefusion-tiny\n", "",  # exported variables carry over
        "42 ort-cpu {'wall_seconds': 0.25} 1313.4 tokens/s\n"]  # one python session
    assert [e.argument for e in run.skipped] == ["needs a GPU"]
    assert run.failures == []  # the timings, rate and backend differ; what is compared is the same
    (doc_root / "doc.md").write_text(DOC.replace("hello from bash", "hello from zsh", 1))
    failures = D.run_doc("doc.md", tmp_path / "second", doc_root).failures
    assert len(failures) == 1 and "doc.md:3 (bash) prints other output than the doc shows" in failures[0]
    assert "-hello from zsh in <time>\n+hello from bash in <time>" in failures[0] and D.REGENERATE in failures[0]
    assert D.rewrite("doc.md", D.run_doc("doc.md", tmp_path / "third", doc_root), doc_root)
    assert "```text\nhello from bash in 0.52 s\n```" in (doc_root / "doc.md").read_text()
    assert D.run_doc("doc.md", tmp_path / "fourth", doc_root).failures == []


def test_a_failing_example_stops_its_doc_with_its_error(doc_root, tmp_path):
    (doc_root / "doc.md").write_text("```python\nraise ValueError('broken')\n```\n\n```bash\necho never\n```\n")
    run = D.run_doc("doc.md", tmp_path, doc_root)
    assert len(run.outcomes) == 1 and "ValueError: broken" in run.failures[0]


def test_the_command(monkeypatch, doc_root):
    monkeypatch.setattr(D, "REPO", doc_root)
    result = CliRunner().invoke(D.main, ["doc.md"])
    assert result.exit_code == 0 and "doc.md: 4 examples run, 1 not run" in result.stderr
