"""The diffusers Latte of the integration tests: config, plans, data, reference step, rank step.

A small random-initialised ``LatteTransformer3DModel`` (4 heads, 2 spatial + temporal layer
pairs, patch 2, captions of 3 tokens, ``video_length=3``: Latte takes 1 or 3 frames), built in
the test, no download. The reference runs the plain model (diffusers' own processors) on each
whole video in one process and sums the squared errors with the plan's normaliser.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from executor.runtime import Executor
from planner.plan import Plan
from tests.executor.helpers import make_plan, s2d
from tests.executor.integrations import video_steps

PATCH = 2
CHANNELS = 4
NUM_LAYERS = 2


def build(*, dtype: torch.dtype = torch.float64, seed: int = 0) -> Any:
    """The small Latte, deterministically initialised (same on every rank)."""
    from diffusers import LatteTransformer3DModel

    torch.manual_seed(seed)
    model = LatteTransformer3DModel(
        num_attention_heads=4, attention_head_dim=8, in_channels=CHANNELS, out_channels=CHANNELS,
        num_layers=NUM_LAYERS, sample_size=8, patch_size=PATCH, caption_channels=16, cross_attention_dim=32,
        norm_type="ada_norm_single", video_length=3, activation_fn="gelu-approximate", num_embeds_ada_norm=1000)
    return model.to(dtype)  # type: ignore[attr-defined]


def plans() -> list[Plan]:
    """Groups 2+1+1 (an idle rank) then 4 (a sample and a micro-batch shorter than the group)."""
    a = make_plan([
        ([0, 1], [[(s2d("A", 3, 1, 3), 0), (s2d("B", 1, 2, 2), 2)], [(s2d("C", 3, 2, 1), 1)]]),
        ([2], [[(s2d("D", 1, 1, 3), 2), (s2d("E", 3, 1, 1), 0)]]),
        ([3], []),
    ], num_ranks=4, step=0)
    b = make_plan([
        ([0, 1, 2, 3], [[(s2d("F", 3, 1, 5), 1), (s2d("G", 1, 1, 3), 2)], [(s2d("H", 3, 1, 1), 0)]]),
    ], num_ranks=4, step=1, normalizer="samples")
    return [a, b]


def data(sample_id: str, frames: int, height: int, width: int) -> dict[str, torch.Tensor]:
    """Deterministic video, target, timestep and caption of one sample (fp64)."""
    seed = int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:7], "little")
    gen = torch.Generator().manual_seed(seed)
    shape = (CHANNELS, frames, height * PATCH, width * PATCH)
    return {"video": torch.randn(shape, generator=gen, dtype=torch.float64),
            "target": torch.randn(shape, generator=gen, dtype=torch.float64),
            "timestep": torch.randint(1000, (1,), generator=gen),
            "caption": torch.randn(3, 16, generator=gen, dtype=torch.float64)}


def reference_backward(model: Any, plan: Plan) -> float:
    """The plain model on each whole clip, the plan's normaliser by hand; gradients into ``model``."""
    return video_steps.reference_backward(
        model, plan, data=lambda s: data(s.id, s.num_frames, s.height, s.width), text_key="caption",
        values=PATCH * PATCH * CHANNELS)


def run_step(executor: Executor, model: Any, plan: Plan) -> float:
    """One planned step of the DCP model on this rank (the lines a user's loop has); its loss share."""
    from executor.integrations import hf_diffusers

    def load(sample: Any) -> dict[str, object]:
        d = data(sample.id, sample.num_frames, sample.height, sample.width)
        patches = hf_diffusers.patchify(d["target"], PATCH)
        return {"id": sample.id, "inputs": patches, "targets": patches, **d}

    def forward(work: Any, items: list[dict[str, Any]]) -> torch.Tensor:
        return hf_diffusers.forward(model, work, videos=[it["video"] for it in items],
                             timesteps=torch.cat([it["timestep"] for it in items]),
                             captions=torch.stack([it["caption"] for it in items]))

    return video_steps.run_step(executor, model, plan, load=load, forward=forward,
                                token_losses=hf_diffusers.token_losses)
