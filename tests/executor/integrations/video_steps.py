"""The two halves of a video-model integration test, shared by the diffusers models (Latte, Wan,
HunyuanVideo): the plain model on each whole clip with the plan's normaliser by hand, and one
planned step of the DCP model on one rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from executor.runtime import Executor, MicroBatchWork
from planner.plan import Plan


def plan_samples(plan: Plan) -> list[Any]:
    """Every sample of the plan, in group then micro-batch order."""
    return [ps.sample for g in plan.groups for mb in g.micro_batches for ps in mb.samples]


def reference_backward(model: Any, plan: Plan, *, data: Callable[[Any], dict[str, torch.Tensor]],
                       text_key: str, values: int,
                       extra: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> float:
    """The plain model on each whole clip (``data(sample)``: video, target, timestep, text states
    under ``text_key``; ``extra(d)``: the model's other keyword inputs, batched), squared errors
    over ``values`` per patch, the plan's normaliser by hand; gradients into ``model``; the loss."""
    samples = plan_samples(plan)
    loss = torch.zeros((), dtype=torch.float64)
    for sample in samples:
        d = data(sample)
        out = model(hidden_states=d["video"][None], timestep=d["timestep"],
                    encoder_hidden_states=d[text_key][None], **(extra(d) if extra else {})).sample[0]
        squared = ((out - d["target"]) ** 2).sum() / values
        if plan.loss_normalizer.kind == "tokens":
            loss = loss + squared / plan.loss_normalizer.total
        else:
            loss = loss + squared / (sample.tokens * len(samples))
    loss.backward()
    return float(loss.detach())


def run_step(executor: Executor, model: Any, plan: Plan, *, load: Callable[[Any], dict[str, object]],
             forward: Callable[[MicroBatchWork, list[dict[str, object]]], torch.Tensor],
             token_losses: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
    """One planned step of a DCP video model on this rank (the lines a user's loop has); its loss
    share. ``load(sample)`` gives an item with ``inputs``/``targets`` patches and what ``forward``
    needs; ``forward(work, items)`` runs the model on the micro-batch."""
    by_id = {s.id: s for s in plan_samples(plan)}
    rank_plan = plan.rank_view(executor.rank)
    executor.begin_step(rank_plan, step=plan.step or 0)
    share = 0.0
    for work in executor.micro_batches(rank_plan, load_sample=load):
        pred = forward(work, [load(by_id[i]) for i in work.sample_ids])
        loss = work.loss(token_losses(pred, work.targets))
        loss.backward()
        share += float(loss.detach())
    executor.sync_gradients(model)
    return share


def assert_world_equals_reference(world: list[dict[str, object]], key: str, index: int, *, loss: float,
                                  reference: dict[str, torch.Tensor], tol: float, loss_tol: float | None = None,
                                  loose: frozenset[str] | set[str] = frozenset(), loose_tol: float = 1e-6,
                                  noise_floor: float = 0.0) -> int:
    """Every rank's ``{key}_loss_{index}`` / ``{key}_grad_{index}`` against the plain model's
    ``loss`` and parameter gradients ``reference``: the loss shares sum to ``loss`` within
    ``loss_tol`` (default ``tol``) relative; every gradient is within ``tol`` relative to its
    largest value, those named in ``loose`` within ``loose_tol``; an all-zero reference gradient
    must be all zero. With ``noise_floor``, a reference gradient below ``noise_floor`` times the
    model's largest is rounding noise around an exact zero and is checked against ``tol`` times
    the largest gradient instead. Returns the (rank, parameter) pairs checked to ``tol``
    relative."""
    shares = [float(res[f"{key}_loss_{index}"]) for res in world]  # type: ignore[arg-type]
    bound = tol if loss_tol is None else loss_tol
    assert abs(sum(shares) - loss) <= bound * abs(loss), (sum(shares), loss)
    largest = max(float(g.abs().max()) for g in reference.values())
    checked = 0
    for r, res in enumerate(world):
        grads = res[f"{key}_grad_{index}"]
        assert isinstance(grads, dict) and grads.keys() == reference.keys()
        for name, want in reference.items():
            scale = float(want.abs().max())
            diff = float((grads[name] - want).abs().max())
            if scale == 0.0:
                assert float(grads[name].abs().max()) == 0.0, name
            elif scale < noise_floor * largest:
                assert diff <= tol * largest, f"rank {r}, plan {index}: {name} diff {diff:.2e} (noise-level gradient)"
            else:
                limit, rel = (loose_tol if name in loose else tol), diff / scale
                assert rel <= limit, f"rank {r}, plan {index}: {name} relative diff {rel:.2e} > {limit}"
                checked += name not in loose
    return checked
