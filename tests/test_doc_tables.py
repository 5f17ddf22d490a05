"""The figure tables in README.md and bench/README.md are what ``bench/tables.py`` renders from
the committed ``bench/results/*.json``: a table edited by hand, or a JSON rerun without
regenerating the docs, fails here (fix: ``.venv/bin/python bench/tables.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import tables  # noqa: E402


def test_every_marked_table_matches_its_json() -> None:
    seen = set()
    for doc in tables.DOCS:
        for name, body in tables.marked_tables(doc.read_text(encoding="utf-8")):
            assert name in tables.TABLES, f"{doc.name}: unknown table {name!r}"
            assert body == tables.render(name), (f"{doc.relative_to(ROOT)}: table {name!r} differs from "
                                                 f"bench/results/{tables.TABLES[name].json_name}; run "
                                                 ".venv/bin/python bench/tables.py")
            seen.add(name)
    assert seen == set(tables.TABLES), f"tables no doc shows: {sorted(set(tables.TABLES) - seen)}"


def test_each_table_names_its_json_and_commit() -> None:
    for name, spec in tables.TABLES.items():
        first = tables.render(name).splitlines()[0]
        assert f"bench/results/{spec.json_name}" in first and ("commit " in first), first


def test_a_hand_edited_cell_is_caught() -> None:
    text = (ROOT / "bench" / "README.md").read_text(encoding="utf-8")
    name, body = tables.marked_tables(text)[0]
    edited = text.replace(body, body.replace("%", "%%", 1), 1)
    assert tables.rewrite(edited) == tables.rewrite(text)  # regenerating restores it
    assert dict(tables.marked_tables(edited))[name] != tables.render(name)


def test_benchmarks_record_their_commit() -> None:
    """Every bench script that writes a JSON records the commit it ran at (``bench/provenance.py``
    or its own ``git_commit``), so a table rendered from it can name the commit."""
    import subprocess

    texts = {p.name: p.read_text(encoding="utf-8") for p in (ROOT / "bench").glob("*.py")}
    writers = {name: t for name, t in texts.items() if "write_text(json.dumps(" in t or "json.dump(" in t}
    assert len(writers) >= 10
    missing = [name for name, t in writers.items() if "git_commit" not in t and "provenance()" not in t]
    assert not missing, f"bench scripts writing JSON without their commit: {missing}"
    sys.path.insert(0, str(ROOT / "bench"))
    from provenance import provenance

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True, capture_output=True,
                          check=False).stdout.strip()
    commit = provenance()["git_commit"]
    assert commit is None if not head else commit.removesuffix("-dirty") == head
