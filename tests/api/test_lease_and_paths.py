"""Regressions of the reliability round: one writer per store whatever name reaches it, and no 500
(nor an echoed path) for any manifest path string."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.faults import StoreLockedError
from api.lease import StoreLease
from api.settings import Settings

from .conftest import AUTH, COST_MODEL, TOKEN, ReadingClient


def test_a_symlink_or_a_hard_link_to_a_leased_store_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "plans.sqlite"
    with StoreLease(store):
        (tmp_path / "alias.sqlite").symlink_to(store)
        with pytest.raises(StoreLockedError):
            StoreLease(tmp_path / "alias.sqlite").acquire()
        os.link(store, tmp_path / "hard.sqlite")
        with pytest.raises(StoreLockedError, match="another name for the same file"):
            StoreLease(tmp_path / "hard.sqlite").acquire()
        with pytest.raises(StoreLockedError):
            StoreLease(Path(os.path.relpath(store))).acquire()
    # Released: the alias takes it now.
    with StoreLease(tmp_path / "alias.sqlite"):
        pass


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    (tmp_path / "data").mkdir()
    settings = Settings(db_path=tmp_path / "plans.sqlite", data_dir=tmp_path / "data", num_workers=1,
                        auth_token=TOKEN)
    with ReadingClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("path", ["a" * 1024, "x/" * 600 + "m.jsonl", "bad\x00name.jsonl", "../../etc/passwd",
                                  "<script>alert(1)</script>.jsonl"])
def test_no_manifest_path_string_gives_a_500_or_is_echoed_whole(client: TestClient, path: str) -> None:
    body = {"epoch_id": "p", "manifest_path": path, "batch": {"samples_per_step": 4}, "seed": 0,
            "cluster": "h200x8", "cost_model_id": COST_MODEL}
    response = client.post("/v1/epochs", json=body, headers=AUTH)
    assert response.status_code in (400, 422), response.text
    assert len(response.text) < 2000
    assert path not in response.text or len(path) <= 80  # long paths are cut in messages
    assert "<script>" not in response.text or "'<script>" in response.text  # escaped as a repr

