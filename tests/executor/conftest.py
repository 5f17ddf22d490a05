"""Fixtures shared by the executor tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dcp_cli.net import free_port
from tests.executor import scenarios
from tests.executor.helpers import load_rank_results
from tests.executor.service import Service, running_service
from tests.executor.worlds import spawn_world


@pytest.fixture(scope="session")
def world4_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    """Every rank's results of :func:`scenarios.worker` on a gloo world of 4 (spawned once)."""
    out = tmp_path_factory.mktemp("world4")
    spawn_world(scenarios.worker, args=(free_port(), str(out)), nprocs=scenarios.WORLD)
    loaded = load_rank_results(out, scenarios.WORLD)
    return loaded


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A real ``dcp serve`` for the module's tests (a store of its own), stopped after them."""
    with running_service(tmp_path_factory.mktemp("service")) as svc:
        yield svc
