"""Fixtures shared by the executor tests."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from dcp_cli.net import free_port
from tests.executor import scenarios
from tests.executor.helpers import load_rank_results


@pytest.fixture(scope="session")
def world4_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    """Every rank's results of :func:`scenarios.worker` on a gloo world of 4 (spawned once)."""
    out = tmp_path_factory.mktemp("world4")
    mp.spawn(scenarios.worker, args=(free_port(), str(out)), nprocs=scenarios.WORLD, join=True)
    loaded = load_rank_results(out, scenarios.WORLD)
    return loaded
