"""The figure tables of the docs (README.md, bench/README.md, docs/*.md) are what
``bench/tables.py`` renders from the committed ``bench/results/*.json``: a table edited by hand,
a JSON rerun without regenerating the docs, or a JSON from a tree with uncommitted changes fails
here (fix: ``.venv/bin/python bench/tables.py``); and no doc holds a path of the machine that
wrote it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

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


def test_a_result_from_a_dirty_tree_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = {"command": "python bench/ring_cost.py", "rows": [], "machine": {}}
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    monkeypatch.setitem(tables.TABLES, "probe", tables.TableSpec(json_name="probe.json", render=lambda d: []))
    for commit in ("abc1234-dirty", "abc1234+dirty"):
        (tmp_path / "probe.json").write_text(json.dumps({**data, "git_commit": commit}))
        with pytest.raises(ValueError, match="uncommitted"):
            tables.render("probe")
    (tmp_path / "probe.json").write_text(json.dumps({**data, "git_commit": "abc1234"}))
    assert "commit abc1234" in tables.render("probe")


def test_no_committed_table_comes_from_a_dirty_tree() -> None:
    for name, spec in tables.TABLES.items():
        data = json.loads((tables.RESULTS / spec.json_name).read_text(encoding="utf-8"))
        commit = data.get("git_commit") or data.get("commit") or ""
        assert not commit.endswith("dirty"), f"table {name!r}: bench/results/{spec.json_name} ran at {commit}"


def test_a_scratch_path_in_a_result_is_shown_by_its_name() -> None:
    assert tables._command("python bench/plan_phases.py --out /tmp/ab/x.json", "plan_phases_a.json") == (
        "python bench/plan_phases.py --out bench/results/plan_phases_a.json")
    assert tables.ABSOLUTE_PATH.sub(lambda m: Path(m.group(0)).name,
                                    "the store /tmp/dcp-faults-x/two/plans.sqlite is in use; GET /v1/plans") == (
        "the store plans.sqlite is in use; GET /v1/plans")


def _docs() -> list[Path]:
    """Every Markdown file git tracks (or would: README.md, docs/, bench/, examples/)."""
    return sorted({*ROOT.glob("*.md"), *ROOT.glob("docs/**/*.md"), *ROOT.glob("bench/**/*.md"),
                   *ROOT.glob("examples/**/*.md")})


def test_no_doc_holds_an_absolute_path_of_a_machine() -> None:
    """A doc names files relative to the repository: no scratch directory or checkout of the
    machine that wrote it (system paths a reader's machine has too, such as ``/usr/bin/chromium``
    or a container's ``/var/lib/dcp``, are not such paths)."""
    checkout = str(ROOT)
    found = []
    for doc in _docs():
        text = doc.read_text(encoding="utf-8")
        for line_no, line in enumerate(text.splitlines(), 1):
            if checkout in line or tables.ABSOLUTE_PATH.search(line):
                found.append(f"{doc.relative_to(ROOT)}:{line_no}: {line.strip()[:120]}")
    assert len(_docs()) >= 9
    assert not found, "absolute paths in the docs:\n" + "\n".join(found)
