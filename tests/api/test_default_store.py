"""A bare ``dcp serve``, ``make run`` and ``dcp epoch`` use one plan store file, the one the docs name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from api.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_default_store_file_is_the_readmes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DCP_DB_PATH", raising=False)
    default = Settings().db_path
    assert default == Path("plans.sqlite")
    assert re.search(r"^DB \?= plans\.sqlite$", (ROOT / "Makefile").read_text(), flags=re.MULTILINE)
    assert 'Path("plans.sqlite"), help="SQLite store' in (ROOT / "dcp_cli" / "epoch.py").read_text()
    serving = (ROOT / "docs" / "serving.md").read_text()
    assert "stores plans in `plans.sqlite` (the `DCP_DB_PATH` default)" in serving.replace("\n", " ")
    for doc in (ROOT / "README.md", ROOT / "docs" / "serving.md", ROOT / "docs" / "development.md"):
        assert "dcp-plans.sqlite" not in doc.read_text()
