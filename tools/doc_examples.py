"""The examples of README.md, docs/api.md and docs/serving.md, run against the embedded model, and the
output each doc shows checked against what it prints, or rewritten from it.

    python -m refusion.tools.doc_examples                 # run them; exit 1 where a doc shows other output
    python -m refusion.tools.doc_examples --write         # run them and rewrite the output blocks (make docs)
    python -m refusion.tools.doc_examples docs/api.md     # one doc

The format of those docs:
- Every ```bash and ```python block is an example. A doc's examples run in order in a fresh working
  directory holding `models/refusion-tiny` (the embedded model) and whatever the doc's earlier examples
  wrote there (`out/...`): its python blocks as one interpreter session, its bash blocks each in a bash
  that keeps the variables the earlier ones exported.
- A ```text block right after an example (blank lines between at most) is its output: what it prints
  on stdout. The comparison masks what varies from machine to machine (MASKS: timings, rates, ratios,
  the backend auto picks); the doc keeps the numbers of the run that wrote it.
- `<!-- not run: WHY -->` on the line before an example skips it, saying why; `<!-- run from: TEXT -->`
  runs the block from TEXT on (what comes before it installs the project, which the environment running
  the examples already is); `<!-- server -->` marks a block whose last line starts a server: it runs in
  the background until it prints `ready:` and is stopped with SIGTERM after the doc's last example. In a
  doc with a server, ports 8000 (the OpenAI server's), 8010, 8011 and 8012 (Triton's HTTP, gRPC, metrics) become
  free ones (and are mapped back in the output).
"""

from __future__ import annotations

import contextlib
import difflib
import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import click

from refusion.models import EMBEDDED_MODEL
from refusion.runtime.core.errors import RefusionError

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/api.md", "docs/serving.md")
REGENERATE = "make docs (python -m refusion.tools.doc_examples --write)"
HANG_GUARD_S = 600  # an example or a server start that takes longer has hung
DOC_PORTS = (8000, 8010, 8011, 8012)  # as the docs write them: the OpenAI server; Triton's HTTP, gRPC, metrics

# What differs between runs and machines, masked in both the doc's output and the run's before they are compared.
_NUMBER = r"-?\d+(?:\.\d+)?(?:e-?\d+)?"
MASKS = (
    (re.compile(rf"{_NUMBER} ?(?:ms|µs|s)\b"), "<time>"),  # 0.013 s, 5.1 s, 8.0 ms
    (re.compile(rf"{_NUMBER} ?[\w%]+/s\b"), "<rate>"),  # 1313.4 tokens/s, 120 MiB/s
    (re.compile(rf"\b{_NUMBER}x\b"), "<ratio>"),  # 3.18x
    (re.compile(rf"""(["'](?:\w*seconds|\w*per_second|loop_share)["']): {_NUMBER}"""), r"\1: <time>"),  # stats
    (re.compile(r"\b(?:ort-cpu|ort-cuda|trt)\b"), "<backend>"),  # what backend="auto" finds
)
_DOC_PORT = re.compile(rf"\b({'|'.join(map(str, DOC_PORTS))})\b")
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_DIRECTIVE = re.compile(r"<!--\s*(not run|run from|server)\s*(?::\s*(.*?))?\s*-->\s*$", re.S)


@dataclass
class Example:
    doc: str
    line: int  # of the opening fence
    lang: str  # bash | python
    code: str
    directive: str = ""  # "", "not run", "run from", "server"
    argument: str = ""
    output: tuple[int, int] | None = None  # the body of its ```text block, as offsets into the doc
    shown: str | None = None  # that body

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line} ({self.lang})"

    def runnable_code(self) -> str:
        if self.directive != "run from":
            return self.code
        at = self.code.find(self.argument)
        if at < 0:
            raise RefusionError(f"{self.where}: `<!-- run from: {self.argument} -->` names text the block lacks.")
        return self.code[at:]


def parse(doc: str, text: str) -> list[Example]:
    """Every bash and python block of `text`, with its directive and its output block."""
    examples: list[Example] = []
    previous_end = 0
    last: Example | None = None
    for m in _FENCE.finditer(text):
        gap = text[previous_end:m.start()]
        lang, body = m.group(1), m.group(2)
        if lang == "text" and last is not None and not gap.strip() and last.output is None:
            last.output, last.shown = (m.start(2), m.end(2)), body
        elif lang in ("bash", "python"):
            lines = [line for line in gap.strip().splitlines() if line.strip()]
            directive = _DIRECTIVE.search(lines[-1]) if lines else None
            last = Example(doc, text.count("\n", 0, m.start()) + 1, lang, body,
                           directive.group(1) if directive else "", (directive.group(2) or "") if directive else "")
            if last.directive == "not run" and not last.argument:
                raise RefusionError(f"{last.where}: `<!-- not run -->` needs a reason: `<!-- not run: WHY -->`.")
            if last.directive == "server" and lang != "bash":
                raise RefusionError(f"{last.where}: `<!-- server -->` marks a bash block (its last line starts one).")
            examples.append(last)
        else:
            last = None
        previous_end = m.end()
    return examples


def masked(text: str) -> str:
    for pattern, replacement in MASKS:
        text = pattern.sub(replacement, text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


# -- running ---------------------------------------------------------------------------------------
@dataclass
class Outcome:
    example: Example
    stdout: str = ""
    problem: str = ""  # why it failed, with its stderr or traceback

    @property
    def differs(self) -> bool:
        e = self.example
        return e.shown is not None and not self.problem and masked(e.shown) != masked(self.stdout)


@dataclass
class DocRun:
    doc: str
    outcomes: list[Outcome] = field(default_factory=list)
    skipped: list[Example] = field(default_factory=list)

    @property
    def failures(self) -> list[str]:
        out = [f"{o.example.where} failed: {o.problem}" for o in self.outcomes if o.problem]
        for o in self.outcomes:
            if o.differs:
                diff = difflib.unified_diff(masked(o.example.shown or "").splitlines(), masked(o.stdout).splitlines(),
                                            "the doc shows", "the example prints", lineterm="")
                out.append(f"{o.example.where} prints other output than the doc shows (masked):\n" + "\n".join(diff)
                           + f"\nIf the new output is right, regenerate the doc's output blocks: {REGENERATE}.")
        return out


class _Bash:
    """Each block in a fresh bash that first reads the variables the earlier blocks exported."""

    def __init__(self, cwd: Path, env: dict[str, str]):
        self.cwd, self.env, self.state = cwd, env, cwd.parent / "exported.sh"

    def script(self, code: str) -> str:
        return f"set -e\nif [ -f {self.state} ]; then source {self.state}; fi\n{code}\nexport -p > {self.state}\n"

    def run(self, code: str) -> tuple[str, str]:
        try:
            done = subprocess.run(["bash", "-c", self.script(code)], cwd=self.cwd, env=self.env,
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired as e:
            return str(e.stdout or ""), f"still running after {HANG_GUARD_S} s (hung?)"
        if done.returncode:
            return done.stdout, f"exit code {done.returncode}\n{done.stderr[-4000:]}"
        return done.stdout, ""


class _Python:
    """One interpreter for the doc's python blocks (python_session, in a child process in the working directory)."""

    def __init__(self, cwd: Path, env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, "-c", "from refusion.tools.doc_examples import python_session; "
                                      "python_session()"], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr or ()), daemon=True).start()

    def run(self, code: str, name: str) -> tuple[str, str]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"code": code, "name": name}) + "\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], HANG_GUARD_S)[0]:
            return "", f"still running after {HANG_GUARD_S} s (hung?)"
        line = self.proc.stdout.readline()
        if not line:
            return "", f"the python session died:\n{''.join(self.stderr)[-4000:]}"
        answer = json.loads(line)
        return answer["stdout"], answer["error"] or ""

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()  # the session ends at the end of its input
        try:
            self.proc.wait(HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def python_session() -> None:
    """The child side of _Python: JSON lines in ({"code", "name"}), JSON lines out ({"stdout", "error"}),
    every block exec'd in one namespace. What the libraries write to fd 1 goes to stderr."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    namespace: dict = {"__name__": "__main__"}
    for line in sys.stdin:
        request = json.loads(line)
        out, error = io.StringIO(), None
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(request["code"], request["name"], "exec"), namespace)  # noqa: S102 - the docs' examples
        except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
            error = traceback.format_exc()
        answers.write(json.dumps({"stdout": out.getvalue(), "error": error}) + "\n")
        answers.flush()


class _Server:
    """A server block's last line, in the background (the lines before it ran as an ordinary block)."""

    def __init__(self, bash: _Bash, line: str, where: str):
        self.where, self.lines = where, []
        self.proc = subprocess.Popen(["bash", "-c", bash.script(f"exec {line}")], cwd=bash.cwd, env=bash.env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout or ():
            self.lines.append(line)
            if line.startswith("ready:"):
                self.ready.set()
        self.ready.set()  # it ended: whoever waits sees it

    def wait_ready(self) -> str:
        """'' once it serves; else why not."""
        if not self.ready.wait(HANG_GUARD_S):
            return f"no `ready:` line in {HANG_GUARD_S} s:\n{''.join(self.lines)[-4000:]}"
        if self.proc.poll() is not None and not any(line.startswith("ready:") for line in self.lines):
            return f"it exited with code {self.proc.returncode} before `ready:`:\n{''.join(self.lines)[-4000:]}"
        return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the drain, as the doc says
            try:
                self.proc.wait(HANG_GUARD_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the server and what it started
                self.proc.wait()


def _free_ports(n: int) -> list[int]:
    from refusion.serve.triton.launcher import free_ports

    return free_ports(n)


def _environment() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)  # this venv's refusion-export, refusion-run, python
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1"}


def run_doc(doc: str, workdir: Path, root: Path = REPO) -> DocRun:
    """Run the examples of `doc` (a path under `root`) in `workdir`/work, made fresh: models/refusion-tiny
    and nothing else."""
    text = (root / doc).read_text()
    examples = parse(doc, text)
    cwd = workdir / "work"
    (cwd / "models").mkdir(parents=True)
    (cwd / "models" / EMBEDDED_MODEL.name).symlink_to(EMBEDDED_MODEL, target_is_directory=True)
    env = _environment()
    ports = dict(zip(DOC_PORTS, _free_ports(len(DOC_PORTS)))) if any(e.directive == "server" for e in examples) else {}

    def to_run(code: str) -> str:
        return re.sub(_DOC_PORT, lambda m: str(ports[int(m.group(1))]), code) if ports else code

    def as_shown(out: str) -> str:
        for doc_port, port in ports.items():
            out = re.sub(rf"\b{port}\b", str(doc_port), out)
        return out

    result = DocRun(doc)
    bash, python, servers = _Bash(cwd, env), None, []
    try:
        for e in examples:
            if e.directive == "not run":
                result.skipped.append(e)
                continue
            code = to_run(e.runnable_code())
            if e.directive == "server":
                *before, last = code.strip().splitlines()
                stdout, problem = bash.run("\n".join(before)) if before else ("", "")
                if not problem:
                    servers.append(_Server(bash, last, e.where))
                    problem = servers[-1].wait_ready()
            elif e.lang == "bash":
                stdout, problem = bash.run(code)
            else:
                python = python or _Python(cwd, env)
                stdout, problem = python.run(code, e.where)
            result.outcomes.append(Outcome(e, as_shown(stdout), problem))
            if problem:
                break  # the examples after it build on it
    finally:
        if python is not None:
            python.close()
        for server in servers:
            server.stop()
    return result


def rewrite(doc: str, run: DocRun, root: Path = REPO) -> bool:
    """Write each run example's stdout into its output block; True if the doc changed."""
    path = root / doc
    text = original = path.read_text()
    for o in sorted(run.outcomes, key=lambda o: o.example.output or (0, 0), reverse=True):
        if o.example.output is not None and not o.problem:
            start, end = o.example.output
            body = o.stdout if o.stdout.endswith("\n") or not o.stdout else o.stdout + "\n"
            text = text[:start] + body + text[end:]
    if text != original:
        path.write_text(text)
    return text != original


@click.command()
@click.argument("docs", nargs=-1)
@click.option("--write", is_flag=True, help="Rewrite the output blocks from what the examples print.")
def main(docs: tuple[str, ...], write: bool) -> None:
    """Run the examples of README.md, docs/api.md and docs/serving.md (or DOCS) on the embedded model and
    compare each output block with what its example prints; --write rewrites the blocks instead."""
    failed = False
    for doc in docs or DOCS:
        with tempfile.TemporaryDirectory(prefix="doc-examples-") as tmp:
            run = run_doc(doc, Path(tmp), REPO)
        problems = [f for f in run.failures if write is False or "failed:" in f]
        click.echo(f"{doc}: {len(run.outcomes)} examples run, {len(run.skipped)} not run"
                   + (f", {len(problems)} problem(s)" if problems else ""), err=True)
        for problem in problems:
            click.echo(problem, err=True)
        if write and rewrite(doc, run, REPO):
            click.echo(f"{doc}: output blocks rewritten", err=True)
        failed = failed or bool(problems)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
