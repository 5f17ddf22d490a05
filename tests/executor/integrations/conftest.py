"""The integration tests' world of 4, spawned once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcp_cli.net import free_port
from tests.executor.helpers import load_rank_results
from tests.executor.worlds import spawn_world


@pytest.fixture(scope="session")
def hf_world4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    """Every rank's results of :func:`hf_worker.worker` (needs the ``hf`` extra)."""
    pytest.importorskip("transformers")
    from tests.executor.integrations import hf_worker

    out = Path(tmp_path_factory.mktemp("hf_world4"))
    spawn_world(hf_worker.worker, args=(free_port(), str(out)), nprocs=hf_worker.WORLD)
    loaded = load_rank_results(out, hf_worker.WORLD)
    return loaded
