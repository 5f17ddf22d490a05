"""Pictures of stored epochs: a step's Gantt chart beside the strongest baseline's (SVG, PNG), the
epoch's speedup and gap per step (SVG, PNG, JSON) and its one-page HTML summary.

Rendered pictures are cached per app (``ReportCache``) under a key that names everything they
show (a step's plan digest; the epoch's per-step figures), so a re-planned step is drawn again;
rendering runs on a worker thread (``report.render`` renders
one figure at a time).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response, status
from pydantic import BaseModel, Field

from api.cost_model_store import InvalidStoredCostModelError
from api.deps import ServiceState, State
from api.errors import COMMON_RESPONSES, conflict, not_found
from api.measurements_store import GroupMeasurement, MeasurementStore
from api.report_data import (
    CostModelChangedError,
    EpochFiguresCache,
    StepNotStoredError,
    epoch_info,
    epoch_title,
    measurements_key,
    prediction_errors,
    step_picture_input,
)
from api.routers.epochs import MAX_STEP, EpochId, StepIndex, _missing_step, _record
from api.store import ACTIVE_STATES, EpochRecord
from report.figures import MEDIA_TYPES, ImageFormat, PlanPictureInput, StepError, StepFigures
from report.html import epoch_html

logger = logging.getLogger(__name__)

T = TypeVar("T")

router = APIRouter(prefix="/v1/epochs", tags=["reports"], responses=COMMON_RESPONSES)

_NOT_FOUND = {"description": "Unknown epoch, or step not planned yet (Retry-After while the job runs)."}
_CONFLICT = {"description": "The epoch's cost model is no longer registered, or differs from the one "
                            "its plans were made with."}


def _content(media_type: str, what: str) -> dict[str, Any]:
    schema: dict[str, str] = ({"type": "string", "format": "binary"} if media_type == "image/png"
                              else {"type": "object"} if media_type == "application/json" else {"type": "string"})
    return {"description": what, "content": {media_type: {"schema": schema}}}


class ReportCache:
    """Rendered pictures by key (LRU, bounded) and the epochs' per-step figures."""

    def __init__(self, *, max_items: int = 64) -> None:
        self.max_items = max_items
        self.figures = EpochFiguresCache()
        self._lock = threading.Lock()
        self._items: OrderedDict[tuple[Any, ...], Any] = OrderedDict()

    def get_or_render(self, key: tuple[Any, ...], make: Callable[[], T]) -> T:
        """The cached value of ``key``, or ``make()`` stored under it."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                found: T = self._items[key]
                return found
        data = make()
        with self._lock:
            self._items[key] = data
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)
        return data


def report_cache(request: Request) -> ReportCache:
    """The app's picture cache (created on first use)."""
    cache: ReportCache | None = getattr(request.app.state, "report_cache", None)
    if cache is None:
        cache = ReportCache()
        request.app.state.report_cache = cache
    return cache


def _picture_input(state: ServiceState, record: EpochRecord, step: int, *, with_baseline: bool) -> PlanPictureInput:
    """A stored step's plan, cost model and (optionally) strongest baseline, or the route's HTTP
    error (404 for a step not stored, 409 for a cost model gone or changed)."""
    try:
        return step_picture_input(state.store, record, step, get_cost_model=state.registry.get,
                                  with_baseline=with_baseline)
    except StepNotStoredError as exc:
        not_found(str(exc))
    except KeyError as exc:
        conflict(f"epoch {record.id!r} was planned with a cost model that is no longer registered "
                 f"({exc.args[0]})")
    except (CostModelChangedError, InvalidStoredCostModelError) as exc:
        conflict(str(exc))
    except ValueError as exc:
        conflict(f"the strongest baseline of step {step} cannot be rebuilt: {exc}")


def _stored_step(state: ServiceState, epoch_id: str, step: int) -> tuple[EpochRecord, str]:
    """The epoch's record and the step's digest, or a 404 (Retry-After while the job runs)."""
    record = _record(state, epoch_id)
    found = state.store.get_plan(epoch_id, step)
    if found is None:
        _missing_step(record, step)  # raises a 404
        raise AssertionError("unreachable")
    return record, found[0]


def _gantt_bytes(state: ServiceState, cache: ReportCache, epoch_id: str, step: int, fmt: ImageFormat,
                 baseline: bool) -> bytes:
    """A step's Gantt chart (runs on a worker thread; raises the route's HTTP errors)."""
    record, digest = _stored_step(state, epoch_id, step)

    def make() -> bytes:
        from report.plan_report import plan_image  # matplotlib: imported on the first picture

        return plan_image(_picture_input(state, record, step, with_baseline=baseline), fmt)

    return cache.get_or_render(("gantt", epoch_id, step, digest, fmt, baseline), make)


def _steps(state: ServiceState, cache: ReportCache, record: EpochRecord) -> list[StepFigures]:
    return cache.figures.steps(state.store, record.id)


def _fingerprint(steps: list[StepFigures]) -> int:
    """A hash of everything the epoch chart shows."""
    return hash(tuple((s.step, s.predicted_step_time_s, s.lower_bound_s, tuple(sorted(s.baselines_s.items())))
                      for s in steps))


def _no_steps(record: EpochRecord) -> None:
    active = record.state in ACTIVE_STATES
    not_found(f"epoch {record.id!r} has no planned step yet (job {record.state})"
              + ("; retry later" if active else ""), retry_after_s=1 if active else None)


def _errors(state: ServiceState, cache: ReportCache, epoch_id: str) -> tuple[tuple[int, int], list[StepError]]:
    """The epoch's measurements fingerprint and per-step prediction errors (none unmeasured)."""
    found = measurements_key(state.store, epoch_id)
    if found[0] == 0:
        return found, []
    return found, cache.get_or_render(("errors", epoch_id, found),
                                      lambda: prediction_errors(state.store, epoch_id))


def _epoch_bytes(state: ServiceState, cache: ReportCache, epoch_id: str, fmt: ImageFormat) -> bytes:
    record = _record(state, epoch_id)
    steps = _steps(state, cache, record)
    if not steps:
        _no_steps(record)
    measured, errors = _errors(state, cache, epoch_id)
    key = ("epoch", epoch_id, record.steps_done, record.steps_total, _fingerprint(steps), measured, fmt)
    from report.epoch_report import epoch_image  # matplotlib: imported on the first picture

    return cache.get_or_render(key, lambda: epoch_image(steps, title=epoch_title(record), fmt=fmt,
                                                        errors=errors))


BaselineFlag = Annotated[bool, Query(description="Draw the strongest baseline's plan of the same batch below.")]
Cache = Annotated[ReportCache, Depends(report_cache)]


def _gantt_route(fmt: ImageFormat) -> Callable[..., Any]:
    async def gantt(epoch_id: EpochId, step: StepIndex, state: State, cache: Cache,
                    baseline: BaselineFlag = True) -> Response:
        data = await asyncio.to_thread(_gantt_bytes, state, cache, epoch_id, step, fmt, baseline)
        return Response(content=data, media_type=MEDIA_TYPES[fmt])

    gantt.__doc__ = (f"The Gantt chart of a stored step ({fmt.upper()}): every group's micro-batches over "
                     "time (compute, recompute, all-to-all, idle, gradient sync, from the plan's cost "
                     "model) above the same batch under the strongest baseline.")
    return gantt


def _epoch_route(fmt: ImageFormat) -> Callable[..., Any]:
    async def chart(epoch_id: EpochId, state: State, cache: Cache) -> Response:
        data = await asyncio.to_thread(_epoch_bytes, state, cache, epoch_id, fmt)
        return Response(content=data, media_type=MEDIA_TYPES[fmt])

    chart.__doc__ = (f"The epoch chart ({fmt.upper()}): predicted speedup over each baseline and gap to "
                     "the lower bound, per stored step.")
    return chart


def _step_picture_route(path: str, endpoint: Callable[..., Any], *, name: str, summary: str,
                        media_type: str) -> None:
    """``GET /v1/epochs/{epoch_id}/steps/{step}/<path>``: a picture of a stored step."""
    router.add_api_route(
        f"/{{epoch_id}}/steps/{{step}}/{path}", endpoint, methods=["GET"], response_class=Response, name=name,
        summary=summary, responses={200: _content(media_type, "The chart."), 404: _NOT_FOUND, 409: _CONFLICT})


for _fmt in ("svg", "png"):
    _step_picture_route(f"gantt.{_fmt}", _gantt_route(_fmt), name=f"step_gantt_{_fmt}",
                        summary=f"Step Gantt chart ({_fmt.upper()})", media_type=MEDIA_TYPES[_fmt])
    router.add_api_route(
        f"/{{epoch_id}}/report.{_fmt}", _epoch_route(_fmt), methods=["GET"],  # type: ignore[arg-type]
        response_class=Response, name=f"epoch_chart_{_fmt}", summary=f"Epoch chart ({_fmt.upper()})",
        responses={200: _content(MEDIA_TYPES[_fmt], "The chart."),
                   404: {"description": "Unknown epoch, or no step planned yet."}})


def _step_input(state: ServiceState, epoch_id: str, step: int) -> PlanPictureInput:
    """A stored step's plan and cost model, or the route's HTTP error."""
    record, _ = _stored_step(state, epoch_id, step)
    return _picture_input(state, record, step, with_baseline=False)


def _measured_groups(state: ServiceState, epoch_id: str, step: int, digest: str) -> list[GroupMeasurement]:
    """The groups ranks measured for this step under this plan (other plans' rows left out)."""
    return [g for g in MeasurementStore(state.store).groups(epoch_id) if g.step == step and g.digest == digest]


def _trace_bytes(state: ServiceState, epoch_id: str, step: int) -> bytes:
    """A step's trace-event JSON with its measured micro-batches, if any (on a worker thread)."""
    from planner.timeline import step_timeline
    from report.trace import MeasuredMicroBatch, plan_trace_json

    data = _step_input(state, epoch_id, step)
    measured: list[MeasuredMicroBatch] = []
    for group in _measured_groups(state, epoch_id, step, data.plan.digest()):
        clock = 0.0
        for index, time_s in enumerate(group.times_s):
            measured.append(MeasuredMicroBatch(first_rank=group.first_rank, group_size=group.group_size,
                                               index=index, start_s=clock, time_s=time_s))
            clock += time_s
    return plan_trace_json(data.plan, step_timeline(data.plan, data.cost_model), measured=measured).encode()


def _memory_bytes(state: ServiceState, cache: ReportCache, epoch_id: str, step: int, fmt: ImageFormat) -> bytes:
    """A step's memory chart with the measured peaks, if any (on a worker thread)."""
    from planner.memory_view import plan_memory
    from report.memory import memory_image

    data = _step_input(state, epoch_id, step)
    plan = data.plan
    peaks = {g.first_rank: float(g.peak_bytes) for g in _measured_groups(state, epoch_id, step, plan.digest())
             if g.peak_bytes is not None}
    key = ("memory", epoch_id, step, plan.digest(), tuple(sorted(peaks.items())), fmt)
    title = (f"{epoch_id} step {step}: predicted peak memory per rank, {plan.num_ranks} GPUs "
             f"({plan.cluster_name}), cost model {plan.cost_model_id}")
    hbm = data.cost_model.cluster.hardware.hbm_bytes
    return cache.get_or_render(key, lambda: memory_image(plan_memory(plan, data.cost_model, measured_peaks_bytes=peaks),
                                                         title=title, hbm_bytes=hbm, fmt=fmt))


def _memory_route(fmt: ImageFormat) -> Callable[..., Any]:
    async def memory(epoch_id: EpochId, step: StepIndex, state: State, cache: Cache) -> Response:
        data = await asyncio.to_thread(_memory_bytes, state, cache, epoch_id, step, fmt)
        return Response(content=data, media_type=MEDIA_TYPES[fmt])

    memory.__doc__ = (f"The memory chart of a stored step ({fmt.upper()}): each group's predicted peak per "
                      "rank split into parameters, gradients, optimizer states, fixed buffers, activations "
                      "kept and per-token working set, against the cap; measured peaks where ranks posted them.")
    return memory


_MEMORY_FORMATS: tuple[ImageFormat, ...] = ("svg", "png")
for _fmt in _MEMORY_FORMATS:
    _step_picture_route(f"memory.{_fmt}", _memory_route(_fmt), name=f"step_memory_{_fmt}",
                        summary=f"Step memory chart ({_fmt.upper()})", media_type=MEDIA_TYPES[_fmt])


@router.get("/{epoch_id}/steps/{step}/trace.json", response_class=Response, name="step_trace",
            summary="Step trace (Chrome trace-event JSON)",
            responses={200: _content("application/json", "Trace-event JSON: one track per rank."),
                       404: _NOT_FOUND, 409: _CONFLICT})
async def step_trace(epoch_id: EpochId, step: StepIndex, state: State) -> Response:
    """A stored step as a Chrome trace-event file for the Perfetto UI or chrome://tracing: one track
    per rank with its micro-batches (sample ids and tokens as arguments) split into compute,
    recompute and all-to-all, idle and the gradient sync; measured micro-batches in a second
    process when ranks posted them for this plan."""
    data = await asyncio.to_thread(_trace_bytes, state, epoch_id, step)
    return Response(content=data, media_type="application/json")


class StepErrorOut(BaseModel):
    """A measured step's prediction error (``report.figures.StepError``)."""

    num_micro_batches: int = Field(description="Measured micro-batches of the step.")
    mape: float = Field(description="Mean |predicted - measured| / measured over them.")
    mean_ratio: float = Field(description="Mean predicted / measured (below 1: predicted too fast).")


class StepFiguresOut(BaseModel):
    """What one stored plan says about its step."""

    step: int
    predicted_step_time_s: float = Field(description="The plan's predicted step time.")
    lower_bound_s: float = Field(description="Its lower bound.")
    bound_kind: str
    gap: float = Field(description="predicted / bound - 1.")
    status: str = Field(description="Solver status.")
    baselines_s: dict[str, float] = Field(description="Each baseline's predicted step time.")
    speedups: dict[str, float] = Field(description="Baseline time / plan time, and 'strongest' (the "
                                                   "fastest baseline but naive).")
    strongest_baseline: str | None = Field(description="Which baseline is the strongest at this step.")
    planning_wall_s: float | None = Field(default=None, description="The planner's wall time for the step.")
    num_tokens: int = Field(default=0, description="Tokens of the step's samples.")
    predicted_tokens_per_s: float = Field(default=0.0, description="Tokens over the predicted step time.")
    measured: StepErrorOut | None = Field(default=None, description="The step's micro-batch predictions "
                                          "against what its ranks measured, once they posted measurements.")


@router.get("/{epoch_id}/figures", response_model=list[StepFiguresOut],
            responses={404: {"description": "Unknown epoch."}})
async def epoch_figures(epoch_id: EpochId, state: State, cache: Cache) -> list[StepFiguresOut]:
    """Per stored step: predicted time, lower bound and gap, each baseline's time and the speedups."""
    from planner.baselines import strongest

    def read() -> list[StepFiguresOut]:
        steps = _steps(state, cache, _record(state, epoch_id))
        errors = {e.step: StepErrorOut(num_micro_batches=e.num_micro_batches, mape=e.mape, mean_ratio=e.mean_ratio)
                  for e in _errors(state, cache, epoch_id)[1]}
        return [StepFiguresOut(step=s.step, predicted_step_time_s=s.predicted_step_time_s,
                               lower_bound_s=s.lower_bound_s, bound_kind=s.bound_kind, gap=s.gap,
                               status=s.status, baselines_s=dict(s.baselines_s), speedups=s.speedups(),
                               strongest_baseline=(strongest(s.baselines_s) or (None,))[0],
                               planning_wall_s=s.planning_wall_s, num_tokens=s.num_tokens,
                               predicted_tokens_per_s=s.predicted_tokens_per_s, measured=errors.get(s.step))
                for s in steps]

    return await asyncio.to_thread(read)


@router.get("/{epoch_id}/report.html", response_class=Response,
            responses={200: _content("text/html", "The one-page summary (self-contained)."),
                       404: _NOT_FOUND, 409: _CONFLICT})
async def epoch_report_html(
        epoch_id: EpochId, state: State, cache: Cache,
        step: Annotated[int | None, Query(ge=0, le=MAX_STEP, description="Step whose Gantt chart the page "
                                          "shows (default: the planned step with the largest gap).")] = None,
) -> Response:
    """One self-contained page: the job, the speedup over each baseline (total, mean, min, max), the
    epoch chart and one step's Gantt chart beside the strongest baseline's (images inline)."""

    def build() -> bytes:
        record = _record(state, epoch_id)
        steps = _steps(state, cache, record)
        if step is not None and step not in {s.step for s in steps}:
            _missing_step(record, step)
        chosen = step if step is not None else (
            max(steps, key=lambda s: (s.gap, -s.step)).step if steps else None)
        measured, errors = _errors(state, cache, epoch_id)
        key = ("html", epoch_id, record.state, record.steps_done, _fingerprint(steps), measured, chosen)

        def make() -> bytes:
            epoch_svg = _epoch_bytes(state, cache, epoch_id, "svg") if steps else None
            gantt, note = None, None
            if chosen is not None:
                try:
                    gantt = _gantt_bytes(state, cache, epoch_id, chosen, "svg", True)
                except HTTPException as exc:  # e.g. its cost model changed: the page without it
                    if exc.status_code != status.HTTP_409_CONFLICT:
                        raise
                    note = str(exc.detail)
            return epoch_html(epoch_info(record), steps, errors=errors, epoch_svg=epoch_svg, gantt_svg=gantt,
                              gantt_step=chosen, gantt_note=note).encode("utf-8")

        return cache.get_or_render(key, make)

    return Response(content=await asyncio.to_thread(build), media_type="text/html")
