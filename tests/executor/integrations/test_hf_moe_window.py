"""DCP on the mixture-of-experts and windowed-attention ``transformers`` classes: a planned step on
4 gloo ranks equals the plain model (fp64).

The models are ``transformers``' own ``Qwen3MoeForCausalLM``, ``GptOssForCausalLM`` (sliding and
full layers, sinks), ``Gemma3ForCausalLM`` (local and global layers), ``MistralForCausalLM`` with
``sliding_window`` and ``MixtralForCausalLM`` (``hf_moe_models.py``: small random configurations, 8
query heads over 2 key/value heads, windows of 4 tokens), run under Ulysses plans of 1, 2 and 4
ranks (the 4-groups past the key/value heads), Ulysses x ring plans (1 x 2, 2 x 2, 1 x 4: every
layer round the ring, with the ring's window and sinks), and, for
Qwen3-MoE and gpt-oss, under FSDP2 with the experts sharded over the ranks, and for gpt-oss and
Gemma 3 with the loss in chunks; packed micro-batches
of samples longer and shorter than the window, mixed per-sample checkpoint policies, token and
sample normalisation (``hf_moe_worker.py``, one spawn for all of it). Reference: the plain model
in one process on the whole padded batch, the plan's normaliser from its logits; the summed loss
shares and every gradient within 1e-10 relative (Gemma 3's fp32 norm weights 1e-6,
``hf_moe_models.tolerance``).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest
import torch

from dcp_cli.net import free_port
from planner.plan import Plan
from tests.executor import scenarios
from tests.executor.helpers import load_rank_results

pytest.importorskip("transformers")

from tests.executor.integrations import hf_llama, hf_moe_models, hf_moe_worker
from tests.executor.worlds import spawn_world

RING_NAMES = list(hf_moe_worker.ring_plans())



@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    out = Path(tmp_path_factory.mktemp("hf-moe-world4"))
    start = time.perf_counter()
    spawn_world(hf_moe_worker.worker, args=(free_port(), str(out)), nprocs=hf_moe_worker.WORLD)
    loaded = load_rank_results(out, hf_moe_worker.WORLD)
    print(f"MoE and windowed integrations: {time.perf_counter() - start:.1f} s in the ranks")
    return loaded


@functools.lru_cache(maxsize=64)
def _reference(name: str, plan_json: str) -> tuple[float, dict[str, torch.Tensor]]:
    model = hf_moe_models.build(name, hf_moe_models.reference_attention(name), dtype=torch.float64)
    loss = hf_llama.reference_backward(model, Plan.model_validate_json(plan_json), own_loss=False)
    return loss, hf_llama.grads(model)


def _check(world4: list[dict[str, object]], name: str, plan: Plan, key: str) -> None:
    loss, reference = _reference(name, plan.model_dump_json())
    shares = [float(res[key.replace("*", "loss")]) for res in world4]  # type: ignore[arg-type]
    assert sum(shares) == pytest.approx(loss, rel=hf_moe_models.EXACT)
    for r, res in enumerate(world4):
        got = res[key.replace("*", "grad")]
        assert isinstance(got, dict) and set(got) == set(reference)
        for param, want in reference.items():
            scale = float(want.abs().max())
            assert scale > 0.0, f"{name}: {param} has a zero reference gradient"
            rel = float((got[param] - want).abs().max()) / scale
            assert rel <= hf_moe_models.tolerance(name, param), f"rank {r}, {key}: {param} relative diff {rel:.2e}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize("name", hf_moe_models.NAMES)
def test_ulysses_steps_equal_the_plain_model(world4: list[dict[str, object]], name: str, index: int) -> None:
    _check(world4, name, scenarios.plans_1d()[index], f"{name}_ulysses_*_{index}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", hf_moe_worker.CHUNKED_MODELS)
def test_chunked_loss_steps_equal_the_plain_model(world4: list[dict[str, object]], name: str) -> None:
    _check(world4, name, scenarios.plans_1d()[1], f"{name}_chunked_*_1")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", RING_NAMES)
@pytest.mark.parametrize("name", hf_moe_models.NAMES)
def test_ring_steps_equal_the_plain_model(world4: list[dict[str, object]], name: str, layout: str) -> None:
    _check(world4, name, hf_moe_worker.ring_plans()[layout], f"{name}_ring_*_{layout}")
    attends = [int(res[f"{name}_ring_attends_{layout}"]) for res in world4]  # type: ignore[call-overload]
    # every layer goes round the ring (windowed ones on the window-aware ring, sinks on its output)
    assert min(attends[r] for r in range(4) if layout != "1x2+ulysses2" or r < 2) > 0, attends


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("name", hf_moe_worker.FSDP2_MODELS)
def test_fsdp2_steps_with_sharded_experts_equal_the_plain_model(world4: list[dict[str, object]], name: str,
                                                                index: int) -> None:
    assert [res[f"{name}_fsdp2_expert_rows"] for res in world4] == [1] * 4  # 4 experts over 4 ranks
    _check(world4, name, scenarios.plans_1d()[index], f"{name}_fsdp2_*_{index}")


def test_the_windows_mask_the_scenario_samples() -> None:
    """Most scenario samples are longer than the window (a window no sample outgrows masks nothing)."""
    lengths = [ps.sample.tokens for plan in [*scenarios.plans_1d(), *hf_moe_worker.ring_plans().values()]
               for g in plan.groups for mb in g.micro_batches for ps in mb.samples]
    assert sum(t > hf_moe_models.WINDOW for t in lengths) > len(lengths) // 2, lengths
