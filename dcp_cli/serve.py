"""``dcp serve``: run the planner service (uvicorn) on 127.0.0.1 by default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

GRACEFUL_SHUTDOWN_S = 5
"""After SIGTERM or SIGINT, how long uvicorn waits for requests in flight before the service's own
shutdown (at most ~4 s more: api/app.py), so the process has left within 10 s."""


def register(app: typer.Typer) -> None:
    """Add ``dcp serve`` to the app."""

    @app.command("serve")
    def serve(
        host: str | None = typer.Option(None, help="Interface (default DCP_HOST or 127.0.0.1)."),
        port: int | None = typer.Option(None, help="Port (default DCP_PORT or 8000)."),
        db: Path | None = typer.Option(None, "--db", help="SQLite plan store (default DCP_DB_PATH)."),
        data_dir: Path | None = typer.Option(None, help="Directory server-side manifests must be in."),
        workers: int | None = typer.Option(None, "--workers", help="Solver processes (default: cores)."),
        log_level: str = typer.Option("info", help="uvicorn log level."),
        config: Path | None = typer.Option(
            None, "--config", exists=True, dir_okay=False,
            help="TOML file whose [service] table sets any setting (DCP_* variables and flags override "
                 "it; `dcp config show` says where each value came from)."),
    ) -> None:
        """Run the planner service: plans, epoch jobs, stored plans per step and rank, metrics."""
        from api.config_file import load_settings

        overrides: dict[str, Any] = {k: v for k, v in {
            "host": host, "port": port, "db_path": db, "data_dir": data_dir, "num_workers": workers,
        }.items() if v is not None}
        try:
            settings = load_settings(config_file=config, **overrides)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        if settings.store_lease:
            # A clear refusal before uvicorn starts (the app takes the lease for good at start-up).
            from api.faults import StoreLockedError
            from api.lease import StoreLease

            try:
                StoreLease(settings.db_path).acquire().release()
            except StoreLockedError as exc:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(2) from None
        # The service itself only once its settings are known good: a bad setting is refused
        # without loading uvicorn, fastapi and the planner.
        import uvicorn

        from api.app import create_app
        from api.http_guard import server_options

        # The guarded protocol, the backlog and asyncio's loop (uvloop accepts one connection per
        # iteration: api/http_guard.py).
        uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=log_level,
                    timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                    **server_options(head_timeout_s=settings.request_head_timeout_s,
                                     max_connections=settings.max_connections,
                                     max_connections_per_client=settings.max_connections_per_client))
