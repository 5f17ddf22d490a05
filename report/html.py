"""The one-page HTML summary of an epoch: self-contained (styles inline, images as ``data:`` URIs),
so it opens offline, from a file or from the service, and references nothing else."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from dataclasses import dataclass

from planner.baselines import description
from report.figures import STRONGEST, StepError, StepFigures, summarise

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 1.5rem auto;
       max-width: 1200px; color: #222; padding: 0 1rem; }
h1 { font-size: 1.4rem; margin-bottom: 0.2rem; }
h2 { font-size: 1.1rem; margin-top: 1.6rem; border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; }
table { border-collapse: collapse; font-size: 0.9rem; }
th, td { padding: 0.25rem 0.7rem; text-align: right; border-bottom: 1px solid #eee; }
th { background: #f4f4f4; }
td.name, th.name { text-align: left; }
dl { display: grid; grid-template-columns: max-content auto; gap: 0.2rem 1rem; font-size: 0.9rem; }
dt { font-weight: 600; }
img { width: 100%; height: auto; border: 1px solid #eee; }
p.note { font-size: 0.85rem; color: #555; }
"""


@dataclass(frozen=True, kw_only=True, slots=True)
class EpochInfo:
    """What the summary says about the epoch job."""

    epoch_id: str
    """Epoch id."""
    state: str
    """Job state."""
    steps_done: int
    """Steps planned."""
    steps_total: int
    """Steps of the epoch."""
    cluster_name: str
    """Cluster."""
    num_gpus: int
    """World size."""
    cost_model_id: str
    """Cost model."""
    batch_rule: str
    """The global batch rule, as text."""
    seed: int
    """Job seed."""
    manifest: str
    """Where the samples came from, and how many."""


def data_uri(image: bytes, media_type: str) -> str:
    """A ``data:`` URI of an image."""
    return f"data:{media_type};base64,{base64.b64encode(image).decode('ascii')}"


def _error_text(errors: Sequence[StepError]) -> str:
    if not errors:
        return "no measurement posted yet (POST /v1/epochs/{id}/measurements)"
    total = sum(e.num_micro_batches for e in errors)
    mape = sum(e.mape * e.num_micro_batches for e in errors) / total
    ratio = sum(e.mean_ratio * e.num_micro_batches for e in errors) / total
    return (f"{len(errors)} measured steps, {total} micro-batches: MAPE {mape:.1%}, "
            f"mean predicted / measured {ratio:.3f}")


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def epoch_html(info: EpochInfo, steps: Sequence[StepFigures], *, epoch_svg: bytes | None,
               gantt_svg: bytes | None = None, gantt_step: int | None = None,
               errors: Sequence[StepError] = (), gantt_note: str | None = None) -> str:
    """The summary page.

    Args:
        info: The job.
        steps: The stored steps' figures.
        epoch_svg: The epoch chart (``report.epoch_report.epoch_image``, SVG; None without a step).
        gantt_svg: One step's Gantt chart (``report.plan_report.plan_image``, SVG), if any.
        gantt_step: Which step that is.
        errors: Prediction errors of the measured steps (``api.report_data.prediction_errors``).
        gantt_note: Why there is no Gantt chart of ``gantt_step`` (shown instead of it).
    """
    gaps = [s.gap for s in steps]
    rows = []
    for b in summarise(steps):
        label = "strongest (fastest but naive, per step)" if b.name == STRONGEST else b.name
        rows.append(f"<tr><td class=name>{_esc(label)}</td><td>{b.total_speedup:.2f}x</td>"
                    f"<td>{b.mean_speedup:.2f}x</td><td>{b.min_speedup:.2f}x</td>"
                    f"<td>{b.max_speedup:.2f}x</td><td>{b.num_steps} of {len(steps)}</td>"
                    f"<td class=name>{_esc(description(b.name) if b.name != STRONGEST else '')}</td></tr>")
    plan_total = sum(s.predicted_step_time_s for s in steps)
    facts = [
        ("state", f"{info.state}, {info.steps_done}/{info.steps_total} steps planned "
                  f"({info.steps_done / max(info.steps_total, 1):.0%})"),
        ("cluster", f"{info.cluster_name} ({info.num_gpus} GPUs)"),
        ("cost model", info.cost_model_id),
        ("global batch", info.batch_rule),
        ("seed", str(info.seed)),
        ("manifest", info.manifest),
        ("predicted time of the planned steps", f"{plan_total:.4g} s"),
        ("gap to the lower bound", f"mean {100 * sum(gaps) / len(gaps):.2f}%, max {100 * max(gaps):.2f}%"
         if gaps else "no step planned yet"),
        ("prediction error", _error_text(errors)),
    ]
    parts = [
        "<!DOCTYPE html>", "<html lang=en><head><meta charset=utf-8>",
        f"<title>dcp epoch {_esc(info.epoch_id)}</title><style>{_CSS}</style></head><body>",
        f"<h1>Epoch {_esc(info.epoch_id)}</h1>",
        "<p class=note>Predicted by the plans' cost model; every step is a fresh global batch. "
        "Speedup = the baseline's predicted step time / the plan's.</p>",
        "<dl>" + "".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in facts) + "</dl>",
    ]
    if steps and epoch_svg is not None:
        parts += [
            "<h2>Speedup over each baseline</h2>",
            "<table><tr><th class=name>baseline</th><th>total</th><th>mean</th><th>min</th><th>max</th>"
            "<th>steps</th><th class=name>what it is</th></tr>" + "".join(rows) + "</table>",
            "<p class=note>steps: the steps the baseline could plan (one that cannot hold a step's "
            "longest sample has no time for it); every figure of its row is over those steps. total: "
            "the baseline's time over them / the plans' time over the same steps (the throughput "
            "gain); mean, min, max: per step.</p>",
            "<h2>Per step</h2>",
            f'<img alt="speedup and gap per step" src="{data_uri(epoch_svg, "image/svg+xml")}">',
        ]
    if gantt_svg is not None:
        parts += [f"<h2>Step {gantt_step}: the plan beside the strongest baseline</h2>",
                  f'<img alt="Gantt chart of step {gantt_step}" '
                  f'src="{data_uri(gantt_svg, "image/svg+xml")}">']
    elif gantt_note is not None:
        parts += [f"<h2>Step {gantt_step}</h2>", f"<p class=note>No Gantt chart: {_esc(gantt_note)}</p>"]
    parts.append("</body></html>")
    return "\n".join(parts)
