"""The Hugging Face Trainer under DCP plans equals the Trainer's own data-parallel run.

One torchrun of 4 gloo ranks (``hf_trainer_worker.py``) against a real ``dcp serve``: the plain
``Trainer`` (DDP) on the plans' global batches, :class:`DCPTrainer` with the service's plans
(checkpoints at steps 2 and 4), the same resumed from ``checkpoint-2`` into a differently
initialised model, :class:`DCPTrainer` with plans made locally, TRL's ``SFTTrainer`` and its DCP
twin (resumed from its ``checkpoint-2`` too), :class:`DCPTrainer` on a served ``layout="ring"``
epoch, and the CPU part of the torchtitan integration. fp64: losses and parameters after 3-4
optimizer steps (AdamW, linear schedule, gradient clipping) within 1e-8 relative.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from dcp_cli.net import free_port
from tests.executor import scenarios
from tests.executor.service import Service

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
EPOCH = "hf-trainer-equivalence"
TOLERANCE = 1e-8


@pytest.fixture(scope="module")
def world4(service: Service, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("hf_trainer_world4")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(HERE / "hf_trainer_worker.py"), service.url, EPOCH, str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    loaded = [torch.load(out / f"rank{r}.pt") for r in range(4) if (out / f"rank{r}.pt").exists()]
    errors = [res["error"] for res in loaded if "error" in res]
    assert done.returncode == 0 and len(loaded) == 4 and not errors, (
        (errors[0] if errors else "") + done.stdout[-2000:] + done.stderr[-4000:])
    return loaded


def _step_losses(world4: list[dict[str, Any]], run: str) -> list[float]:
    """The step losses of a DCP run: the ranks' shares summed."""
    steps = [h["step"] for h in world4[0][run]["history"]]
    return [sum(res[run]["history"][i]["loss_share"] for res in world4) for i in range(len(steps))]


def _worst_relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    worst, where = 0.0, ""
    for name, ref in want.items():
        rel = float((got[name] - ref).abs().max()) / float(ref.abs().max())
        if rel > worst:
            worst, where = rel, name
    return worst, where


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plans_use_sequence_parallel_groups(world4: list[dict[str, Any]]) -> None:
    sizes = world4[0]["group_sizes"]
    assert any(max(s) > 1 for s in sizes), sizes  # otherwise Ulysses is not exercised
    assert any(len(s) > 1 for s in sizes), sizes  # and several groups in one step


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dcp_trainer_equals_the_trainers_data_parallel_run(world4: list[dict[str, Any]]) -> None:
    world = len(world4)
    plain = [sum(res["plain"]["losses"][s] for res in world4) / world for s in range(4)]
    dcp = _step_losses(world4, "dcp")
    assert [h["step"] for h in world4[0]["dcp"]["history"]] == [0, 1, 2, 3]
    for s in range(4):
        assert abs(dcp[s] - plain[s]) <= TOLERANCE * abs(plain[s]), (s, dcp[s], plain[s])
    assert dcp[3] < dcp[0]  # it trains
    worst, where = _worst_relative(world4[0]["dcp"]["params"], world4[0]["plain"]["params"])
    assert worst <= TOLERANCE, f"{where}: relative difference {worst:.2e}"
    # the Trainer's own logging reports the step loss (its fp32 mean over the processes)
    assert world4[0]["dcp"]["logged"] == pytest.approx(plain, rel=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_evaluation_equals_the_plain_trainers(world4: list[dict[str, Any]]) -> None:
    """eval_strategy='steps' (steps 2 and 4) and evaluate() after training: DCPTrainer's eval loss is
    the plain Trainer's on the same eval set (each rank its shard, plain attention, gathered)."""
    plain, dcp = world4[0]["plain"]["evals"], world4[0]["dcp"]["evals"]
    assert [step for step, _ in dcp["during"]] == [step for step, _ in plain["during"]] == [2, 4]
    for (_, got), (_, want) in zip(dcp["during"], plain["during"], strict=True):
        assert abs(got - want) <= TOLERANCE * abs(want), (dcp["during"], plain["during"])
    got, want = dcp["final"]["eval_loss"], plain["final"]["eval_loss"]
    assert abs(got - want) <= TOLERANCE * abs(want), (got, want)
    assert dcp["during"][1][1] < dcp["during"][0][1]  # evaluated on the trained parameters
    assert dcp["final"]["eval_loss"] == pytest.approx(dcp["during"][1][1], rel=1e-12)  # same parameters
    for res in world4[1:]:  # every rank reports the gathered metrics
        assert res["dcp"]["evals"]["final"]["eval_loss"] == got
    # after each evaluation the model is DCP's again: Ulysses attention, per-sample policies on every layer
    state = world4[0]["dcp"]["after_eval"]
    assert state == {"attention": "dcp_ulysses", "policy_layers": state["layers"], "layers": 3}, state


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dcp_trainer_under_fsdp2_equals_the_trainers_runs(world4: list[dict[str, Any]]) -> None:
    """The model sharded by FSDP2 at load (DistributedConfig): DCPTrainer syncs with FSDP2Sync and ends
    at the plain Trainer's parameters (FSDP2 and DDP alike) after 4 steps."""
    fsdp2 = world4[0]["fsdp2"]
    assert all(res["fsdp2"]["sync"] == "FSDP2Sync" for res in world4)
    assert [h["step"] for h in fsdp2["history"]] == [0, 1, 2, 3]
    world = len(world4)
    plain = [sum(res["plain"]["losses"][s] for res in world4) / world for s in range(4)]
    dcp = _step_losses(world4, "fsdp2")
    for s in range(4):
        assert abs(dcp[s] - plain[s]) <= TOLERANCE * abs(plain[s]), (s, dcp[s], plain[s])
    for got in (fsdp2["params"], fsdp2["plain_params"]):
        worst, where = _worst_relative(got, world4[0]["plain"]["params"])
        assert worst <= TOLERANCE, f"{where}: relative difference {worst:.2e}"
    assert fsdp2["logged"] == pytest.approx(fsdp2["plain_logged"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_from_a_checkpoint_runs_the_same_steps_plans(world4: list[dict[str, Any]]) -> None:
    for res in world4:
        full = {h["step"]: h["plan_digest"] for h in res["dcp"]["history"]}
        resumed = {h["step"]: h["plan_digest"] for h in res["resumed"]["history"]}
        assert sorted(resumed) == [2, 3]
        assert all(resumed[s] == full[s] for s in resumed)
    assert world4[0]["resumed"]["global_step"] == 4
    full_losses, resumed_losses = _step_losses(world4, "dcp")[2:], _step_losses(world4, "resumed")
    assert resumed_losses == pytest.approx(full_losses, rel=TOLERANCE)
    worst, where = _worst_relative(world4[0]["resumed"]["params"], world4[0]["plain"]["params"])
    assert worst <= TOLERANCE, f"{where}: relative difference {worst:.2e}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_plans_are_the_services_and_train_alike(world4: list[dict[str, Any]]) -> None:
    local = [h["plan_digest"] for h in world4[0]["local"]["history"]]
    assert local == world4[0]["service_digests"]
    worst, where = _worst_relative(world4[0]["local"]["params"], world4[0]["plain"]["params"])
    assert worst <= TOLERANCE, f"{where}: relative difference {worst:.2e}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_measurements_reach_the_service(world4: list[dict[str, Any]], service: Service) -> None:
    report = httpx.get(f"{service.url}/v1/epochs/{EPOCH}/recalibration", timeout=10).json()
    assert report["measured_steps"] == 4, report


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dcp_sft_trainer_equals_trls_padding_free_run(world4: list[dict[str, Any]]) -> None:
    sft = world4[0]["sft"]
    if sft is None:
        pytest.skip("trl is not installed (extra [trl])")
    assert [h["step"] for h in sft["history"]] == [0, 1, 2]
    worst, where = _worst_relative(sft["params"], sft["plain_params"])
    assert worst <= TOLERANCE, f"{where}: relative difference {worst:.2e}"
    assert sft["logged"] == pytest.approx(sft["plain_logged"], rel=1e-6)
    world = len(world4)
    plain = [sum(res["sft"]["plain_losses"][s] for res in world4) / world for s in range(3)]
    dcp = _step_losses(world4, "sft")
    for s in range(3):
        assert abs(dcp[s] - plain[s]) <= TOLERANCE * abs(plain[s]), (s, dcp[s], plain[s])
    # completion-only labels: a loss of its own (the Trainer's runs train on every token)
    assert abs(dcp[0] - _step_losses(world4, "dcp")[0]) > 1e-6 * dcp[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dcp_sft_trainer_resumes_the_same_steps_plans(world4: list[dict[str, Any]]) -> None:
    """DCPSFTTrainer resumed from its checkpoint-2 into a differently initialised model runs step 2's
    plan again and ends at TRL's padding-free parameters."""
    if world4[0]["sft"] is None:
        pytest.skip("trl is not installed (extra [trl])")
    for res in world4:
        full = {h["step"]: h["plan_digest"] for h in res["sft"]["history"]}
        resumed = {h["step"]: h["plan_digest"] for h in res["sft"]["resumed_history"]}
        assert sorted(resumed) == [2] and resumed[2] == full[2], (full, resumed)
    last = [h["loss_share"] for res in world4 for h in res["sft"]["history"] if h["step"] == 2]
    again = [h["loss_share"] for res in world4 for h in res["sft"]["resumed_history"]]
    assert sum(again) == pytest.approx(sum(last), rel=TOLERANCE)
    worst, where = _worst_relative(world4[0]["sft"]["resumed_params"], world4[0]["sft"]["plain_params"])
    assert worst <= TOLERANCE, f"{where}: relative difference {worst:.2e}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dcp_trainer_under_a_served_ring_epoch_equals_the_trainers_run(world4: list[dict[str, Any]]) -> None:
    """A ``layout="ring"`` epoch: DCPTrainer builds its groups from the declared layouts and runs the
    ring groups through the attention plug-in; losses and parameters are the plain Trainer's after 3 steps."""
    ring = world4[0]["ring"]
    assert ring["layouts"] and all(u == 1 for _, u, _ in ring["layouts"]), ring["layouts"]
    rings = {(d, u, r) for step in ring["plan_layouts"] for d, u, r in step if r > 1}
    assert rings, ring["plan_layouts"]  # otherwise no ring runs
    assert [h["step"] for h in ring["history"]] == [0, 1, 2]
    world = len(world4)
    plain = [sum(res["ring"]["plain_losses"][s] for res in world4) / world for s in range(3)]
    dcp = _step_losses(world4, "ring")
    for s in range(3):
        assert abs(dcp[s] - plain[s]) <= TOLERANCE * abs(plain[s]), (s, dcp[s], plain[s])
    worst, where = _worst_relative(ring["params"], ring["plain_params"])
    assert worst <= TOLERANCE, f"{where}: relative difference {worst:.2e}"
    print(f"ring epoch: layouts {sorted(rings)}, parameters within {worst:.1e}, {ring['time_s']:.1f} s in rank 0")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", [0, 1, 2])
def test_torchtitan_inner_attention_step_equals_the_plain_decoder(world4: list[dict[str, Any]],
                                                                  index: int) -> None:
    """The CPU part of the torchtitan integration: torchtitan's calling convention
    (``titan_standin``), Ulysses through ``inner_attention``, policies on the decoder layers."""
    from tests.executor.integrations import titan_standin

    loss, reference = titan_standin.reference_grads(scenarios.plans_1d()[index])
    assert world4[0]["titan"]["swapped"] == titan_standin.LAYERS
    assert sum(res["titan"][f"loss_{index}"] for res in world4) == pytest.approx(loss, rel=1e-12)
    for r, res in enumerate(world4):
        worst, where = _worst_relative(res["titan"][f"grad_{index}"], reference)
        assert worst <= 1e-10, f"rank {r}: {where} relative difference {worst:.2e}"
