"""What both CLIs share: RefusionError -> one `error: ...` line on stderr and exit code 1; progress
on stderr (bars on a terminal, plain lines elsewhere, nothing with --quiet); --version; the decode
and load options of `refusion-run generate` and `chat`; a PROMPT argument of `-` read from stdin."""

from __future__ import annotations

import sys
from typing import Any

import click
from tqdm import tqdm

from refusion.export.progress import ProgressEvent
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.decode import MODES
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


# The decode settings and load options of `refusion-run generate` and `refusion-run chat`.
_RECORDED = "default: the export's recorded value"
_DECODE_OPTIONS = (
    click.option("--mode", type=click.Choice(MODES), default="refusion", show_default=True),
    click.option("--gen-length", type=int,
                 help=f"ReFusion's canvas ({_RECORDED}): positions decoded, padded to whole slots and cut into the "
                      "serial blocks; given with a max-tokens cap, the cap wins and this sets only the block length."),
    click.option("--slot-size", type=int, help=f"Tokens per slot ({_RECORDED})."),
    click.option("--serial-blocks", type=int,
                 help=f"Equal blocks the generation is cut into, decoded in turn ({_RECORDED})."),
    click.option("--slot-threshold", type=float,
                 help=f"A slot is chosen when its first token's draft probability exceeds it ({_RECORDED})."),
    click.option("--token-threshold", type=float,
                 help=f"A drafted token is accepted when its AR probability exceeds it ({_RECORDED})."),
    click.option("--temperature", type=float, default=0.0, show_default=True,
                 help="0 is greedy; > 0 samples (Gumbel-max) from the export's top-K candidates."),
    click.option("--top-k", type=int, default=None,
                 help="With --temperature: draw among the K most likely candidates [default: all the export's]."),
    click.option("--top-p", type=float, default=None,
                 help="With --temperature: among the fewest candidates whose probability reaches P [default: 1]."),
    click.option("--min-p", type=float, default=None,
                 help="With --temperature: among those at least P x the most likely's probability [default: 0]."),
    click.option("--seed", type=int, default=None, help="Seed of the Gumbel noise when --temperature > 0."),
    click.option("--upstream-eos-drop", is_flag=True,
                 help="ReFusion: after an EOS found in infill, drop slots as upstream does, leaving some positions "
                      "before the EOS undecoded (holes); for comparing with the upstream code (docs/decoding.md)."),
)
# What a request asks beyond its decode settings: its length and where it stops.
_REQUEST_OPTIONS = (
    click.option("--max-tokens", type=int,
                 help="At most this many new tokens (any N >= 1 that fits the positions; default: none, "
                      "the canvas length bounds the answer). ReFusion lays out blocks to cover N and cuts the answer there."),
    click.option("--stop", multiple=True, metavar="TEXT",
                 help="End the answer before the first occurrence of TEXT (repeatable: the first of any); "
                      "finish_reason stop."),
    click.option("--stop-token-id", "stop_token_ids", type=int, multiple=True, metavar="ID",
                 help="End the answer at this token id, not shown (repeatable)."),
)
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
    click.option("--prefix-cache-mb", type=float, default=DEFAULT_MB, show_default=True,
                 help="Budget of the prefix cache: the KV of prompt prefixes (a system prompt, a conversation's "
                      "earlier turns) that later requests copy instead of prefilling; 0 turns it off."),
)


def decode_options(f: Any) -> Any:
    """--mode --gen-length --slot-size --serial-blocks --slot-threshold --token-threshold --temperature --top-k
    --top-p --min-p --seed --upstream-eos-drop; the command takes them as keyword arguments and hands them to `decode_settings`."""
    for option in reversed(_DECODE_OPTIONS):
        f = option(f)
    return f


def request_options(f: Any) -> Any:
    """--max-tokens --stop --stop-token-id; `request_settings` reads them."""
    for option in reversed(_REQUEST_OPTIONS):
        f = option(f)
    return f


def load_options(f: Any) -> Any:
    """--backend --threads --low-memory --verify --prefix-cache-mb (Generator.from_dir's options; `load_settings`
    reads them)."""
    for option in reversed(_LOAD_OPTIONS):
        f = option(f)
    return f


def decode_settings(options: dict[str, Any]) -> dict[str, Any]:
    """The decode options, taken out of a command's `options`, as Generator settings (None: the export's
    recorded value)."""
    names = {"serial_blocks": "serial_num_blocks"}  # option name -> setting name, where they differ
    taken = ("mode", "gen_length", "slot_size", "serial_blocks", "slot_threshold", "token_threshold",
             "temperature", "seed", "upstream_eos_drop")
    settings = {names.get(name, name): options.pop(name) for name in taken}
    cuts = {name: options.pop(name) for name in ("top_k", "top_p", "min_p")}
    return settings | {name: value for name, value in cuts.items() if value is not None}  # left out: no cut


def request_settings(options: dict[str, Any]) -> dict[str, Any]:
    """The request options, taken out of a command's `options`, as Generator.submit's keywords."""
    return {"max_tokens": options.pop("max_tokens"), "stop": tuple(options.pop("stop")),
            "stop_token_ids": tuple(options.pop("stop_token_ids"))}


def load_settings(options: dict[str, Any]) -> dict[str, Any]:
    """The load options, taken out of a command's `options`, as Generator.from_dir's keywords."""
    return {name: options.pop(name) for name in ("backend", "threads", "low_memory", "verify", "prefix_cache_mb")}


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
