"""`refusion-run chat`: a multi-turn conversation with an export or engines.

    refusion-run chat out/refusion-onnx [--slot-size 4 --mode ar ...] [--system TEXT] [--no-stats]

Each answer is decoded over the chat template of the whole conversation and printed as its text
settles; a stats line (tokens/s, tokens/forward, prompt tokens from the prefix cache) follows on stderr.
The conversation's earlier turns come from the prefix cache, not a prefill; when the next turn would not fit
the model's positions, the oldest turns are dropped (the system prompt kept), said once on stderr. On a terminal it reads what
you type (Ctrl-C cancels an answer and keeps the conversation; Ctrl-D or /quit leaves); with
piped stdin every line is one user turn and stdout gets only the answers.
"""

from __future__ import annotations

import contextlib
import io
import shlex
import sys
import textwrap
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.settings import ALIASES, BY_NAME, DECODE, GUIDES, Setting
from refusion.runtime.generator import Generator
from refusion.runtime.params import DecodeParams
from refusion.tools.cli_common import given_settings, load_options, load_settings, setting_options


def _boolean(value: str) -> bool:
    """true / false (also yes / no, on / off, 1 / 0), any case."""
    words = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
    if value.lower() not in words:
        raise ValueError(value)
    return words[value.lower()]


def _file(value: str) -> str:
    """A FILE key's value: the file's text."""
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {value} as UTF-8 text ({e})") from None


def _strings(value: str) -> tuple[str, ...]:
    return tuple(value.split(","))


# /settings keys: every decode setting by its name (runtime/core/settings.py), its short key and former names, and
# the guides the CLI takes (structured output: one at a time)
CHAT_SETTINGS = (*DECODE, *(s for s in GUIDES if s.cli != ""))
_TYPES: dict[str, Callable[[str], Any]] = {
    s.name: _file if s.cli_file else {"int": int, "number": float, "bool": _boolean, "strings": _strings}.get(s.kind, str)
    for s in CHAT_SETTINGS}


def _key(setting: Setting) -> str:
    text = f"{setting.short} ({setting.name})" if setting.short else setting.name
    if setting.choices:
        return f"{text} ({' | '.join(setting.choices)})"
    if setting.cli_file:
        return f"{text} (FILE)"
    if setting.kind == "strings":
        return f"{text} (a,b,...)"
    return f"{text} (true | false)" if setting.kind == "bool" else text


_KEYS = textwrap.fill("change them: " + ", ".join(_key(s) for s in CHAT_SETTINGS) + ";", 104,
                      initial_indent=" " * 24, subsequent_indent=" " * 24).lstrip()
HELP = f"""commands:
  /settings             show the decode settings and the guide
  /settings k=v ...     {_KEYS}
                        e.g. /settings slot_size=4 mode=ar max_tokens=32 (seed=none, max_tokens=none: unset);
                        regex='[a-z]+ \\d' (quoted as in a shell), choice=yes,no, json_schema=robot.json
  /stats                switch the stats line after each answer on or off
  /reset                start a new conversation
  /quit                 leave (Ctrl-D too); Ctrl-C cancels the answer being written"""


class ChatSession:
    """The conversation and its settings; `turn` answers one user message, `command` runs a /command."""

    def __init__(self, gen: Generator, settings: dict[str, Any], system: str | None = None,
                 enable_thinking: bool = True, stats: bool = True):
        if gen.tokenizer is None:
            raise RefusionError(f"{gen.manifest.path} carries no tokenizer files, and chat needs the tokenizer and "
                                "its chat template; export from a checkpoint that has tokenizer.json.")
        self.gen = gen
        self.settings = settings
        self.system = system
        self.enable_thinking = enable_thinking
        self.stats = stats
        self.history: list[dict[str, Any]] = []
        self.failed = False  # a turn ended in an error
        self.trimmed = False  # the oldest turns were dropped once (said on stderr that once)
        self.check(settings)  # refuse bad settings before the first turn
        if system is not None:  # and a --system that no turn could send (not UTF-8, too long)
            try:
                gen.prompt_ids(system)
            except RefusionError as e:
                raise RefusionError(f"--system: {e}") from None
        self.reset()

    def params(self) -> DecodeParams:
        return self.gen.options(**self.settings).params

    def check(self, settings: dict[str, Any]) -> None:
        """Refuse settings that every turn would fail with: bad values, or more than this export can run."""
        self.gen.check_fits(self.gen.options(**settings).params)

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def turn(self, text: str) -> None:
        """Answer `text`, streaming it to stdout; Ctrl-C cancels the answer and forgets the question."""
        self.history.append({"role": "user", "content": text})
        request = None
        shown = []  # the settled text, which the conversation keeps (result.text may run past a gap)
        try:
            self.fit()
            request = self.gen.submit(messages=self.history, chat=True, enable_thinking=self.enable_thinking,
                                      **self.settings)
            for piece in request:
                shown.append(piece)
                click.echo(piece, nl=False)
                sys.stdout.flush()
            result = request.result()
        except KeyboardInterrupt:
            if request is not None:
                request.cancel()
            self.history.pop()
            click.echo()
            click.echo("(answer cancelled; the question is not kept)", err=True)
            return
        except RefusionError as e:
            self.history.pop()
            self.failed = True
            hint = " /reset starts a new conversation." if len(self.history) > 1 else ""
            click.echo(f"error: {e}{hint}", err=True)
            return
        click.echo()
        self.history.append({"role": "assistant", "content": "".join(shown)})
        if self.stats:
            s = result.stats
            click.echo(f"[{s.tokens} tokens, {s.tokens_per_second:.1f} tokens/s, {s.tokens_per_forward:.2f} "
                       f"tokens/forward, {s.mode}; prompt {s.prompt_tokens} tokens, {s.cached_prompt_tokens} "
                       "from the prefix cache]", err=True)

    def fit(self) -> None:
        """Drop the oldest turns when the conversation would not fit the model's positions (keeping the
        system prompt; Generator.fit_messages), and say so the first time."""
        kept, dropped = self.gen.fit_messages(self.history, enable_thinking=self.enable_thinking, **self.settings)
        if dropped:
            self.history = kept
            if not self.trimmed:
                click.echo(f"(the conversation outgrew the model's {self.gen.manifest.max_positions} positions: its "
                           "oldest turns are dropped from now on, the system prompt kept)", err=True)
            self.trimmed = True

    def command(self, text: str) -> bool:
        """Run a /command; False when it ends the session."""
        try:
            name, *args = shlex.split(text)
        except ValueError as e:
            click.echo(f"error: {text!r}: {e} (quote values as in a shell).", err=True)
            return True
        if name == "/quit":
            return False
        if name == "/reset" and not args:
            self.reset()
            click.echo("(new conversation)", err=True)
        elif name == "/stats" and not args:
            self.stats = not self.stats
            click.echo(f"(stats {'on' if self.stats else 'off'})", err=True)
        elif name == "/settings":
            try:
                self.change(args)
            except RefusionError as e:
                click.echo(f"error: {e}", err=True)
            guide = {s.name: self.settings[s.name] for s in GUIDES if self.settings.get(s.name) not in (None, ())}
            shown = {**asdict(self.params()), **{k: _shown(v) for k, v in guide.items()}}
            click.echo(" ".join(f"{k}={v}" for k, v in shown.items()), err=True)
        elif name == "/help":
            click.echo(HELP, err=True)
        else:
            click.echo(f"error: {text!r} is not a command; /help lists them.", err=True)
        return True

    def change(self, assignments: list[str]) -> None:
        """Apply `key=value` settings, all or none (each checked as the decode will check it)."""
        changed = dict(self.settings)
        for item in assignments:
            key, sep, value = item.partition("=")
            name = ALIASES.get(key, key)
            if not sep or name not in _TYPES:
                raise RefusionError(f"/settings {item!r} is not key=value with a key among k, blocks, "
                                    f"{', '.join(_TYPES)}; e.g. /settings slot_size=4 mode=ar.")
            try:
                unset = value.lower() == "none" and (BY_NAME[name].optional or BY_NAME[name].guide)
                changed[name] = None if unset else _TYPES[name](value)
                if BY_NAME[name].guide and not unset:  # a request follows one guide: the new one replaces the other
                    for other in GUIDES:
                        if other.name != name:
                            changed.pop(other.name, None)
            except ValueError as e:
                if _TYPES[name] is _file:
                    raise RefusionError(f"/settings {item}: {e}.") from e
                kind, example = {int: ("an integer", "4"), _boolean: ("true or false", "true")}.get(
                    _TYPES[name], ("a number", "0.5"))
                raise RefusionError(f"/settings {item}: {value!r} is not {kind} (e.g. {name}={example}).") from e
        self.check(changed)
        self.settings = changed

    def run(self, lines: Iterable[str]) -> None:
        """One turn or /command per line, until the lines end or /quit."""
        for raw in lines:
            text = raw.strip()
            if not text:
                continue
            if text.startswith("/"):
                if not self.command(text):
                    return
            else:
                self.turn(text)


def _shown(value: Any) -> str:
    """A guide as /settings shows it: on one line, cut."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _typed(prompt: str) -> Iterator[str]:
    """What the user types, line by line, until Ctrl-D; Ctrl-C at the prompt starts a fresh line."""
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401 - line editing and history for input()
    while True:
        try:
            yield input(prompt)
        except UnicodeDecodeError:
            click.echo("error: that line is not UTF-8 text; set the terminal to UTF-8.", err=True)
        except KeyboardInterrupt:
            click.echo()
        except EOFError:
            click.echo()
            return


@click.command("chat")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--system", default=None, help="A system message that opens the conversation.")
@click.option("--no-thinking", is_flag=True, help="Render the chat template with enable_thinking=False.")
@click.option("--no-stats", is_flag=True, help="No stats line on stderr after each answer (/stats switches it).")
@setting_options
@load_options
@click.pass_context
def chat(ctx: click.Context, model_dir: Path, system: str | None, no_thinking: bool, no_stats: bool,
         **options: Any) -> None:
    """Chat with the export or engines in MODEL_DIR. On a terminal, type a message and Enter; /help lists the
    commands (/settings, /stats, /reset, /quit). With piped stdin each line is one user turn, stdout gets the
    answers alone and stderr a stats line after each (none with --no-stats) and any error; the exit code is 1 if
    a turn failed. Earlier turns' KV comes from the prefix cache; a conversation that outgrows the model's
    positions drops its oldest turns (the system message kept), said once on stderr. Decode settings left out
    take the values the export recorded for its model."""
    settings = given_settings(options)
    with Generator.from_dir(model_dir, **load_settings(options)) as gen:
        session = ChatSession(gen, settings, system, enable_thinking=not no_thinking, stats=not no_stats)
        if not sys.stdin.isatty():
            # Undecodable bytes stay in the line (as surrogates) so that turn alone is refused, not the session.
            session.run(io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="surrogateescape"))
            ctx.exit(1 if session.failed else 0)
        click.echo(f"chat with {gen.manifest.path} on {gen.runner.name}; /help lists the commands, Ctrl-C cancels "
                   "an answer, Ctrl-D or /quit leaves.", err=True)
        session.run(_typed("> "))
