"""What both CLIs share: RefusionError -> one `error: ...` line on stderr and exit code 1; progress
on stderr (bars on a terminal, plain lines elsewhere, nothing with --quiet); --version; the decode
and load options of `refusion-run generate` and `chat`; a PROMPT argument of `-` read from stdin."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from tqdm import tqdm

from refusion.export.progress import ProgressEvent
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.profiles import DEFAULT_PREFILL_CHUNK
from refusion.runtime.core.settings import SETTINGS, Setting
from refusion.runtime.prefix_cache import DEFAULT_MB
from refusion.runtime.runners import BACKENDS

_QUIET = "refusion.quiet"  # ctx.meta key, shared by a command and its group


class ErrorReportingGroup(click.Group):
    """A click group whose commands report RefusionError without a traceback; anything else
    is a bug and keeps its traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            try:
                return super().invoke(ctx)
            finally:
                progress.close()
        except RefusionError as e:
            click.echo(f"error: {e}", err=True)
            ctx.exit(1)


class Reporter:
    """The CLIs' progress callback (events of export/progress.py; plain text works too). On a terminal:
    a bar per stage with its rate and ETA, and every line no bar stands for. Elsewhere (CI logs, pipes):
    the lines as plain text, ticks ignored. Under --quiet: nothing."""

    def __init__(self) -> None:
        self._bars: dict[str, tqdm] = {}

    @property
    def ticks(self) -> bool:
        """Bars are drawn, so ticks are wanted."""
        return not _quiet() and sys.stderr.isatty()

    def __call__(self, event: str) -> None:
        if _quiet():
            return
        if not sys.stderr.isatty():
            if event:
                click.echo(event, err=True)
            return
        if isinstance(event, ProgressEvent) and event.stage and event.total is not None:
            bar = self._bars.get(event.stage)
            if bar is None and not event.finished:
                bar = self._bars[event.stage] = _bar(event.stage, event.total, event.unit)
            if bar is not None:
                bar.update(event.done - bar.n)
                if not event.finished:
                    return  # the bar shows this line
                bar.close()
                del self._bars[event.stage]
        if event:
            tqdm.write(str(event), file=sys.stderr)

    def close(self) -> None:
        """Take down the bars still drawn (a command failed or was interrupted)."""
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()


def _bar(stage: str, total: float, unit: str) -> tqdm:
    in_bytes = unit == "B"
    return tqdm(total=total, desc=stage, unit=unit or "it", unit_scale=in_bytes,
                unit_divisor=1024 if in_bytes else 1000, leave=False, dynamic_ncols=True, file=sys.stderr)


def _quiet() -> bool:
    ctx = click.get_current_context(silent=True)
    return bool(ctx and ctx.meta.get(_QUIET))


def _set_quiet(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        ctx.meta[_QUIET] = True


progress = Reporter()

# Decorators (they also apply to an existing click.Command: quiet_option(command)).
quiet_option = click.option("--quiet", "-q", is_flag=True, expose_value=False, callback=_set_quiet,
                            help="No progress on stderr (results and errors still print).")


def version_option(f: Any) -> Any:
    """--version, from the package metadata (a fresh option each time: click's caches the program name)."""
    return click.version_option(package_name="refusion-trt", message="%(prog)s %(version)s")(f)


# The request settings of `refusion-run generate`, `chat` and `client`: every row of runtime/core/settings.py
# that has a CLI option, with its kind, default and help; left out, a recorded setting takes the export's value.
_CLI_TYPES = {"int": int, "number": float, "string": str, "strings": str, "ints": int, "text": str, "json": str}


def _setting_option(setting: Setting) -> Callable[[Any], Any]:
    flags = [setting.flag, *("--" + alias.replace("_", "-") for alias in setting.aliases)]
    help = setting.help[0].upper() + setting.help[1:] + "."
    if setting.kind == "bool":
        return click.option(*flags, setting.name, is_flag=True, default=False, help=help)
    if setting.kind in ("strings", "ints"):
        return click.option(*flags, setting.name, type=_CLI_TYPES[setting.kind], multiple=True, default=(),
                            metavar="TEXT" if setting.kind == "strings" else "ID", help=help + " Repeatable.")
    if setting.cli_file:  # a JSON schema, a grammar: the file's text is the value (given_settings reads it)
        return click.option(*flags, setting.name, type=click.Path(dir_okay=False, path_type=Path), default=None,
                            metavar="FILE", help=f"{help} Read from FILE. [default: none]")
    kind = click.Choice(setting.choices) if setting.choices else _CLI_TYPES[setting.kind]
    if setting.recorded or setting.default is None:
        left_out = "the export's recorded value" if setting.recorded else "none"
        return click.option(*flags, setting.name, type=kind, default=None, help=f"{help} [default: {left_out}]")
    return click.option(*flags, setting.name, type=kind, default=setting.default, show_default=True, help=help)


CLI_SETTINGS = tuple(s for s in SETTINGS if s.cli != "")
_LOAD_OPTIONS = (
    click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
                 help="auto: trt if engines are there, else ort-cuda if available, else ort-cpu."),
    click.option("--threads", type=int, default=None, help="onnxruntime intra-op threads (default: all cores)."),
    click.option("--low-memory", is_flag=True,
                 help="onnxruntime only: no memory arena (activations freed after each forward; the weights are "
                      "resident once either way)."),
    click.option("--verify", is_flag=True,
                 help="Check every file's sha256 before loading, the TensorRT engine's too (a full read of the export "
                      "or engines directory); without it, their sizes."),
    click.option("--prefill-chunk", type=int, default=None,
                 help=f"The most tokens one forward feeds: a longer prompt is prefilled in chunks [default: "
                      f"{DEFAULT_PREFILL_CHUNK}, or the TensorRT engines' own]; 0: no bound."),
    click.option("--prefix-cache-mb", type=float, default=DEFAULT_MB, show_default=True,
                 help="Budget of the prefix cache: the KV of prompt prefixes (a system prompt, a conversation's "
                      "earlier turns) that later requests copy instead of prefilling; 0 turns it off."),
)


def setting_options(f: Any) -> Any:
    """An option per request setting the CLIs take (CLI_SETTINGS); `given_settings` reads them."""
    for setting in reversed(CLI_SETTINGS):
        f = _setting_option(setting)(f)
    return f


def load_options(f: Any) -> Any:
    """--backend --threads --low-memory --verify --prefill-chunk --prefix-cache-mb (Generator.from_dir's options;
    `load_settings` reads them)."""
    for option in reversed(_LOAD_OPTIONS):
        f = option(f)
    return f


def given_settings(options: dict[str, Any]) -> dict[str, Any]:
    """The settings given on the command line, taken out of a command's `options`, as Generator.submit's
    keywords; those left out (None, no stop) are left out, to take the export's value or none."""
    taken = {s.name: options.pop(s.name) for s in CLI_SETTINGS}
    for setting in CLI_SETTINGS:
        if setting.cli_file and taken[setting.name] is not None:
            taken[setting.name] = _read_file(setting.flag, taken[setting.name])
    return {name: tuple(value) if isinstance(value, tuple) else value for name, value in taken.items()
            if value is not None and value != ()}


def _read_file(flag: str, path: Path) -> str:
    """A FILE option's text (UTF-8), or an error naming the option."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RefusionError(f"{flag} {path}: cannot read it as UTF-8 text ({e}).") from None


def load_settings(options: dict[str, Any]) -> dict[str, Any]:
    """The load options, taken out of a command's `options`, as Generator.from_dir's keywords."""
    return {name: options.pop(name) for name in ("backend", "threads", "low_memory", "verify", "prefill_chunk",
                                                 "prefix_cache_mb")}


STDIN_PROMPT = "-"


def read_prompt(prompt: str | None) -> str | None:
    """PROMPT as given, or stdin's text for `-` (UTF-8, without the newline that ends it)."""
    if prompt != STDIN_PROMPT:
        return prompt
    data = sys.stdin.buffer.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RefusionError(f"the prompt on stdin is not UTF-8 text: byte {data[e.start]:#04x} at offset {e.start}; "
                            "pipe UTF-8 text.") from None
    return text[:-1] if text.endswith("\n") else text
