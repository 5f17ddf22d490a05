"""Code and docs cite files inside the repository (or public papers), never notes outside it: every
``docs/NAME.md`` a module names exists, with the section it names, and nothing cites ``DESIGN.md``
or a ``shared/`` directory."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "bench", "costmodel", "dcp_cli", "executor", "ingest", "planner", "report", "examples")


def _sources() -> list[Path]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    return [*files, ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]


def test_every_cited_doc_exists_with_its_section() -> None:
    cited = 0
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"docs/([a-z0-9-]+\.md)(?:, '([^']+)')?", text):
            doc = ROOT / "docs" / match.group(1)
            assert doc.is_file(), f"{path.relative_to(ROOT)} cites {doc.relative_to(ROOT)}, which does not exist"
            if match.group(2):
                headings = re.findall(r"^#+ (.+)$", doc.read_text(encoding="utf-8"), flags=re.M)
                assert match.group(2) in headings, (path, match.group(0), headings)
            cited += 1
    assert cited >= 6  # the planner, plan schema, bounds, baselines, cost model and executor cite docs/


def test_nothing_cites_notes_outside_the_repository() -> None:
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        for bad in ("DESIGN.md", "FACTS.md", "STYLE.md", "RESEARCH.md", "../shared", "shared/docs", "shared/workloads"):
            assert bad not in text, f"{path.relative_to(ROOT)} cites {bad}"
