"""The xdist module groups (tests/conftest.py) name real modules and hold every user of a shared world."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import MODULE_GROUPS, module_scope

ROOT = Path(__file__).resolve().parents[1]
SESSION_WORLDS = {"world4_results": "tests/executor/conftest.py",
                  "hf_world4": "tests/executor/integrations/conftest.py"}


def test_every_grouped_module_exists() -> None:
    missing = [path for path in MODULE_GROUPS if not (ROOT / path).is_file()]
    assert not missing, missing


def test_every_user_of_a_session_world_is_in_its_group() -> None:
    for fixture, defined_in in SESSION_WORLDS.items():
        assert re.search(rf"^def {fixture}\(", (ROOT / defined_in).read_text(), re.MULTILINE), fixture
        users = [path.relative_to(ROOT).as_posix() for path in sorted((ROOT / "tests").rglob("test_*.py"))
                 if path.name != Path(__file__).name and re.search(rf"\b{fixture}\b", path.read_text())]
        assert users, fixture
        outside = [user for user in users if module_scope(f"{user}::t") != fixture]
        assert not outside, (fixture, outside)


def test_ungrouped_modules_are_their_own_scope() -> None:
    assert module_scope("tests/test_docs_citations.py::test_x[1]") == "tests/test_docs_citations.py"
    ray = module_scope("tests/api/test_ray_runner.py::test_y")
    assert ray == module_scope("tests/api/test_ray_cli_interrupt.py::test_z") != "tests/api/test_ray_runner.py"
