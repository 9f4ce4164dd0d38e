"""`refusion-run chat` on the embedded model's export: piped turns, /commands, Ctrl-C, and a session
typed on a pseudo-terminal."""

from __future__ import annotations

import io
import json
import os
import platform
import pty
import re
import select
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from refusion.export.exporter import export_onnx
from refusion.models import EMBEDDED_MODEL
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import Generator
from refusion.tools.chat import ChatSession
from refusion.tools.run_cli import cli

REPO = Path(__file__).resolve().parents[2]
SORT, REVERSE = "sort: 3 1 2", "reverse: a b c"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return export_onnx(EMBEDDED_MODEL, tmp_path_factory.mktemp("chat") / "onnx", validate=False)


@pytest.fixture(scope="module")
def gen(tiny_dir):
    with Generator.from_dir(tiny_dir, backend="ort-cpu", threads=1) as g:
        yield g


def answer(gen: Generator, *turns: str, system: str | None = None, **settings) -> str:
    """What the chat shows after `turns` (earlier answers as the chat shows them): the settled text."""
    messages = [{"role": "system", "content": system}] if system else []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        shown = "".join(gen.stream(messages=messages, **settings))
        messages.append({"role": "assistant", "content": shown})
    return shown


def chat(tiny_dir: Path, lines: str, *args: str):
    return CliRunner().invoke(cli, ["chat", str(tiny_dir), "--backend", "ort-cpu", *args], input=lines)


def test_piped_turns_print_only_the_answers(tiny_dir, gen):
    out = chat(tiny_dir, f"{SORT}\n\n{REVERSE}\n")
    assert out.exit_code == 0, out.output
    assert out.stdout == f"{answer(gen, SORT)}\n{answer(gen, SORT, REVERSE)}\n"  # the whole conversation each time
    stats = out.stderr.splitlines()
    assert len(stats) == 2 and all("tokens/s" in s and "tokens/forward, refusion; prompt" in s for s in stats)
    assert stats[0].endswith(", 0 from the prefix cache]") and not stats[1].endswith(", 0 from the prefix cache]")


def test_a_boolean_setting_takes_true_or_false(tiny_dir):
    out = chat(tiny_dir, "/settings upstream_eos_drop=maybe\n/settings upstream_eos_drop=Yes\n/settings\n")
    assert out.exit_code == 0, out.output
    err = out.stderr.splitlines()
    assert "error: /settings upstream_eos_drop=maybe: 'maybe' is not true or false (e.g. upstream_eos_drop=true)." in err
    assert [e for e in err if e.startswith("gen_length=")][-1].endswith(" upstream_eos_drop=True")


def test_settings_and_stats_commands(tiny_dir, gen):
    out = chat(tiny_dir, "\n".join(["/settings slot_size=2 mode=ar", SORT, "/settings k=abc", "/settings depth=3",
                                    "/settings k=5 mode=refusion", "/stats", SORT, "/settings blocks=2 k=8",
                                    "/bogus", "/quit", REVERSE]) + "\n")
    assert out.exit_code == 0, out.output
    ar = dict(slot_size=2, mode="ar")
    assert out.stdout == f"{answer(gen, SORT, **ar)}\n{answer(gen, SORT, SORT, **ar)}\n"  # nothing after /quit
    err = out.stderr.splitlines()
    settings = [e for e in err if e.startswith("gen_length=")]
    assert settings[0] == ("gen_length=64 slot_size=2 serial_num_blocks=4 slot_threshold=0.5 token_threshold=0.1 "
                           "temperature=0.0 seed=None mode=ar max_tokens=None top_k=0 top_p=1.0 min_p=0.0 "
                           "upstream_eos_drop=False")
    assert settings[1] == settings[2] == settings[3] == settings[0]  # refused changes change nothing
    assert "slot_size=8 serial_num_blocks=2" in settings[4] and "mode=ar" in settings[4]
    assert "error: /settings k=abc: 'abc' is not an integer (e.g. slot_size=4)." in err
    assert any(e.startswith("error: /settings 'depth=3' is not key=value with a key among k, blocks,") for e in err)
    assert any(e.startswith("error: gen_length 65 (padded to slot_size 5) cannot be cut") for e in err)
    assert "error: '/bogus' is not a command; /help lists them." in err
    assert sum("tokens/s" in e for e in err) == 1 and "(stats off)" in err  # /stats switched it off


def test_no_stats_prints_nothing_but_the_answers(tiny_dir, gen):
    out = chat(tiny_dir, f"{SORT}\n{REVERSE}\n", "--no-stats")
    assert out.exit_code == 0, out.output
    assert out.stdout == f"{answer(gen, SORT)}\n{answer(gen, SORT, REVERSE)}\n" and out.stderr == ""
    shown = " ".join(CliRunner().invoke(cli, ["chat", "--help"]).stdout.split())
    assert "stdout gets the answers alone and stderr a stats line after each (none with --no-stats)" in shown


def test_no_stats_reset_and_system(tiny_dir, gen):
    out = chat(tiny_dir, f"{SORT}\n/reset\n{SORT}\n", "--no-stats", "--system", "be brief")
    assert out.exit_code == 0, out.output
    first = answer(gen, SORT, system="be brief")
    assert out.stdout == f"{first}\n{first}\n"  # after /reset the conversation starts again from the system message
    assert "tokens/s" not in out.stderr and "(new conversation)" in out.stderr


def test_a_failed_turn_is_reported_and_the_exit_code_says_so(tiny_dir, gen):
    positions = gen.manifest.max_positions
    out = chat(tiny_dir, f"{SORT}\n{SORT}\n", "--gen-length", str(positions - 6), "--mode", "ar")
    assert out.exit_code == 1
    errors = [e for e in out.stderr.splitlines() if e.startswith("error: ")]
    assert len(errors) == 2 and f"more than the 6 the model's {positions} positions leave beside the answer" in errors[0]
    bad = chat(tiny_dir, f"{SORT}\n", "--slot-threshold", "2")
    assert bad.exit_code == 1 and "error: slot_threshold=2.0 is outside [0, 1]" in bad.stderr and not bad.stdout


def test_a_conversation_past_the_positions_drops_its_oldest_turns_and_says_so_once(tiny_dir, gen):
    """Every turn is answered (none fails at the limit), the system prompt stays, one line on stderr."""
    positions = gen.manifest.max_positions
    turns = [f"sort: {i % 10} {(i + 3) % 10} {(i + 1) % 10}" for i in range(positions // 18)]  # ~36 positions a turn
    out = chat(tiny_dir, "\n".join(turns) + "\n", "--system", "be brief", "--max-tokens", "24")
    assert out.exit_code == 0, out.output
    assert len(out.stdout.splitlines()) == len(turns) and "error:" not in out.stderr
    assert out.stderr.count(f"outgrew the model's {positions} positions: its oldest turns are dropped") == 1
    cached = [int(line.rsplit("tokens, ", 1)[1].split()[0]) for line in out.stderr.splitlines() if "prefix cache]" in line]
    assert sum(c > 0 for c in cached) >= len(turns) - 3  # most turns copy the conversation so far


def test_fit_messages_keeps_the_system_prompt_and_the_newest_turns(gen):
    system = [{"role": "system", "content": "be brief"}]
    positions = gen.manifest.max_positions
    history = system + [m for i in range(positions // 20) for m in ({"role": "user", "content": f"sort: {i % 9} 9 0"},
                                                                    {"role": "assistant", "content": f"0 {i % 9} 9"})]
    history.append({"role": "user", "content": "sort: 3 2 1"})
    assert gen.fit_messages(history[:5], max_tokens=24) == (history[:5], 0)  # fits: unchanged
    kept, dropped = gen.fit_messages(history, max_tokens=24)
    assert kept[:1] == system and kept[-1] == history[-1] and kept[1]["role"] == "user"
    assert kept[1:] == history[len(history) - len(kept) + 1:] and dropped == len(history) - len(kept)
    assert len(gen.prompt_ids(messages=kept)) <= (positions - 24) // 2  # room for the turns to come
    with pytest.raises(RefusionError, match="the conversation's last turn takes"):
        gen.fit_messages(system + [{"role": "user", "content": "x" * positions}], max_tokens=24)


def test_a_piped_line_that_is_not_utf8_fails_that_turn_alone(tiny_dir, gen):
    out = CliRunner().invoke(cli, ["chat", str(tiny_dir), "--backend", "ort-cpu", "--no-stats"],
                             input=f"{SORT}\nsort: \xff 3\n{REVERSE}\n".encode("latin-1"))
    assert out.exit_code == 1 and "Traceback" not in out.output
    assert out.stdout == f"{answer(gen, SORT)}\n{answer(gen, SORT, REVERSE)}\n"  # the bad turn is not kept
    assert out.stderr.startswith("error: the prompt is not valid text: character 6 is a lone surrogate")


def test_a_system_message_that_is_not_utf8_is_refused_before_any_turn(tiny_dir):
    out = chat(tiny_dir, f"{SORT}\n", "--system", "be \udcff brief")  # Python's argv for the byte 0xff
    assert out.exit_code == 1 and not out.stdout and "Traceback" not in out.output
    assert out.stderr.startswith("error: --system: the prompt is not valid text: character 3 is a lone surrogate")


def test_settings_no_turn_could_run_with_are_refused_and_change_nothing(tiny_dir, gen):
    out = chat(tiny_dir, f"/settings gen_length=100000\n{SORT}\n", "--no-stats")
    assert out.exit_code == 0, out.output
    assert out.stdout == f"{answer(gen, SORT)}\n"  # the turn after the refusal runs with the settings before it
    assert (f"error: This model's maximum context length is {gen.manifest.max_positions} tokens. However, you requested "
            "100001 tokens (1 in the prompt, 100000 in the completion)." in out.stderr)


def test_ctrl_c_cancels_the_answer_and_keeps_the_session(gen, monkeypatch):
    expected = answer(gen, REVERSE)
    session = ChatSession(gen, {})
    requests = []
    submit = gen.submit
    monkeypatch.setattr(gen, "submit", lambda *args, **kw: requests.append(submit(*args, **kw)) or requests[-1])

    class Terminal(io.StringIO):
        interrupt = True

        def write(self, text: str) -> int:
            if self.interrupt and text.strip():  # Ctrl-C lands while the first piece is shown
                self.interrupt = False
                raise KeyboardInterrupt
            return super().write(text)

    screen, log = Terminal(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", log)
    session.run([SORT, REVERSE])
    assert requests[0].cancelled and not requests[1].cancelled
    assert "(answer cancelled; the question is not kept)" in log.getvalue()
    assert [m["content"] for m in session.history] == [REVERSE, expected]
    assert screen.getvalue() == f"\n{expected}\n"


def test_chat_needs_a_tokenizer():
    bare = SimpleNamespace(tokenizer=None, manifest=SimpleNamespace(path=Path("out/ids-only")))
    with pytest.raises(RefusionError, match=r"^out/ids-only carries no tokenizer files, and chat needs"):
        ChatSession(bare, {})  # type: ignore[arg-type]


class Pty:
    """`refusion-run chat` on a pseudo-terminal, as a user types into it."""

    def __init__(self, *args: str):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: its controlling terminal is the pty, so Ctrl-C is a SIGINT
            os.environ["TERM"] = "dumb"
            # as a shell starts a program on a terminal: a suite run in the background (`cmd &` without job
            # control, or nohup) ignores SIGINT and SIGQUIT, an ignored signal stays ignored across exec, and
            # Python then leaves Ctrl-C ignored (the session hung at the half line)
            for signum in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
                signal.signal(signum, signal.SIG_DFL)
            os.execv(sys.executable, [sys.executable, "-m", "refusion.tools.run_cli", "chat", *args])
        self.screen = self.transcript = ""

    def expect(self, text: str, timeout: float = 60) -> str:
        """Read until `text` shows; returns what came before it."""
        deadline = time.monotonic() + timeout  # a hang guard only
        while text not in self.screen:
            assert time.monotonic() < deadline, f"no {text!r} after {self.screen!r}; all: {self.transcript!r}"
            if select.select([self.fd], [], [], 0.2)[0]:
                chunk = os.read(self.fd, 4096).decode(errors="replace").replace("\r\n", "\n")
                self.screen += chunk
                self.transcript += chunk
        before, _, self.screen = self.screen.partition(text)
        return before

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait_reading(self, timeout: float = 60) -> None:
        """Until the child's main thread waits in select/poll for what is typed (readline's loop: a SIGINT
        from then on interrupts it; one that lands before it, between the prompt and the wait, is missed)."""
        deadline = time.monotonic() + timeout  # a hang guard only: the condition itself is exact
        while not _waits_for_input(self.pid):
            assert time.monotonic() < deadline, f"chat is not reading input; screen: {self.screen!r}"
            time.sleep(0.01)

    def exit_code(self, timeout: float = 30) -> int:
        """The child's exit code once it ends; killed (and -9) if it has not after `timeout` s (a hang guard)."""
        deadline = time.monotonic() + timeout
        while not (ended := os.waitpid(self.pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        if not ended[0]:
            os.kill(self.pid, signal.SIGKILL)
            ended = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(ended[1])


# select, pselect6, poll, ppoll by machine (for kernels whose /proc/PID/wchan names no function)
_WAIT_SYSCALLS = {"x86_64": {"23", "270", "7", "271"}, "aarch64": {"72", "73"}}


def _waits_for_input(pid: int) -> bool:
    """The process's main thread is blocked in select or poll."""
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        if "select" in wchan or "poll" in wchan:
            return True
        syscall = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return False
    return bool(syscall) and syscall[0] in _WAIT_SYSCALLS.get(platform.machine(), set())


def test_a_typed_session(tiny_dir, gen):
    term = Pty(str(tiny_dir), "--backend", "ort-cpu")
    try:
        term.expect("/help lists the commands, Ctrl-C cancels an answer, Ctrl-D or /quit leaves.")
        term.expect("> ")
        term.type(f"{SORT}\r")
        term.expect(f"{answer(gen, SORT)}\n")
        term.expect("from the prefix cache]")
        term.expect("> ")
        term.type("/settings mode=ar\r")
        assert "mode=ar" in term.expect("> ")
        term.type("half a line, then Ctrl-C")
        term.expect("half a line, then Ctrl-C")  # echoed: readline has read it and turns back to waiting
        term.wait_reading()  # readline misses a SIGINT sent before it waits for input
        term.type("\x03")  # at the prompt: a fresh line, the session goes on
        term.expect("> ")
        term.type("/help\r")
        assert "/settings k=v ..." in term.expect("> ")
        term.type("/stats\r")
        term.expect("(stats off)")
        term.expect("> ")
        term.type(f"{SORT}\r")
        shown = term.expect("> ")
        history = [{"role": "user", "content": SORT}, {"role": "assistant", "content": answer(gen, SORT)},
                   {"role": "user", "content": SORT}]  # the first answer was ReFusion's, this one AR's
        second = "".join(gen.stream(messages=history, mode="ar"))
        assert shown.endswith(f"{SORT}\n{second}\n") and "tokens/s" not in shown
        term.type("\x04")  # Ctrl-D leaves
    finally:
        code = term.exit_code()
    assert code == 0


def test_a_guide_set_in_chat_shapes_every_answer_until_unset(tiny_dir, gen, tmp_path):
    schema = tmp_path / "answer.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}},
                                  "required": ["answer"], "additionalProperties": False}))
    out = chat(tiny_dir, "\n".join([r"/settings regex='\d( \d)+'", SORT, f"/settings json_schema={schema}", SORT,
                                    "/settings regex='(a'", "/settings choice=yes,no", SORT, "/settings choice=none",
                                    "/settings json_schema=missing.json", SORT]) + "\n", "--no-stats")
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert re.fullmatch(r"\d( \d)+", lines[0])
    assert set(json.loads(lines[1])) == {"answer"}  # the schema replaced the regex: one guide at a time
    assert lines[2] in ("yes", "no")
    history = [m for turn, shown in zip([SORT] * 3, lines) for m in ({"role": "user", "content": turn},
                                                                       {"role": "assistant", "content": shown})]
    assert lines[3] == "".join(gen.stream(messages=[*history, {"role": "user", "content": SORT}]))  # unset: no guide
    err = out.stderr.splitlines()
    assert any(e.startswith("error: regex is not a guide llguidance can enforce") for e in err)
    assert any(e.startswith("error: /settings json_schema=missing.json: cannot read missing.json") for e in err)
    assert [e for e in err if e.startswith("gen_length=")][0].endswith(r" regex='\\d( \\d)+'")  # shown beside
