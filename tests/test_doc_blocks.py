"""Every bash block of the README and docs/ says how it is tested (``tests/doc_blocks.py``), and
the pages' own tests exist; a new block without a marker, or with an unknown one, fails here."""

from __future__ import annotations

from tests.doc_blocks import ROOT, blocks, pages

PAGE_TESTS = {"README.md": "tests/test_readme_tour.py", "docs/cli.md": "tests/test_docs_cli.py",
              "docs/serving.md": "tests/test_docs_serving.py", "docs/profiling.md": "tests/test_docs_profiling.py"}
"""Pages with ``run`` blocks -> the test that runs them top to bottom."""


def test_every_block_says_how_it_is_tested() -> None:
    seen = 0
    for page in pages():
        name = str(page.relative_to(ROOT))
        for block in blocks(page):
            seen += 1
            where = f"{name}:{block.line}"
            assert block.how is not None, f"{where}: a bash block without <!-- doc-test: ... -->:\n{block.body[:200]}"
            if block.how == "run":
                assert name in PAGE_TESTS, f"{where}: a run block on a page no test runs"
            elif block.how.startswith(("tests/", "like tests/")):
                test = block.how.removeprefix("like ").split(":")[0].split()[0]
                assert (ROOT / test).is_file(), f"{where}: {test} does not exist"
            else:
                kind, _, why = block.how.partition(":")
                assert kind == "skip" and why.strip(), f"{where}: unknown marker {block.how!r}"
    assert seen >= 15


def test_each_page_with_run_blocks_has_its_test() -> None:
    with_runs = {str(p.relative_to(ROOT)) for p in pages() if any(b.how == "run" for b in blocks(p))}
    assert with_runs == set(PAGE_TESTS)
    for test in PAGE_TESTS.values():
        assert (ROOT / test).is_file(), test


def test_the_readme_has_exactly_the_two_set_up_commands() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    setup = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = [line.split("#")[0].strip() for b in blocks(ROOT / "README.md") if b.body in setup
                for line in b.body.splitlines()]
    assert commands == ["make run", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 300
