"""The planned step on 4 gloo ranks against a naive reference written from the definitions.

The reference (``tests/executor/naive_reference.py``) shares no code with ``executor/``: explicit
softmax attention, hand-written norms and losses, plain loops over samples, the global mean loss
computed by hand. The world-4 runs are those of ``scenarios.worker`` (1D and 2D; groups 2+1+1,
4 and 1+2+1; uneven shards; samples shorter than their group; several micro-batches; mixed
checkpoint policies; token and sample normalisation), spawned once per session.
"""

from __future__ import annotations

import functools

import pytest
import torch

from costmodel.presets import default_cost_model_file, load_cluster
from costmodel.specs import Sample
from executor.layout import PackedLayout
from executor.runtime import sample_shape, token_weights
from planner.config import PlannerConfig
from planner.plan import Plan
from planner.planning import plan_batch
from planner.workload import WorkloadSpec, sample_batch
from tests.executor import scenarios
from tests.executor.helpers import CONFIG, build_model, dataset_for, make_plan, s1d
from tests.executor.naive_reference import NaiveSample, step_gradients

REL_TOL_FP64 = 1e-10
CASES = [("1d", 0), ("1d", 1), ("1d", 2), ("2d", 0), ("2d", 1), ("3d", 0), ("3d", 1)]


def _plan(kind: str, index: int) -> Plan:
    return (scenarios.plans_1d() if kind == "1d" else scenarios.plans_2d())[index]


@functools.cache
def _naive(kind: str, index: int) -> tuple[float, dict[str, torch.Tensor], list[str]]:
    plan = _plan(kind, index)
    model = build_model(kind)
    data = dataset_for(plan, kind)
    samples = [ps.sample for g in plan.groups for mb in g.micro_batches for ps in mb.samples]
    naive = []
    for sample in samples:
        item = data.load(sample)
        naive.append(NaiveSample(inputs=item["inputs"], targets=item["targets"],  # type: ignore[arg-type]
                                 frames=sample.num_frames))
    loss, grads = step_gradients(dict(model.named_parameters()), naive, kind=kind,
                                 normalizer=plan.loss_normalizer.kind, num_layers=CONFIG.num_layers,
                                 num_heads=CONFIG.num_heads)
    return loss, grads, [name for name, _ in model.named_parameters()]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("kind", "index"), CASES)
def test_gradient_equals_naive_reference(world4_results: list[dict[str, object]], kind: str,
                                         index: int) -> None:
    _, reference, names = _naive(kind, index)
    for r, res in enumerate(world4_results):
        grads = res[f"grad_{kind}_{index}"]
        assert isinstance(grads, list) and len(grads) == len(names)
        for name, got in zip(names, grads, strict=True):
            want = reference[name]
            scale = float(want.abs().max())
            assert scale > 0.0, f"{name}: the reference gradient is zero"
            rel = float((got - want).abs().max()) / scale
            assert rel <= REL_TOL_FP64, f"rank {r} {kind}[{index}] {name}: relative diff {rel:.2e}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("kind", "index"), CASES)
def test_step_loss_equals_naive_global_mean(world4_results: list[dict[str, object]], kind: str,
                                            index: int) -> None:
    loss, _, _ = _naive(kind, index)
    shares = [float(res[f"loss_{kind}_{index}"]) for res in world4_results]  # type: ignore[arg-type]
    assert sum(shares) == pytest.approx(loss, rel=1e-12, abs=0.0)
    # Each rank holds only its share: no rank's value is the step loss by itself.
    assert all(abs(s - loss) > 1e-6 * loss for s in shares)


def _weights_of_plan(plan: Plan, samples: dict[str, Sample]) -> list[torch.Tensor]:
    """Every rank's loss weights of every micro-batch, as the executor computes them."""
    out = []
    for rank in range(plan.num_ranks):
        view = plan.rank_view(rank)
        for micro in view.group.micro_batches:
            planned = [samples[ps.sample.id] for ps in micro.samples]
            layout = PackedLayout(samples=tuple(sample_shape(s) for s in planned),
                                  group_size=view.group.size, index_in_group=view.index_in_group)
            out.append(token_weights(planned, layout, view.loss_normalizer, dtype=torch.float64,
                                     device="cpu"))
    return out


def _check_normaliser(plan: Plan, samples: list[Sample], normalizer: str) -> None:
    tokens = sum(s.tokens for s in samples)
    expected_total = tokens if normalizer == "tokens" else len(samples)
    assert plan.loss_normalizer.kind == normalizer
    assert plan.loss_normalizer.total == expected_total
    weights = _weights_of_plan(plan, {s.id: s for s in samples})
    # Every token of the step is weighted exactly once, over all ranks and micro-batches ...
    assert sum(w.numel() for w in weights) == tokens
    # ... and the weights are the global normaliser's: they add up to one.
    assert float(sum(w.sum() for w in weights)) == pytest.approx(1.0, rel=1e-12)
    if normalizer == "tokens":
        assert all(bool((w == 1.0 / tokens).all()) for w in weights)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("normalizer", ["tokens", "samples"])
@pytest.mark.parametrize("cluster_name", ["h200x8", "h200x32"])
def test_loss_normaliser_is_the_global_count_of_planned_steps(cluster_name: str, normalizer: str) -> None:
    spec = WorkloadSpec.preset("text-longtail")
    cluster = load_cluster(cluster_name)
    cmf = default_cost_model_file(spec.model, cluster.hardware.name)
    samples = sample_batch(spec, num_samples=24, seed=3, step=0)
    plan = plan_batch(samples, cluster=cluster, cost_model=cmf,
                      config=PlannerConfig(loss_normalization=normalizer))  # type: ignore[arg-type]
    _check_normaliser(plan, samples, normalizer)


@pytest.mark.parametrize("normalizer", ["tokens", "samples"])
def test_loss_normaliser_does_not_depend_on_the_plan(normalizer: str) -> None:
    samples = [s1d(f"x{i}", t) for i, t in enumerate([7, 1, 12, 3, 5, 9, 2])]
    a, b, c, d, e, f, g = ((s, 1) for s in samples)
    layouts = [
        [([0, 1, 2, 3], [[a, b, c, d, e, f, g]])],  # one group, one micro-batch
        [([0, 1, 2, 3], [[a], [b], [c], [d], [e], [f], [g]])],  # one group, one sample each
        [([0], [[a, b]]), ([1], [[c]]), ([2], [[d, e]]), ([3], [[f], [g]])],  # no SP
        [([0, 1], [[c, a], [b]]), ([2], []), ([3], [[d, e, f, g]])],  # an idle rank
    ]
    digests = set()
    for groups in layouts:
        plan = make_plan(groups, num_ranks=4, normalizer=normalizer)
        digests.add(plan.digest())
        _check_normaliser(plan, samples, normalizer)
    assert len(digests) == len(layouts)
