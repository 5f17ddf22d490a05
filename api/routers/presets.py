"""The shipped presets: models, hardware, clusters, workloads and embedded cost models."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from fastapi import APIRouter

from api.errors import COMMON_RESPONSES
from costmodel.presets import preset_records

router = APIRouter(prefix="/v1", tags=["presets"], responses=COMMON_RESPONSES)


@functools.cache
def _records() -> dict[str, list[dict[str, Any]]]:
    """The presets ship with the package and never change while the service runs."""
    return preset_records()


@router.get("/presets")
async def presets() -> dict[str, list[dict[str, Any]]]:
    """Every shipped preset by kind (`models`, `hardware`, `clusters`, `workloads`, `cost-models`),
    as `dcp presets --json` prints them: the names `model`, `cluster`, `workload` and
    `cost_model_id` accept in the plan and epoch requests."""
    return await asyncio.to_thread(_records)
