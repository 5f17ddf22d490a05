"""One plan's pictures: its Gantt chart beside the strongest baseline's, as PNG or SVG bytes."""

from __future__ import annotations

from matplotlib.figure import Figure

from planner.baseline_plan import rebuilt_matches
from planner.plan import Plan
from planner.timeline import step_timeline
from report.figures import PlanPictureInput
from report.gantt import GanttPanel, gantt_figure, group_label, with_hover_titles
from report.render import ImageFormat, render


def fmt_s(seconds: float) -> str:
    """Seconds with four significant digits (``1.035 s``, ``0.0123 s``)."""
    return f"{seconds:.4g} s"


def _counts(plan: Plan) -> str:
    num_mb = sum(len(g.micro_batches) for g in plan.groups)
    return f"{len(plan.groups)} groups, {num_mb} micro-batches"


def plan_title(plan: Plan) -> str:
    """Title of the planner's panel."""
    bound = plan.lower_bound
    return (f"DCP plan: {fmt_s(plan.predicted_step_time_s)} ({plan.solver.status}, "
            f"{plan.solver.method}); lower bound {fmt_s(bound.value_s)} ({bound.kind}), "
            f"gap {plan.gap:.1%}; {_counts(plan)}")


def baseline_title(plan: Plan, baseline: Plan) -> str:
    """Title of the baseline's panel (says so when the rebuilt time is not the recorded one)."""
    name = baseline.solver.method
    ratio = baseline.predicted_step_time_s / plan.predicted_step_time_s
    text = (f"strongest baseline {name}: {fmt_s(baseline.predicted_step_time_s)}, "
            f"DCP is {ratio:.2f}x as fast; {_counts(baseline)}")
    if not rebuilt_matches(plan, baseline):
        recorded = plan.baselines_s.get(name)
        text += (f" (rebuilt; the plan records {fmt_s(recorded)})" if recorded is not None
                 else " (rebuilt)")
    return text


def plan_figure(data: PlanPictureInput) -> Figure:
    """The Gantt chart of the plan, and of its strongest baseline below it when given."""
    plan = data.plan
    panels = [GanttPanel(key="dcp", title=plan_title(plan), timeline=step_timeline(plan, data.cost_model),
                         lower_bound_s=plan.lower_bound.value_s)]
    if data.baseline is not None:
        panels.append(GanttPanel(key="baseline", title=baseline_title(plan, data.baseline),
                                 timeline=step_timeline(data.baseline, data.cost_model)))
    where = f"{data.label}: " if data.label else ""
    title = (f"{where}{plan.num_ranks} GPUs ({plan.cluster_name}), cost model {plan.cost_model_id}, "
             f"{len(plan.sample_ids)} samples")
    return gantt_figure(panels, title=title)


MAX_TITLE_IDS = 8
"""Sample ids a micro-batch's hover text lists before it says how many more."""


def micro_batch_titles(plan: Plan) -> list[str]:
    """Hover text of each micro-batch, in the order the Gantt chart draws them (groups by rank)."""
    titles = []
    for group in sorted(plan.groups, key=lambda g: g.first_rank):
        for m, mb in enumerate(group.micro_batches):
            ids = [ps.sample.id for ps in mb.samples]
            shown = ", ".join(ids[:MAX_TITLE_IDS]) + (f" and {len(ids) - MAX_TITLE_IDS} more"
                                                      if len(ids) > MAX_TITLE_IDS else "")
            tokens = sum(ps.sample.tokens for ps in mb.samples)
            peak_gib = mb.predicted_peak_mem_bytes / 2**30
            titles.append(f"{group_label(group.first_rank, group.size)}, micro-batch {m}: "
                          f"{fmt_s(mb.predicted_time_s)}, {len(ids)} samples, {tokens:,} tokens, peak "
                          f"{peak_gib:.1f} GiB per rank; samples {shown}")
    return titles


def plan_image(data: PlanPictureInput, fmt: ImageFormat) -> bytes:
    """The plan's Gantt chart as PNG or SVG bytes (in the SVG, each micro-batch has hover text:
    its group, time, samples, tokens and peak memory).

    Raises:
        ValueError: for an unknown format, or a plan that the cost model does not describe.
    """
    # Build the timelines first, outside the render lock, so a bad input fails fast.
    step_timeline(data.plan, data.cost_model)
    image = render(lambda: plan_figure(data), fmt)
    if fmt != "svg":
        return image
    image = with_hover_titles(image, key="dcp", titles=micro_batch_titles(data.plan))
    if data.baseline is not None:
        image = with_hover_titles(image, key="baseline", titles=micro_batch_titles(data.baseline))
    return image
