"""``dcp report plan`` and ``dcp report epoch``: the files they write, and errors naming the option."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dcp_cli.main import app
from planner.plan import Plan

pytestmark = pytest.mark.timeout(180)

runner = CliRunner(env={"COLUMNS": "250"})
SVG = "{http://www.w3.org/2000/svg}"


def _run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["report", *args])
    return result.exit_code, " ".join(result.output.translate({ord(c): " " for c in "│╭╮╰╯─"}).split())


def _title(svg: Path, prefix: str) -> str:
    texts = ["".join(t.itertext()) for t in ET.parse(svg).getroot().iter(f"{SVG}text")]
    return next(t for t in texts if t.startswith(prefix))


def test_plan_report_from_a_workload_then_from_the_plan_file(tmp_path: Path) -> None:
    code, out = _run("plan", "-w", "text-longtail", "-c", "h200x8", "-b", "24", "-o", str(tmp_path / "a"))
    assert code == 0, out
    assert str(tmp_path / "a" / "plan.json") in out  # the planned step is listed with the pictures
    plan = Plan.model_validate_json((tmp_path / "a" / "plan.json").read_text())
    assert (tmp_path / "a" / "gantt.png").read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "a" / "memory.png").read_bytes().startswith(b"\x89PNG")
    assert b"memory-activations-0" in (tmp_path / "a" / "memory.svg").read_bytes()
    page = (tmp_path / "a" / "plan.html").read_text()
    assert page.count("<svg") == 2 and "<title>" in page and "http" not in page.split("<svg", 1)[0]
    first = _title(tmp_path / "a" / "gantt.svg", "strongest baseline")
    assert first.startswith(f"strongest baseline {plan.solver.method if plan.solver.status == 'BASELINE' else ''}")
    code, out = _run("plan", str(tmp_path / "a" / "plan.json"), "-o", str(tmp_path / "b"))
    assert code == 0, out
    again = _title(tmp_path / "b" / "gantt.svg", "strongest baseline")
    assert again == first and "rebuilt" not in again  # the baseline rebuilt from the file is the recorded one
    code, out = _run("plan", str(tmp_path / "a" / "plan.json"), "--no-baseline", "-o", str(tmp_path / "c"))
    assert code == 0 and "baseline-microbatches" not in (tmp_path / "c" / "gantt.svg").read_text()


def test_epoch_report_from_a_store_written_by_dcp_epoch(tmp_path: Path) -> None:
    manifest = tmp_path / "train.jsonl"
    manifest.write_text("".join(f'{{"id": "s{i}", "tokens": {512 * (i % 9 + 1)}}}\n' for i in range(36)))
    store = tmp_path / "plans.sqlite"
    result = runner.invoke(app, ["epoch", str(manifest), "--samples-per-step", "12", "--out", str(store),
                                 "--workers", "1", "-q", "-o", "use_cpsat=false"])
    assert result.exit_code == 0, result.output
    code, out = _run("epoch", str(store), "-o", str(tmp_path / "r"))
    assert code == 0, out
    names = sorted(p.name for p in (tmp_path / "r").iterdir())
    step = int(next(re.finditer(r"gantt-step(\d+)\.png", " ".join(names))).group(1))
    assert names == sorted(["epoch.png", "epoch.svg", f"gantt-step{step}.png", f"gantt-step{step}.svg",
                            "report.html"])
    page = (tmp_path / "r" / "report.html").read_text()
    assert "Epoch train-s0" in page and not re.search(r"https?://", page)
    code, out = _run("epoch", str(store), "--step", "2", "-o", str(tmp_path / "r2"))
    assert code == 0 and (tmp_path / "r2" / "gantt-step2.svg").exists(), out
    cases = [
        (["epoch", str(store), "--epoch", "nope"], "--epoch 'nope' is not in"),
        (["epoch", str(store), "--step", "3"], "--step 3: epoch 'train-s0' has no stored plan for it"),
        (["epoch", str(manifest)], "is not a plan store"),
    ]
    for args, message in cases:
        code, out = _run(*args)
        assert code == 2 and message in out, (args, out)


def test_plan_report_errors_name_the_option(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"groups": []}')
    cases = [
        (["plan"], "give one of: a PLAN file, or --workload and --cluster"),
        (["plan", str(bad), "-w", "text-longtail"], "give one of: a PLAN file"),
        (["plan", "-w", "text-longtail"], "--workload needs --cluster"),
        (["plan", "-w", "nope", "-c", "h200x8"], "unknown workload preset 'nope'"),
        (["plan", str(bad)], "bad.json: not a plan (num_ranks"),
        (["plan", "-w", "text-longtail", "-c", "nope"], "--cluster: unknown cluster preset 'nope'"),
    ]
    for args, message in cases:
        code, out = _run(*args, "-o", str(tmp_path / "out"))
        assert code == 2 and message in out, (args, out)
    assert not (tmp_path / "out").exists()


def test_plan_report_writes_a_trace_with_one_track_per_rank(tmp_path: Path) -> None:
    code, out = _run("plan", "-w", "text-longtail", "-c", "h200x8", "-b", "24", "--no-baseline",
                     "--trace", str(tmp_path / "t" / "step.trace.json"), "-o", str(tmp_path / "a"))
    assert code == 0, out
    plan = Plan.model_validate_json((tmp_path / "a" / "plan.json").read_text())
    events = json.loads((tmp_path / "t" / "step.trace.json").read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["name"] == "thread_name"} == set(range(plan.num_ranks))
    assert sum(1 for e in events if e.get("cat") == "micro_batch") == sum(
        g.size * len(g.micro_batches) for g in plan.groups)


def test_report_output_stays_out_of_the_source_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import report

    package = Path(report.__file__).parent
    before = sorted(p.name for p in package.iterdir())
    code, out = _run("plan", "-w", "text-longtail", "-c", "h200x8", "-b", "8", "-o", str(package))
    assert code == 2 and "is inside the source package 'report'" in out, out
    code, out = _run("plan", "-w", "text-longtail", "-c", "h200x8", "-b", "8", "-o", str(package / "x"))
    assert code == 2 and "outside the source tree" in out, out
    assert sorted(p.name for p in package.iterdir()) == before
    monkeypatch.chdir(tmp_path)  # the default is dcp-report/ in the working directory
    code, out = _run("plan", "-w", "text-longtail", "-c", "h200x8", "-b", "8")
    assert code == 0 and (tmp_path / "dcp-report" / "plan.json").is_file(), out
