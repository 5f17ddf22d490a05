"""A benchmark writes where its user says (``--out``), by default ``bench-out/<name>.json`` in the
working directory: never over a committed ``bench/results/*.json`` unless that path is passed."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
READERS = {"tables.py", "merge_plan_quality.py"}
"""Scripts that read committed results (the doc tables; the grid's merge takes ``--out`` as required)."""


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """String constants of ``path`` outside docstrings, with their line; a path joined as
    ``... / "results"`` reads as ``bench/results``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    joined = [(node.lineno, "bench/results") for node in ast.walk(tree)
              if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
              and isinstance(node.right, ast.Constant) and node.right.value == "results"]
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return joined + [(node.lineno, node.value) for node in ast.walk(tree)
                     if isinstance(node, ast.Constant) and isinstance(node.value, str)
                     and id(node) not in docstrings]


def test_no_script_writes_into_results_by_default() -> None:
    offenders = []
    for path in sorted(BENCH.glob("*.py")):
        if path.name in READERS:
            continue
        for line, value in _code_strings(path):
            if "bench/results" in value:
                offenders.append(f"bench/{path.name}:{line}: {value[:80]!r}")
    for path in sorted(BENCH.glob("*.sh")):
        for line, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = text.split("#", 1)[0]
            if "bench/results" in code:
                offenders.append(f"bench/{path.name}:{line}: {text.strip()[:80]}")
    assert not offenders, "bench scripts whose default output is under bench/results:\n" + "\n".join(offenders)


def test_every_json_writer_takes_out() -> None:
    writers = [p.name for p in BENCH.glob("*.py")
               if p.name not in READERS and ("write_text(json.dumps(" in (t := p.read_text(encoding="utf-8"))
                                             or "json.dump(" in t)]
    assert len(writers) >= 15
    assert '"--out"' in (BENCH / "_script.py").read_text(encoding="utf-8")  # _script.parser_with_out adds it
    takes_out = ('"--out"', "parser_with_out(")
    missing = [name for name in writers
               if not any(word in (BENCH / name).read_text(encoding="utf-8") for word in takes_out)]
    assert not missing, f"bench scripts writing JSON without --out: {missing}"


def test_a_plain_run_writes_under_bench_out_of_the_working_directory(tmp_path: Path) -> None:
    committed = (BENCH / "results" / "ring_cost.json").read_bytes()
    result = subprocess.run([sys.executable, str(BENCH / "ring_cost.py")], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    written = json.loads((tmp_path / "bench-out" / "ring_cost.json").read_text(encoding="utf-8"))
    assert written["rows"]
    assert (BENCH / "results" / "ring_cost.json").read_bytes() == committed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench-out"]
