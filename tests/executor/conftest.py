"""Fixtures shared by the executor tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from dcp_cli.net import free_port
from tests.executor import scenarios


@pytest.fixture(scope="session")
def world4_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    """Every rank's results of :func:`scenarios.worker` on a gloo world of 4 (spawned once)."""
    out = tmp_path_factory.mktemp("world4")
    mp.spawn(scenarios.worker, args=(free_port(), str(out)), nprocs=scenarios.WORLD, join=True)
    loaded = [torch.load(Path(out) / f"rank{r}.pt") for r in range(scenarios.WORLD)]
    for r, res in enumerate(loaded):
        assert "error" not in res, f"rank {r} failed:\n{res['error']}"
    return loaded
