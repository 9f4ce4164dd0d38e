"""What both CLIs share: RefusionError -> one `error: ...` line on stderr and exit code 1."""

from __future__ import annotations

from typing import Any

import click

from refusion.runtime.core.errors import RefusionError


class ErrorReportingGroup(click.Group):
    """A click group whose commands report RefusionError without a traceback; anything else
    is a bug and keeps its traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except RefusionError as e:
            click.echo(f"error: {e}", err=True)
            ctx.exit(1)


def progress(message: str) -> None:
    click.echo(message, err=True)
