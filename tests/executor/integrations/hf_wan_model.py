"""The diffusers Wan of the integration tests: config, plans, data, reference step, rank step.

A small random-initialised ``WanTransformer3DModel`` (4 heads of 8, 2 blocks, patch 1x2x2, text of
3 tokens of 16 channels), built in the test, no download. The reference runs the plain model
(diffusers' own processors and forward) on each whole clip in one process and sums the squared
errors with the plan's normaliser.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from executor.runtime import Executor
from planner.plan import Plan
from tests.executor.helpers import make_plan, s2d
from tests.executor.integrations import video_steps

PATCH = (1, 2, 2)
CHANNELS = 4
NUM_LAYERS = 2
TEXT_TOKENS, TEXT_DIM = 3, 16


def build(*, dtype: torch.dtype = torch.float64, seed: int = 0) -> Any:
    """The small Wan, deterministically initialised (same on every rank)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(patch_size=PATCH, num_attention_heads=4, attention_head_dim=8,
                                  in_channels=CHANNELS, out_channels=CHANNELS, text_dim=TEXT_DIM, freq_dim=16,
                                  ffn_dim=48, num_layers=NUM_LAYERS, rope_max_seq_len=32)
    with torch.no_grad():  # the output projections start at zero in some configs: give them weight
        for p in model.parameters():
            if p.dim() > 1 and float(p.abs().max()) == 0.0:
                p.normal_(0.0, 0.02)
    return model.to(dtype)


def plans() -> list[Plan]:
    """Groups 2+1+1 (an idle rank) then 4 (a clip and a micro-batch shorter than the group), mixed
    policies, token then sample normalisation."""
    a = make_plan([
        ([0, 1], [[(s2d("A", 3, 1, 3), 0), (s2d("B", 1, 2, 2), 2)], [(s2d("C", 2, 2, 1), 1)]]),
        ([2], [[(s2d("D", 1, 1, 3), 2), (s2d("E", 3, 1, 1), 0)]]),
        ([3], []),
    ], num_ranks=4, step=0)
    b = make_plan([
        ([0, 1, 2, 3], [[(s2d("F", 3, 1, 5), 1), (s2d("G", 1, 1, 3), 2)], [(s2d("H", 2, 1, 1), 0)]]),
    ], num_ranks=4, step=1, normalizer="samples")
    return [a, b]


def ring_plans() -> list[Plan]:
    """Ulysses x ring groups (:mod:`executor.ring`, ``full_3d``): a pure ring of 2 beside a Ulysses
    pair (an idle-free world), a 2 x 2 hybrid, a pure ring of 4; clips of different shapes packed in
    one micro-batch (each at least the ring's ``2 r`` chunks), mixed policies (none, selective, full),
    token and sample normalisation."""
    from tests.executor.test_ring_step import _with_rings

    a = _with_rings(make_plan([
        ([0, 1], [[(s2d("RA", 3, 1, 3), 0), (s2d("RB", 1, 2, 2), 2)], [(s2d("RC", 2, 2, 1), 1)]]),
        ([2, 3], [[(s2d("RD", 1, 1, 3), 2), (s2d("RE", 3, 1, 1), 0)]]),
    ], num_ranks=4, step=0), [2, 1])
    b = _with_rings(make_plan([
        ([0, 1, 2, 3], [[(s2d("RF", 3, 1, 5), 1), (s2d("RG", 1, 2, 2), 2)], [(s2d("RH", 2, 2, 2), 0)]]),
    ], num_ranks=4, step=1, normalizer="samples"), [2])
    c = _with_rings(make_plan([
        ([0, 1, 2, 3], [[(s2d("RI", 2, 2, 3), 0), (s2d("RJ", 1, 2, 4), 2), (s2d("RK", 4, 1, 2), 1)]]),
    ], num_ranks=4, step=2), [4])
    return [a, b, c]


def data(sample_id: str, frames: int, height: int, width: int) -> dict[str, torch.Tensor]:
    """Deterministic latent video, target, timestep and text states of one sample (fp64)."""
    seed = int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:7], "little")
    gen = torch.Generator().manual_seed(seed)
    shape = (CHANNELS, frames * PATCH[0], height * PATCH[1], width * PATCH[2])
    return {"video": torch.randn(shape, generator=gen, dtype=torch.float64),
            "target": torch.randn(shape, generator=gen, dtype=torch.float64),
            "timestep": torch.randint(1000, (1,), generator=gen),
            "text": torch.randn(TEXT_TOKENS, TEXT_DIM, generator=gen, dtype=torch.float64)}


def reference_backward(model: Any, plan: Plan) -> float:
    """The plain model on each whole clip, the plan's normaliser by hand; gradients into ``model``."""
    return video_steps.reference_backward(
        model, plan, data=lambda s: data(s.id, s.num_frames, s.height, s.width), text_key="text",
        values=PATCH[0] * PATCH[1] * PATCH[2] * CHANNELS)


def run_step(executor: Executor, model: Any, plan: Plan) -> float:
    """One planned step of the DCP model on this rank (the lines a user's loop has); its loss share."""
    from executor.integrations import hf_wan

    def load(sample: Any) -> dict[str, object]:
        d = data(sample.id, sample.num_frames, sample.height, sample.width)
        patches = hf_wan.patchify(d["target"], PATCH)
        return {"id": sample.id, "inputs": patches, "targets": patches, **d}

    def forward(work: Any, items: list[dict[str, Any]]) -> torch.Tensor:
        return hf_wan.forward(model, work, videos=[it["video"] for it in items],
                             timesteps=torch.cat([it["timestep"] for it in items]),
                             texts=torch.stack([it["text"] for it in items]))

    return video_steps.run_step(executor, model, plan, load=load, forward=forward,
                                token_losses=hf_wan.token_losses)


def fp32_bound(model: torch.nn.Module) -> set[str]:
    """Parameters whose gradient Wan rounds or reduces in fp32: the modules it keeps in fp32
    (``_keep_in_fp32_modules``: time embedder, norms, modulation table) and ``time_proj``, whose
    output every block casts with ``temb.float()``."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ()) | {"time_proj"}
    return {name for name, _ in model.named_parameters() if keep & set(name.split("."))}


def assert_world_equals_plain(world: list[dict[str, object]], plan: Plan, index: int, *, tol: float) -> None:
    """Every rank's ``wan_loss_{index}`` / ``wan_grad_{index}`` against the plain model on ``plan``:
    loss shares sum to the plain loss within ``tol``; every gradient within ``tol`` relative, but
    :func:`fp32_bound` ones within 1e-6 (fp32 rounding); most parameters checked to ``tol``."""
    from tests.executor.integrations import hf_llama

    model = build()
    loss = reference_backward(model, plan)
    checked = video_steps.assert_world_equals_reference(world, "wan", index, loss=loss, reference=hf_llama.grads(model),
                                                        tol=tol, loose=fp32_bound(model), loose_tol=1e-6)
    assert checked > 4 * 30  # most parameters are checked to fp64 precision
