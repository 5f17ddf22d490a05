"""Start the executor tests' multi-process gloo worlds: every rank a fresh process, forked from a
server that imported torch (and the Hugging Face models the integration worlds build) once.

``torch.multiprocessing.spawn`` starts each rank as a new interpreter that imports torch,
``torch.distributed``, transformers and diffusers again: on a 2-core machine 4 ranks spent
10-12 s and 8 ranks over 20 s before their first collective. Here the ranks come from
multiprocessing's ``forkserver``, started once per test process with :data:`PRELOAD` imported;
each rank still runs in its own process with its own process group, and its function and
arguments still travel by pickle, as under ``spawn``. The server's environment is the test
process's when the first world starts (set what the ranks read before that, or pass it as an
argument).
"""

from __future__ import annotations

import importlib.util
import multiprocessing
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOAD: tuple[str, ...] = (
    "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.device_mesh",
    "executor.runtime", "executor.groups", "executor.grad_sync", "tests.executor.helpers",
    "tests.executor.scenarios",
    "transformers.models.llama.modeling_llama", "transformers.modeling_layers",
    "diffusers.models.transformers.latte_transformer_3d", "diffusers.models.transformers.transformer_wan",
    "diffusers.models.transformers.transformer_hunyuan_video",
)
"""Modules the server imports before it forks ranks (those of packages not installed are left out)."""


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module.split(".", 1)[0]) is not None


def spawn_world(fn: Callable[..., Any], *, args: tuple[Any, ...] = (), nprocs: int) -> None:
    """Run ``fn(rank, *args)`` for ``rank`` in ``0..nprocs-1``, one process each, and wait for all;
    a rank's exception fails the call (``torch.multiprocessing.start_processes``' contract)."""
    multiprocessing.set_forkserver_preload([m for m in PRELOAD if _installed(m)])
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
