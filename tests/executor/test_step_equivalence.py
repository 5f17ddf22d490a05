"""A planned step on 4 gloo ranks equals the plain single-process large-batch step (fp64)."""

from __future__ import annotations

import pytest
import torch

from tests.executor import scenarios
from tests.executor.helpers import build_model, reference_backward

TOL = 1e-10


@pytest.fixture
def results(world4_results: list[dict[str, object]]) -> list[dict[str, object]]:
    """Every rank's results of :func:`scenarios.worker` (one spawn per session, see conftest)."""
    return world4_results


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _reference_grads(kind: str, index: int) -> list[torch.Tensor]:
    plans = scenarios.plans_1d() if kind == "1d" else scenarios.plans_2d()  # 3d: the video plans
    model = build_model(kind)
    reference_backward(model, plans[index], kind)
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("kind", "index"), [("1d", 0), ("1d", 1), ("1d", 2), ("2d", 0), ("2d", 1), ("3d", 0),
                                           ("3d", 1)])
def test_gradient_equals_large_batch_step(results: list[dict[str, object]], kind: str, index: int
                                          ) -> None:
    reference = _reference_grads(kind, index)
    assert max(float(g.abs().max()) for g in reference) > 1e-3  # a real gradient, not zeros
    for r, res in enumerate(results):
        diff = _max_diff(res[f"grad_{kind}_{index}"], reference)  # type: ignore[arg-type]
        assert diff <= TOL, f"rank {r}: max abs diff {diff:.3e} > {TOL}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["1d", "2d", "3d"])
def test_fp32_gradient_within_relative_tolerance(results: list[dict[str, object]], kind: str) -> None:
    plans = scenarios.plans_1d() if kind == "1d" else scenarios.plans_2d()
    model = build_model(kind, dtype=torch.float32)
    reference_backward(model, plans[0], kind)
    reference = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
    scale = max(float(g.abs().max()) for g in reference)
    for r, res in enumerate(results):
        diff = _max_diff(res[f"grad32_{kind}"], reference)  # type: ignore[arg-type]
        assert diff <= 1e-5 * scale, f"rank {r}: fp32 max abs diff {diff:.3e} > 1e-5 * {scale:.3e}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["1d", "2d", "3d"])
def test_optimizer_steps_match_single_process(results: list[dict[str, object]], kind: str) -> None:
    plans = scenarios.plans_1d() if kind == "1d" else scenarios.plans_2d()
    model = build_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = [p.detach().clone() for p in model.parameters()]
    for plan in plans * 2:
        opt.zero_grad(set_to_none=True)
        reference_backward(model, plan, kind)
        opt.step()
    final = [p.detach().clone() for p in model.parameters()]
    assert _max_diff(final, start) > 1e-3  # training moved the parameters
    for r, res in enumerate(results):
        diff = _max_diff(res[f"params_{kind}"], final)  # type: ignore[arg-type]
        assert diff <= 1e-9, f"rank {r}: parameters differ by {diff:.3e}"


@pytest.mark.timeout(240)
def test_digest_mismatch_raises_on_every_rank(results: list[dict[str, object]]) -> None:
    for r, res in enumerate(results):
        message = res["mismatch"]
        assert isinstance(message, str), f"rank {r} did not detect the mismatch"
        assert "before step 0" in message
        assert "rank 2" in message and "digest differs" in message


@pytest.mark.timeout(240)
def test_wrong_step_raises_on_every_rank(results: list[dict[str, object]]) -> None:
    for r, res in enumerate(results):
        message = res["wrong_step"]
        assert isinstance(message, str), f"rank {r} accepted a plan for another step"
        assert "before step 5" in message and "step 0" in message
