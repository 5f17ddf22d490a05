"""The ``dcp`` command line: one typer app, one module per command.

Run ``dcp --help``. Each command lives in its own module under ``dcp_cli/`` and registers
itself on ``app`` through ``register(app)``; heavy imports (torch, ortools) happen inside the
commands so that ``dcp --help`` stays fast and the service never needs torch.
"""

from __future__ import annotations

import logging

import typer

from dcp_cli import check, config_cmd, cost, serve
from dcp_cli import epoch as epoch_cmd
from dcp_cli import manifest as manifest_cmd
from dcp_cli import plan as plan_cmd
from dcp_cli import presets as presets_cmd
from dcp_cli import profile as profile_cmds
from dcp_cli import report as report_cmd

app = typer.Typer(
    name="dcp",
    help="Data-Centric Parallel planner: cost models, plans, the planner service.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",  # docstrings wrap as paragraphs at the terminal's width
    pretty_exceptions_show_locals=False,
)


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


for _module in (presets_cmd, manifest_cmd, epoch_cmd, plan_cmd, report_cmd, cost, profile_cmds, check, serve,
                config_cmd):
    _module.register(app)

if __name__ == "__main__":
    app()
