"""Ring and Ulysses x ring layouts through the Hugging Face integrations equal the plain models (fp64).

One spawn of 4 gloo ranks (``hf_ring_worker.py``):

- ``transformers``' ``LlamaForCausalLM`` (8 query heads over 2 key/value heads) through the attention
  plug-in under 1 x 2 beside a Ulysses pair, 2 x 2 and 1 x 4 (the executor's ring scenarios: packed
  samples of different lengths, mixed checkpoint policies, token and sample normalisation), and under
  every step of a ``layout="ring"`` epoch of a real ``dcp serve``, its process groups built from the
  epoch's declared layouts. Reference: the plain model in one process on the whole padded batch
  (``sdpa``), the plan's normaliser from its logits: loss and every gradient <= 1e-10 relative.
- diffusers' ``WanTransformer3DModel`` under 1 x 2, 2 x 2 and 1 x 4 over each clip's self-attention
  (cross-attention to the text stays local). Reference: the plain model on each whole clip; the
  bounds of ``test_hf_wan.py`` (1e-10, and 1e-6 for the parameters Wan reduces in fp32).
- Latte refuses a ring micro-batch by name.

A ring cuts every sample into ``2 r`` zig-zag chunks, so a rank's tokens, their RoPE positions,
labels and loss weights are not a contiguous piece: a position, label or weight taken from the
Ulysses piece instead would fail the comparison.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.presets import load_cluster
from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec, ModelSpec, Sample
from dcp_cli.net import free_port
from executor.client import PlannerClient
from tests.executor.helpers import CONFIG, load_rank_results
from tests.executor.service import OPTIONS, Service, running_service, start_epoch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from tests.executor.integrations import hf_llama, hf_ring_worker, hf_wan_model
from tests.executor.worlds import spawn_world

EPOCH = "hf-rings"
TOL = 1e-10


def _cluster_and_cost_model(tokens_per_rank: int = 16) -> tuple[ClusterSpec, CostModelFile]:
    """The test Llama's cost model on a 4-rank node whose memory holds about ``tokens_per_rank``
    tokens per rank (so the long samples need groups, here rings)."""
    config = hf_llama.llama_config(kv_heads=hf_ring_worker.KV_HEADS)
    spec = ModelSpec(name="hf-llama-gqa-test", kind="1d", num_layers=config.num_hidden_layers,
                     hidden=config.hidden_size, num_heads=config.num_attention_heads,
                     num_kv_heads=config.num_key_value_heads, ffn_hidden=config.intermediate_size,
                     vocab=CONFIG.vocab)
    cluster = load_cluster("h200x8").model_copy(update={"name": "cpu4", "num_gpus": 4, "gpus_per_node": 4})
    model = CostModel(file=analytic_cost_model(spec, cluster.hardware), cluster=cluster)
    need = model.fixed_bytes() + float(model.activation_bytes(tokens_per_rank, group_size=1))
    hardware = cluster.hardware.model_copy(update={"name": "h200-tight",
                                                   "hbm_bytes": need / cluster.memory_cap_fraction})
    cluster = cluster.model_copy(update={"hardware": hardware, "name": "cpu4-tight"})
    return cluster, analytic_cost_model(spec, hardware)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, dict[str, object]]]:
    with running_service(tmp_path_factory.mktemp("hf-rings-serve")) as svc:
        cluster, cost_model = _cluster_and_cost_model()
        samples = [Sample(id=f"t{i}", tokens=4 + (i * 37) % 48) for i in range(12)]
        status = start_epoch(svc.url, epoch_id=EPOCH, samples=samples, samples_per_step=4, seed=1,
                             cluster=cluster, cost_model=cost_model, options={**OPTIONS, "layout": "ring"})
        yield svc, status


@pytest.fixture(scope="module")
def world4(served: tuple[Service, dict[str, object]], tmp_path_factory: pytest.TempPathFactory
           ) -> list[dict[str, object]]:
    out = Path(tmp_path_factory.mktemp("hf-rings-world4"))
    start = time.perf_counter()
    spawn_world(hf_ring_worker.worker, args=(free_port(), served[0].url, EPOCH, str(out)),
                nprocs=hf_ring_worker.WORLD)
    loaded = load_rank_results(out, hf_ring_worker.WORLD)
    print(f"ring integrations: {time.perf_counter() - start:.1f} s in the ranks")
    return loaded


def _check_llama(world4: list[dict[str, object]], plan: object, key: str) -> None:
    model = hf_llama.build("sdpa", dtype=torch.float64, kv_heads=hf_ring_worker.KV_HEADS)
    loss = hf_llama.reference_backward(model, plan, own_loss=False)  # type: ignore[arg-type]
    reference = hf_llama.grads(model)
    shares = [float(res[f"{key.replace('*', 'loss')}"]) for res in world4]  # type: ignore[arg-type]
    assert sum(shares) == pytest.approx(loss, rel=TOL)
    for r, res in enumerate(world4):
        got = res[key.replace("*", "grad")]
        assert isinstance(got, dict)
        for name, want in reference.items():
            scale = float(want.abs().max())
            assert scale > 0.0, f"{name}: zero reference gradient"
            rel = float((got[name] - want).abs().max()) / scale
            assert rel <= TOL, f"rank {r}, {key}: {name} relative diff {rel:.2e}"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["1x2+ulysses2", "2x2", "1x4"])
def test_llama_ring_layouts_equal_the_plain_model(world4: list[dict[str, object]], name: str) -> None:
    plan = hf_ring_worker.llama_plans()[name]
    layouts = {(g.ulysses_degree, g.ring_degree) for g in plan.groups if g.ring_degree > 1}
    assert layouts and layouts <= set(hf_ring_worker.LAYOUTS), layouts
    _check_llama(world4, plan, f"llama_*_{name}")


@pytest.mark.timeout(400)
def test_llama_under_a_served_ring_epoch_equals_the_plain_model(
        served: tuple[Service, dict[str, object]], world4: list[dict[str, object]]) -> None:
    svc, status = served
    # layout=ring: every size of 2 or more is a pure ring; Ulysses splits no heads but the size 1's
    assert status["layouts"] == [[1, 1, 1], [2, 1, 2], [4, 1, 4]], status["layouts"]
    assert {(res["served_sizes"], res["served_ulysses_degrees"]) for res in world4} == {((1, 2, 4), (1,))}
    num_steps = int(status["steps_total"])  # type: ignore[call-overload]
    with PlannerClient(svc.url) as client:
        plans = [client.step_plan(EPOCH, step)[0] for step in range(num_steps)]
    rings = sorted({(g.ulysses_degree, g.ring_degree) for p in plans for g in p.groups if g.ring_degree > 1})
    assert rings, [[(g.size, g.ring_degree) for g in p.groups] for p in plans]
    for step, plan in enumerate(plans):
        _check_llama(world4, plan, f"served_*_{step}")
    print(f"{num_steps} served steps, ring layouts (u, r) {rings}")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("index", [0, 1, 2])
def test_wan_ring_layouts_equal_the_plain_model(world4: list[dict[str, object]], index: int) -> None:
    hf_wan_model.assert_world_equals_plain(world4, hf_wan_model.ring_plans()[index], index, tol=TOL)


def test_the_wan_ring_plans_cover_the_layouts() -> None:
    """Each hand-made Wan plan has a ring group, together 1 x 2, 2 x 2 and 1 x 4, each with packed clips
    of different lengths and mixed policies."""
    seen = set()
    for plan in hf_wan_model.ring_plans():
        for group in plan.groups:
            if group.ring_degree == 1:
                continue
            seen.add((group.ulysses_degree, group.ring_degree))
            assert len({s.recompute_layers for mb in group.micro_batches for s in mb.samples}) >= 2
            assert any(len({s.sample.tokens for s in mb.samples}) >= 2 for mb in group.micro_batches)
    assert seen == set(hf_ring_worker.LAYOUTS)


@pytest.mark.timeout(400)
def test_latte_refuses_a_ring_micro_batch(world4: list[dict[str, object]]) -> None:
    for res in world4:
        assert "a Ulysses x ring group (ring_degree=2) cannot run Latte's spatial and temporal attention" in str(
            res["latte_error"])
