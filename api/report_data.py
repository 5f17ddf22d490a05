"""What the report pictures of stored epochs need, read from the plan store (``dcp report epoch``
and the service's report routes).

A stored plan changes only when it is re-planned (a new digest), so an epoch's per-step figures
are kept in a small in-process cache and only the steps stored or re-planned since are read (by
SQLite's JSON functions, ``PlanStore.step_figures``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from api.store import EpochRecord, PlanStore
from costmodel.evaluate import CostModel
from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec, Sample
from planner.baseline_plan import strongest_baseline_plan
from planner.epoch import build_config, epoch_options, step_seed
from planner.plan import Plan
from report.figures import PlanPictureInput, StepError, StepFigures
from report.html import EpochInfo


class StepNotStoredError(LookupError):
    """The step has no stored plan (yet)."""


class CostModelChangedError(ValueError):
    """The cost model stored under the epoch's id is not the one its plans were made with."""


def epoch_info(record: EpochRecord) -> EpochInfo:
    """The job as the HTML summary describes it."""
    spec = record.spec
    batch = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in spec["batch"].items())
    manifest = spec.get("manifest", {})
    return EpochInfo(epoch_id=record.id, state=record.state, steps_done=record.steps_done,
                     steps_total=record.steps_total, cluster_name=spec["cluster"]["name"],
                     num_gpus=cluster_of(record).num_gpus,
                     cost_model_id=spec["cost_model_id"], batch_rule=batch, seed=int(spec["seed"]),
                     manifest=f"{manifest.get('source', '?')} ({manifest.get('num_samples', '?')} samples)")


def epoch_title(record: EpochRecord) -> str:
    """Title of the epoch chart."""
    spec = record.spec
    return (f"epoch {record.id}: {record.steps_done}/{record.steps_total} steps planned, "
            f"{spec['cluster']['name']}, cost model {spec['cost_model_id']}")


class EpochFiguresCache:
    """Per-step figures of the most recently asked epochs, by plan digest (thread-safe): a step
    re-planned since (a new digest) is read again."""

    def __init__(self, *, max_epochs: int = 8) -> None:
        self.max_epochs = max_epochs
        self._lock = threading.Lock()
        self._epochs: OrderedDict[str, dict[int, tuple[str, StepFigures]]] = OrderedDict()

    def steps(self, store: PlanStore, epoch_id: str) -> list[StepFigures]:
        """Figures of every stored step of the epoch, by step (reads only new or changed steps)."""
        digests = store.digests(epoch_id)
        with self._lock:
            cached = self._epochs.get(epoch_id, {})
            known = {s: v for s, v in cached.items() if digests.get(s) == v[0]}
        missing = sorted(set(digests) - set(known))
        for row in store.step_figures(epoch_id, missing):
            step = int(row["step"])
            known[step] = (digests[step], StepFigures.of_plan(row))
        with self._lock:
            self._epochs[epoch_id] = known
            self._epochs.move_to_end(epoch_id)
            while len(self._epochs) > self.max_epochs:
                self._epochs.popitem(last=False)
        return [known[s][1] for s in sorted(known)]


def cluster_of(record: EpochRecord) -> ClusterSpec:
    """The epoch's cluster as stored."""
    return ClusterSpec.model_validate(record.spec["cluster"])


def step_picture_input(store: PlanStore, record: EpochRecord, step: int, *,
                       get_cost_model: Callable[[str], CostModelFile], with_baseline: bool = True
                       ) -> PlanPictureInput:
    """The stored plan of a step with its cost model and, when asked, the strongest baseline's
    plan of the same batch, rebuilt with the epoch's options and the step's seed.

    Raises:
        StepNotStoredError: when the step has no stored plan.
        KeyError: when the plan's cost model is no longer registered.
        CostModelChangedError: when the registered one is not the one the plans were made with.
        ValueError: when the baseline cannot be rebuilt.
    """
    found = store.get_plan(record.id, step)
    if found is None:
        raise StepNotStoredError(f"step {step} of epoch {record.id!r} has no stored plan")
    plan = Plan.model_validate_json(found[1])
    spec = record.spec
    file = get_cost_model(plan.cost_model_id)
    if plan.cost_model_id == spec["cost_model_id"] and file.digest() != spec["cost_model_digest"]:
        raise CostModelChangedError(
            f"cost model {spec['cost_model_id']!r} now registered is not the one epoch {record.id!r} "
            "was planned with (its digest differs); upload that file again under its id")
    cluster = cluster_of(record)
    baseline = None
    if with_baseline:
        samples: list[Sample] = store.batch(record.id, step)
        config = build_config(epoch_options(spec), seed=step_seed(int(spec["seed"]), step))
        baseline = strongest_baseline_plan(plan, samples, cluster=cluster, cost_model=file, config=config)
    return PlanPictureInput(plan=plan, cost_model=CostModel(file=file, cluster=cluster), baseline=baseline,
                            label=f"epoch {record.id}, step {step}")


MAX_ERROR_STEPS = 512
"""Most measured steps whose prediction error the report draws (the highest ones)."""


def measurements_key(store: PlanStore, epoch_id: str) -> tuple[int, int]:
    """A cheap fingerprint of an epoch's measurements (measured steps, stored rank rows)."""
    from api.measurements_store import MeasurementStore

    measurements = MeasurementStore(store)
    return measurements.measured_steps(epoch_id), measurements.num_rows(epoch_id)


def prediction_errors(store: PlanStore, epoch_id: str, *, max_steps: int = MAX_ERROR_STEPS) -> list[StepError]:
    """Per measured step (the highest ``max_steps``): its plan's predicted micro-batch times against
    the medians its ranks measured (``api.recalibration.observations`` pairs them)."""
    from api.measurements_store import MeasurementStore
    from api.recalibration import observations, recent

    groups = recent(MeasurementStore(store).groups(epoch_id), max_steps)
    plans = {}
    for step in sorted({g.step for g in groups}):
        found = store.get_plan(epoch_id, step)
        if found is not None:
            plans[step] = Plan.model_validate_json(found[1])
    pairs: dict[int, list[tuple[float, float]]] = {}
    for r in observations(groups, plans):
        if r["measured_s"] > 0:
            pairs.setdefault(r["step"], []).append((r["predicted_s"], r["measured_s"]))
    return [StepError.of_pairs(step, p) for step, p in sorted(pairs.items())]
