"""DDP and FSDP2 under DCP plans on 4 gloo ranks equal the plain large-batch steps (fp64).

The world-4 runs are those of ``sync_scenarios.run`` inside ``scenarios.worker`` (one spawn per
session): the 1D and 2D plans (uneven micro-batch counts, an idle rank, mixed policies in a
last micro-batch) run one after another with AdamW between them, under
``DistributedDataParallel`` (no sync but in the last micro-batch, SUM hook) and under FSDP2
(``fully_shard`` per layer and root, one all-gather and one SUM reduce-scatter per step).
"""

from __future__ import annotations

import functools

import pytest
import torch

from executor.grad_sync import DDPSync, FSDP2Sync
from tests.executor import scenarios
from tests.executor.helpers import build_model, reference_backward
from tests.executor.sync_scenarios import idle_item

MODES = ["ddp", "fsdp2"]


@functools.cache
def _trajectory(kind: str) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Single process: gradients of each plan in turn with AdamW between, final parameters."""
    plans = scenarios.plans_1d() if kind == "1d" else scenarios.plans_2d()
    model = build_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = []
    for plan in plans:
        opt.zero_grad(set_to_none=True)
        reference_backward(model, plan, kind)
        grads.append([p.grad.detach().clone() for p in model.parameters()])  # type: ignore[union-attr]
        opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def _rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    assert len(got) == len(want)
    return max(float((g - w).abs().max()) / max(float(w.abs().max()), 1e-300)
               for g, w in zip(got, want, strict=True))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["1d", "2d"])
@pytest.mark.parametrize("mode", MODES)
def test_gradients_and_steps_equal_the_large_batch_step(world4_results: list[dict[str, object]],
                                                         mode: str, kind: str) -> None:
    grads, params = _trajectory(kind)
    for r, res in enumerate(world4_results):
        for i, want in enumerate(grads):
            rel = _rel(res[f"{mode}_grad_{kind}_{i}"], want)  # type: ignore[arg-type]
            assert rel <= 1e-10, f"{mode} rank {r} plan {i}: relative gradient diff {rel:.2e}"
        rel = _rel(res[f"{mode}_params_{kind}"], params)  # type: ignore[arg-type]
        assert rel <= 1e-9, f"{mode} rank {r}: parameters after AdamW differ by {rel:.2e}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_fsdp2_shards_the_optimizer_states(world4_results: list[dict[str, object]], kind: str) -> None:
    replicated = [int(res[f"ddp_state_bytes_{kind}"]) for res in world4_results]  # type: ignore[call-overload]
    sharded = [int(res[f"fsdp2_state_bytes_{kind}"]) for res in world4_results]  # type: ignore[call-overload]
    assert len(set(replicated)) == 1 and replicated[0] > 0
    # Every rank holds about a quarter (FSDP2 pads each parameter's dim 0 to a multiple of 4).
    assert sum(sharded) >= replicated[0]
    assert max(sharded) <= 0.4 * replicated[0], (sharded, replicated[0])


def test_sync_modes_refuse_the_wrong_model_or_idle_item() -> None:
    model = build_model("1d")
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        DDPSync(model, idle_item=idle_item("1d"))
    with pytest.raises(ValueError, match="fully_shard"):
        FSDP2Sync(model, idle_item=idle_item("1d"))
    with pytest.raises(ValueError, match="idle_item"):
        from executor.grad_sync import _check_idle_item

        _check_idle_item({"inputs": torch.zeros(0, dtype=torch.long), "targets": torch.zeros(1)})
