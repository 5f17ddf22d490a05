"""The pictures are what they claim: SVG that parses with one bar per micro-batch, valid PNG that is
not blank, an epoch chart with one gap bar per step, an HTML page that references nothing outside."""

from __future__ import annotations

import io
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest
from PIL import Image

from costmodel.evaluate import CostModel
from costmodel.presets import default_cost_model_file, load_cluster
from planner.baseline_plan import strongest_baseline_plan
from planner.config import PlannerConfig
from planner.plan import Plan
from planner.planning import plan_batch
from planner.workload import WorkloadSpec, sample_batch
from report.epoch_report import epoch_image, rolling_mean, rolling_window
from report.figures import PlanPictureInput, StepFigures, summarise
from report.gantt import group_ticks
from report.html import EpochInfo, epoch_html
from report.plan_report import plan_image

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def plans() -> list[tuple[Plan, PlanPictureInput]]:
    spec = WorkloadSpec.preset("video-short")
    cluster = load_cluster("h200x8")
    file = default_cost_model_file(spec.model, cluster.hardware.name)
    cm = CostModel(file=file, cluster=cluster)
    out = []
    for step in range(3):
        samples = sample_batch(spec, num_samples=48, seed=2, step=step)
        config = PlannerConfig(seed=step, use_cpsat=False)
        plan = plan_batch(samples, cluster=cluster, cost_model=file, config=config, step=step)
        baseline = strongest_baseline_plan(plan, samples, cluster=cluster, cost_model=file, config=config)
        out.append((plan, PlanPictureInput(plan=plan, cost_model=cm, baseline=baseline, label=f"step {step}")))
    return out


def _paths_in_group(root: ET.Element, gid: str) -> int:
    groups = [e for e in root.iter(f"{SVG}g") if e.get("id") == gid]
    assert len(groups) == 1, f"no single <g id={gid!r}>"
    return sum(1 for e in groups[0].iter() if e.tag in (f"{SVG}path", f"{SVG}use"))


def test_gantt_svg_has_one_bar_per_micro_batch(plans: list[tuple[Plan, PlanPictureInput]]) -> None:
    plan, data = plans[0]
    assert data.baseline is not None
    root = ET.fromstring(plan_image(data, "svg"))
    assert root.tag == f"{SVG}svg"
    assert _paths_in_group(root, "dcp-microbatches") == sum(len(g.micro_batches) for g in plan.groups)
    assert _paths_in_group(root, "baseline-microbatches") == sum(
        len(g.micro_batches) for g in data.baseline.groups)
    assert _paths_in_group(root, "dcp-compute") >= 1 and _paths_in_group(root, "dcp-grad_sync") == 1
    text = " ".join("".join(t.itertext()) for t in root.iter(f"{SVG}text"))
    for label in ("time from the start of the step (s)", "compute (forward + backward)", "all-to-all",
                  "recompute", "gradient sync", "idle", "strongest baseline", "(SP "):
        assert label in text, label


def test_gantt_png_is_a_png_and_not_blank(plans: list[tuple[Plan, PlanPictureInput]]) -> None:
    png = plan_image(plans[1][1], "png")
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    Image.open(io.BytesIO(png)).verify()
    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.width >= 1000 and image.height >= 500
    colors = image.getcolors(maxcolors=1 << 20) or []
    assert len(colors) > 50  # bars, text, legend: far from a blank page
    assert max(c for c, _ in colors) < 0.8 * image.width * image.height


def test_epoch_chart_and_summary(plans: list[tuple[Plan, PlanPictureInput]]) -> None:
    steps = [StepFigures.of_plan(plan.model_dump(mode="json")) for plan, _ in plans]
    assert [s.gap for s in steps] == pytest.approx([p.gap for p, _ in plans])
    svg = epoch_image(steps, title="test epoch", fmt="svg")
    root = ET.fromstring(svg)
    bars = [e for e in root.iter(f"{SVG}g") if (e.get("id") or "").startswith("gap-step")]
    assert len(bars) == len(steps)
    lines = {e.get("id") for e in root.iter(f"{SVG}g") if (e.get("id") or "").startswith("speedup-")}
    assert "speedup-strongest" in lines and "speedup-bucket-sp4" in lines
    summary = {b.name: b for b in summarise(steps)}
    assert summary["strongest"].min_speedup >= 1.0 - 1e-9  # never slower than a baseline it computed
    info = EpochInfo(epoch_id="e", state="done", steps_done=3, steps_total=3, cluster_name="h200x8", num_gpus=8,
                     cost_model_id=plans[0][0].cost_model_id, batch_rule="samples per step 48", seed=2,
                     manifest="test (144 samples)")
    page = epoch_html(info, steps, epoch_svg=svg, gantt_svg=plan_image(plans[0][1], "svg"), gantt_step=0)
    assert not re.search(r"https?://", page, flags=re.IGNORECASE)

    class Refs(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.refs: list[str] = []

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            self.refs += [v or "" for k, v in attrs if k in ("src", "href")]

    parser = Refs()
    parser.feed(page)
    assert len(parser.refs) == 2 and all(r.startswith("data:image/svg+xml;base64,") for r in parser.refs)
    for name in ("strongest", "bucket-sp4", "static-best"):
        assert f">{name}" in page or name in page


def test_many_groups_share_labels_by_runs_of_one_size() -> None:
    few = [(0, 4), (4, 2), (6, 1), (7, 1)]
    assert group_ticks(few) == ([2.0, 5.0, 6.5, 7.5],
                                ["ranks 0-3 (SP 4)", "ranks 4-5 (SP 2)", "rank 6 (SP 1)", "rank 7 (SP 1)"])
    many = [(0, 8), (8, 4), (12, 4), *[(16 + i, 1) for i in range(48)]]
    ticks, labels = group_ticks(many)
    assert labels == ["ranks 0-7 (SP 8)", "ranks 8-15 (2 groups of SP 4)", "ranks 16-63 (48 groups of SP 1)"]
    assert ticks == [4.0, 12.0, 40.0]


def test_long_epochs_draw_a_sliding_mean_that_skips_missing_steps() -> None:
    assert rolling_window(100) == 1 and rolling_window(960) == 21
    assert rolling_mean([1.0, 2.0, float("nan"), 4.0, 5.0], 3) == [1.5, 1.5, 3.0, 4.5, 4.5]


def test_svg_micro_batches_have_hover_text_with_their_samples(plans: list[tuple[Plan, PlanPictureInput]]) -> None:
    plan, data = plans[0]
    root = ET.fromstring(plan_image(data, "svg"))
    group = next(g for g in root.iter(f"{SVG}g") if g.get("id") == "dcp-microbatches")
    titles = ["".join(p.find(f"{SVG}title").itertext()) for p in group.iter(f"{SVG}path")]  # type: ignore[union-attr]
    ordered = [mb for g in sorted(plan.groups, key=lambda g: g.first_rank) for mb in g.micro_batches]
    assert len(titles) == len(ordered)
    for title, mb in zip(titles, ordered, strict=True):
        assert f"{len(mb.samples)} samples" in title and mb.samples[0].sample.id in title
        assert f"{sum(ps.sample.tokens for ps in mb.samples):,} tokens" in title


def test_epoch_chart_puts_the_strongest_first_and_weak_baselines_apart() -> None:
    from report.epoch_report import split_baselines

    steps = [StepFigures(step=i, predicted_step_time_s=1.0, lower_bound_s=0.98, bound_kind="area", status="HEURISTIC",
                         baselines_s={"static-best": 1.03 + 0.01 * i, "megatron-dyncp": 1.05, "bucket-sp4": 2.9,
                                      "naive": 4.0})
             for i in range(4)]
    strong, weak = split_baselines(steps)
    assert strong[0] == "strongest" and set(strong) == {"strongest", "static-best", "megatron-dyncp"}
    assert set(weak) == {"bucket-sp4", "naive"}
    svg = epoch_image(steps, title="t", fmt="svg").decode()
    texts = " ".join("".join(t.itertext()) for t in ET.fromstring(svg).iter(f"{SVG}text"))
    assert "Weak baselines" in texts and "over the strongest baseline" in texts
    assert "1.04x" in texts or "1.02x" in texts  # a linear axis labels speedups near 1 in hundredths


def test_speedup_axis_labels_are_distinct_in_a_narrow_range() -> None:
    """Speedups within 1.00-1.02x: the axis ticks are 0.0025 apart, and two-decimal labels
    repeated (``1.01x`` four times on the dashboard's chart)."""
    steps = [StepFigures(step=i, predicted_step_time_s=1.0, lower_bound_s=0.98, bound_kind="area", status="HEURISTIC",
                         baselines_s={"static-best": 1.005 + 0.004 * (i % 3), "megatron-dyncp": 1.012 + 0.002 * i})
             for i in range(4)]
    svg = epoch_image(steps, title="t", fmt="svg").decode()
    root = ET.fromstring(svg)
    axis = next(g for g in root.iter(f"{SVG}g") if g.get("id") == "matplotlib.axis_2")  # the first panel's y axis
    labels = [t for t in ("".join(e.itertext()).strip() for e in axis.iter(f"{SVG}text")) if t.endswith("x")]
    assert len(labels) >= 3, labels
    assert len(set(labels)) == len(labels), labels
    assert all(abs(float(a[:-1]) - float(b[:-1]) - (float(labels[1][:-1]) - float(labels[0][:-1]))) < 1e-9
               for a, b in zip(labels[1:], labels[:-1], strict=True)), labels  # evenly spaced values, as the ticks


def test_baselines_drawn_over_each_other_stay_distinguishable() -> None:
    """static-best is the strongest at every step and megatron-dyncp makes the same plan: three
    lines on the same points. Each keeps its own look (the strongest a band under the others, the
    two baselines their own marker and dashes), so every legend entry names a line one can see."""
    from report.epoch_report import epoch_figure

    steps = [StepFigures(step=i, predicted_step_time_s=1.0, lower_bound_s=0.98, bound_kind="area", status="HEURISTIC",
                         baselines_s={"static-best": 1.03 + 0.01 * i, "megatron-dyncp": 1.03 + 0.01 * i})
             for i in range(4)]
    top = epoch_figure(steps, title="t").axes[0]
    lines = {line.get_gid(): line for line in top.get_lines() if (line.get_gid() or "").startswith("speedup-")}
    assert set(lines) == {"speedup-strongest", "speedup-static-best", "speedup-megatron-dyncp"}
    assert len({tuple(line.get_ydata()) for line in lines.values()}) == 1  # all on the same points

    def look(line):  # type: ignore[no-untyped-def]
        return (line.get_color(), line.get_marker(), str(line.get_linestyle()), line.get_linewidth())

    assert len({look(line) for line in lines.values()}) == 3
    static, megatron = lines["speedup-static-best"], lines["speedup-megatron-dyncp"]
    assert static.get_marker() != megatron.get_marker() and static.get_linestyle() != megatron.get_linestyle()
    band = lines["speedup-strongest"]
    assert band.get_linewidth() > 3 * static.get_linewidth() and band.get_zorder() < static.get_zorder()
    assert {t.get_text() for t in top.get_legend().get_texts()} >= {"static-best", "megatron-dyncp"}


def test_thin_bands_alternate_shades_instead_of_one_block() -> None:
    """At 1,024 GPUs a 1-rank group is under a pixel tall and has no white edges: neighbouring
    groups and consecutive micro-batches alternate two shades of each colour (it was one block of
    compute blue), and the legend says what the lighter shade means."""
    from report.gantt import COLORS, lighter

    spec = WorkloadSpec.preset("text-longtail")
    cluster = load_cluster("h200x1024")
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=4096, seed=1, step=0)
    plan = plan_batch(samples, cluster=cluster, cost_model=cmf, config=PlannerConfig(use_cpsat=False))
    assert sum(g.size == 1 for g in plan.groups) > 100  # thin bands, the case of this test
    svg = plan_image(PlanPictureInput(plan=plan, cost_model=CostModel(file=cmf, cluster=cluster)), "svg").decode()
    root = ET.fromstring(svg)
    compute = next(g for g in root.iter(f"{SVG}g") if g.get("id") == "dcp-compute")
    fills = {m.group(1).upper() for m in re.finditer(r"fill:\s*(#[0-9a-fA-F]{6})", ET.tostring(compute).decode())}
    assert {COLORS["compute"].upper(), lighter(COLORS["compute"]).upper()} <= fills, fills
    texts = " ".join("".join(t.itertext()) for t in root.iter(f"{SVG}text"))
    assert "lighter shade" in texts


def test_summary_totals_are_over_the_steps_each_baseline_planned() -> None:
    """naive could not hold two of three steps: its total is over the one step it planned (against
    the plans' time on that step), and the summary page says '1 of 3'."""
    steps = [StepFigures(step=i, predicted_step_time_s=1.0 + i, lower_bound_s=0.9 + i, bound_kind="area",
                         status="HEURISTIC", baselines_s={"static-best": 1.1 + i, **({"naive": 4.0} if i == 0 else {})})
             for i in range(3)]
    summary = {b.name: b for b in summarise(steps)}
    assert summary["naive"].num_steps == 1 and summary["naive"].total_speedup == pytest.approx(4.0)
    assert summary["static-best"].num_steps == 3
    assert summary["static-best"].total_speedup == pytest.approx((1.1 + 2.1 + 3.1) / (1.0 + 2.0 + 3.0))
    info = EpochInfo(epoch_id="e", state="done", steps_done=3, steps_total=3, cluster_name="h200x8", num_gpus=8,
                     cost_model_id="m", batch_rule="samples per step 8", seed=0, manifest="m (24 samples)")
    page = epoch_html(info, steps, epoch_svg=epoch_image(steps, title="t", fmt="svg"), gantt_svg=None, gantt_step=None)
    naive_row = next(row for row in page.split("<tr>") if "<td class=name>naive</td>" in row)
    assert "<td>1 of 3</td>" in naive_row and "<td>4.00x</td>" in naive_row
