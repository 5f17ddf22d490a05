"""``dcp config show``: the effective settings of the service and where each value came from."""

from __future__ import annotations

from pathlib import Path

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from dcp_cli.style import console, fail

SECRET_FIELDS = ("auth_token", "read_token")
"""Settings printed as set / not set, never their value."""

app = typer.Typer(name="config", no_args_is_help=True,
                  help="The one config file (TOML: [service] for dcp serve, [epoch] for dcp epoch).")


@app.command("show")
def show(
    ctx: typer.Context,
    config: Path | None = typer.Option(None, "--config", exists=True, dir_okay=False,
                                       help="The TOML config file dcp serve / dcp epoch would read."),
) -> None:
    """Print every service setting with its value and source (flag, DCP_* variable, .env, the
    config file, default), then the [epoch] table's option defaults."""
    from api.config_file import EPOCH_TABLE, settings_with_sources
    from dcp_cli.epoch import epoch_table

    root = ctx.find_root()
    epoch_command = root.command.get_command(root, "epoch") if hasattr(root.command, "get_command") else None
    try:
        settings, sources = settings_with_sources(config_file=config)
        # [epoch] checked as dcp epoch --config checks it: known options, values of their types
        epoch = epoch_table(epoch_command, ctx, config) if config is not None and epoch_command else {}
    except ValueError as exc:
        fail(str(exc))
    table = Table(title="dcp serve settings", box=box.SIMPLE_HEAD, title_justify="left")
    for column in ("setting", "value", "source"):
        table.add_column(column, overflow="fold")
    for field, value in settings.model_dump(mode="json").items():
        shown = ("set" if value else "not set") if field in SECRET_FIELDS else str(value)
        table.add_row(field, escape(shown), escape(sources[field]))
    console().print(table)
    if epoch:
        options = Table(title=escape(f"dcp epoch defaults ({config} [{EPOCH_TABLE}])"), box=box.SIMPLE_HEAD,
                        title_justify="left")
        for column in ("option", "value"):
            options.add_column(column, overflow="fold")
        for key, value in epoch.items():
            options.add_row(f"--{key.replace('_', '-')}", escape(str(value)))
        console().print(options)


def register(root: typer.Typer) -> None:
    """Add ``dcp config`` to the app."""
    root.add_typer(app)
