"""The diffusers HunyuanVideo of the integration tests: config, data, reference step, rank step.

A small random-initialised ``HunyuanVideoTransformer3DModel`` (4 heads of 8, one dual-stream and
two single-stream blocks, one token-refiner block, patch 1x2x2, guidance embedding on; text of 3
tokens of 16 channels, each sample with its own mask length 1-3), built in the test, no download.
The plans are Wan's (:func:`hf_wan_model.plans`: groups 2+1+1 with an idle rank, then 4 with a
micro-batch shorter than the group; policies 0-2 of the 3 blocks). The reference runs the plain
model (its own forward, attention masks and processors) on each whole clip in one process.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from executor.runtime import Executor
from planner.plan import Plan
from tests.executor.integrations import hf_llama, video_steps

PATCH = (1, 2, 2)
CHANNELS = 4
TEXT_TOKENS, TEXT_DIM, POOLED_DIM = 3, 16, 8


def build(*, dtype: torch.dtype = torch.float64, seed: int = 0) -> Any:
    """The small HunyuanVideo, deterministically initialised (same on every rank)."""
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(seed)
    model = HunyuanVideoTransformer3DModel(
        in_channels=CHANNELS, out_channels=CHANNELS, num_attention_heads=4, attention_head_dim=8, num_layers=1,
        num_single_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=PATCH[1], patch_size_t=PATCH[0],
        guidance_embeds=True, text_embed_dim=TEXT_DIM, pooled_projection_dim=POOLED_DIM, rope_axes_dim=(2, 2, 4))
    with torch.no_grad():  # zero-initialised projections and modulations: give them weight
        for p in model.parameters():
            if float(p.abs().max()) == 0.0:
                p.normal_(0.0, 0.02)
    return model.to(dtype)


def data(sample_id: str, frames: int, height: int, width: int) -> dict[str, torch.Tensor]:
    """Deterministic latent video, target, timestep, guidance, text states, mask and pooled text
    of one sample (fp64)."""
    seed = int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:7], "little")
    gen = torch.Generator().manual_seed(seed)
    shape = (CHANNELS, frames * PATCH[0], height * PATCH[1], width * PATCH[2])
    length = 1 + int(torch.randint(TEXT_TOKENS, (1,), generator=gen))
    return {"video": torch.randn(shape, generator=gen, dtype=torch.float64),
            "target": torch.randn(shape, generator=gen, dtype=torch.float64),
            "timestep": torch.randint(1000, (1,), generator=gen),
            "guidance": 1.0 + 5.0 * torch.rand(1, generator=gen, dtype=torch.float64),
            "text": torch.randn(TEXT_TOKENS, TEXT_DIM, generator=gen, dtype=torch.float64),
            "mask": (torch.arange(TEXT_TOKENS) < length).long(),
            "pooled": torch.randn(POOLED_DIM, generator=gen, dtype=torch.float64)}


def reference_backward(model: Any, plan: Plan) -> float:
    """The plain model on each whole clip, the plan's normaliser by hand; gradients into ``model``."""
    return video_steps.reference_backward(
        model, plan, data=lambda s: data(s.id, s.num_frames, s.height, s.width), text_key="text",
        values=PATCH[0] * PATCH[1] * PATCH[2] * CHANNELS,
        extra=lambda d: {"encoder_attention_mask": d["mask"][None], "pooled_projections": d["pooled"][None],
                         "guidance": d["guidance"]})


def run_step(executor: Executor, model: Any, plan: Plan) -> float:
    """One planned step of the DCP model on this rank (the lines a user's loop has); its loss share."""
    from executor.integrations import hf_hunyuan

    def load(sample: Any) -> dict[str, object]:
        d = data(sample.id, sample.num_frames, sample.height, sample.width)
        patches = hf_hunyuan.patchify(d["target"], PATCH)
        return {"id": sample.id, "inputs": patches, "targets": patches, **d}

    def forward(work: Any, items: list[dict[str, Any]]) -> torch.Tensor:
        return hf_hunyuan.forward(model, work, videos=[it["video"] for it in items],
                                  timesteps=torch.cat([it["timestep"] for it in items]),
                                  texts=torch.stack([it["text"] for it in items]),
                                  text_masks=torch.stack([it["mask"] for it in items]),
                                  pooled=torch.stack([it["pooled"] for it in items]),
                                  guidance=torch.cat([it["guidance"] for it in items]))

    return video_steps.run_step(executor, model, plan, load=load, forward=forward,
                                token_losses=hf_hunyuan.token_losses)


def assert_world_equals_plain(world: list[dict[str, object]], plan: Plan, index: int, *, tol: float) -> int:
    """Every rank's ``hunyuan_loss_{index}`` / ``hunyuan_grad_{index}`` against the plain model on
    ``plan``: loss shares sum to the plain loss and every gradient agrees, within ``tol``
    relative; the number of (rank, parameter) pairs checked that way.

    A gradient below 1e-12 of the model's largest is rounding noise around an exact zero (the
    token refiner's q/k projections here: ~1e-20, and a key bias's gradient is zero in exact
    arithmetic, softmax being shift-invariant): it is checked against ``tol`` times the largest
    gradient instead, not relative to itself.
    """
    model = build()
    loss = reference_backward(model, plan)
    return video_steps.assert_world_equals_reference(world, "hunyuan", index, loss=loss,
                                                     reference=hf_llama.grads(model), tol=tol, noise_floor=1e-12)
