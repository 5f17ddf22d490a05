"""What ``dcp check-model`` runs: the configuration and the executor's reference model."""

from __future__ import annotations

import contextlib
import json
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from costmodel.specs import ModelSpec
from executor.models import DiT3D, Llama1D, ModelConfig, STDiT2D, init_weights

ProgressFn = Callable[[str], None]


@dataclass(kw_only=True, frozen=True, slots=True)
class CheckConfig:
    """What the check runs."""

    kind: Literal["1d", "2d", "3d"] = "1d"
    """Reference model: LLaMA-style 1D, STDiT-style 2D or a full-3D-attention DiT."""
    world_size: int = 2
    """gloo ranks (one thread each; a 2-core machine runs 2 well)."""
    num_layers: int = 4
    """Layers of the reference model."""
    hidden: int = 64
    """Hidden size."""
    num_heads: int = 4
    """Attention heads (the group sizes must divide it)."""
    num_kv_heads: int | None = None
    """Key/value heads of the self-attention (``None``: ``num_heads``); a group size must divide
    them or be a multiple of them (past them each key/value head is replicated)."""
    ffn_hidden: int = 128
    """MLP size."""
    vocab: int = 256
    """Vocabulary (1D)."""
    num_steps: int = 3
    """Planned steps to run."""
    samples_per_step: int = 8
    """Samples per step."""
    tokens_min: int = 32
    """Shortest sample in tokens."""
    tokens_max: int = 1024
    """Longest sample in tokens."""
    memory_tokens: int = 600
    """If positive: memory per rank such that about this many tokens fit without checkpointing
    (plans then mix policies); 0 leaves memory roomy."""
    sweep_sizes: int = 6
    """Sample sizes from ``tokens_min`` to ``tokens_max`` in the compute profile's sweep (each
    size runs at every layer count and checkpoint policy; fewer: a faster, coarser fit)."""
    sweep_repeats: int = 5
    """Timed repeats per profiled point."""
    repeats: int = 5
    """Timed repeats per executed micro-batch."""
    seed: int = 0
    """Seed of samples, weights and data."""
    clock: Literal["wall", "thread"] = "thread"
    """``thread``: CPU time of the rank's thread (robust on a busy machine, all-to-all excluded);
    ``wall``: elapsed time (everything; needs a quiet machine)."""
    concurrent: bool = True
    """The ``world_size`` ranks share this machine, as a ``cpu:W`` cluster's ranks do in
    training: profile with every rank running the sweep at once and run one-rank groups at the
    same time, so that the cores' shared caches and memory bandwidth are contended in the profile
    as in the run. ``False``: profile in one process and run one-rank groups in turns (a GPU rank
    has its device to itself)."""

    def __post_init__(self) -> None:
        if self.clock not in ("wall", "thread"):
            raise ValueError(f"clock must be wall or thread, got {self.clock!r}")
        if self.world_size < 1 or (self.world_size > 1 and self.num_heads % self.world_size):
            raise ValueError(f"world_size={self.world_size} must be positive and divide num_heads="
                             f"{self.num_heads}")
        kv = self.num_kv_heads
        if kv is not None and (kv <= 0 or self.num_heads % kv):
            raise ValueError(f"num_kv_heads={kv} must be positive and divide num_heads={self.num_heads}")
        if self.sweep_sizes < 2:
            raise ValueError(f"sweep_sizes must be >= 2, got {self.sweep_sizes}")
        if not 0 < self.tokens_min <= self.tokens_max:
            raise ValueError(f"need 0 < tokens_min <= tokens_max, got {self.tokens_min}, {self.tokens_max}")
        for name in ("num_layers", "hidden", "num_heads", "ffn_hidden", "num_steps", "samples_per_step",
                     "sweep_repeats", "repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def model_config(self) -> ModelConfig:
        """The executor's reference-model configuration."""
        return ModelConfig(num_layers=self.num_layers, hidden=self.hidden, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, ffn_hidden=self.ffn_hidden, vocab=self.vocab)

    @property
    def group_sizes(self) -> list[int]:
        """Group sizes plans may use up to the world: divisors of the heads that divide the key/value
        heads or are a multiple of them (``ModelSpec.allowed_group_sizes``)."""
        return reference_spec(self).allowed_group_sizes(max_size=self.world_size)


def reference_spec(config: CheckConfig) -> ModelSpec:
    """The model spec of the reference model (what the cost model is for)."""
    kv = f"-kv{config.num_kv_heads}" if config.num_kv_heads else ""
    return ModelSpec(name=f"ref-{config.kind}-h{config.hidden}-l{config.num_layers}{kv}", kind=config.kind,
                     num_layers=config.num_layers, hidden=config.hidden, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads, ffn_hidden=config.ffn_hidden,
                     vocab=config.vocab if config.kind == "1d" else 0,
                     causal=config.kind == "1d", mlp="swiglu" if config.kind == "1d" else "gelu",
                     cross_attention_tokens=config.model_config.text_tokens if config.kind == "3d" else 0)


def build_reference_model(config: CheckConfig) -> nn.Module:
    """The executor's reference model, deterministically initialised (fp32)."""
    cfg = config.model_config
    model: nn.Module = {"1d": Llama1D, "2d": STDiT2D, "3d": DiT3D}[config.kind](cfg)
    init_weights(model, seed=config.seed)
    return model


def init_rank(rank: int, world: int, port: int, *, timeout_s: float | None = None, backend: str = "gloo") -> None:
    """One torch thread and a process group (gloo, or ``backend``) on loopback (``timeout_s``: its
    collectives' timeout; None: torch's default)."""
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=None if timeout_s is None else timedelta(seconds=timeout_s))


@contextlib.contextmanager
def joined_rank(rank: int, world: int, port: int, *, save: Callable[[dict[str, Any]], object],
                timeout_s: float | None = None, backend: str = "gloo") -> Iterator[dict[str, Any]]:
    """One spawned rank's life: join the world (:func:`init_rank`), fill the yielded results,
    ``save`` them whatever happens (the traceback under ``error`` when the body raised; the
    exception still propagates, so ``mp.spawn`` fails too), leave the world."""
    init_rank(rank, world, port, timeout_s=timeout_s, backend=backend)
    results: dict[str, Any] = {}
    try:
        yield results
    except Exception:
        results["error"] = traceback.format_exc()
        raise
    finally:
        save(results)
        dist.destroy_process_group()


def rank_results(rank: int, world: int, port: int, out_dir: str) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """One spawned rank of the check (:func:`joined_rank`), its results written to
    ``out_dir/rank<r>.json``; read them back with :func:`read_rank_results`."""
    path = Path(out_dir) / f"rank{rank}.json"
    return joined_rank(rank, world, port, save=lambda results: path.write_text(json.dumps(results)))


def read_rank_results(out_dir: str, world: int) -> list[dict[str, Any]]:
    """What :func:`rank_results` wrote for each rank, in rank order.

    Raises:
        RuntimeError: naming the first rank that failed, with its traceback.
    """
    out = [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]
    for r, res in enumerate(out):
        if "error" in res:
            raise RuntimeError(f"rank {r} failed:\n{res['error']}")
    return out


def run_as_profiled(run: Callable[[], float], *, rank: int, ranks: Sequence[int], concurrent: bool,
                    group: Any = None) -> float:
    """Run ``run`` (it returns its own time) on an emulated group the way the compute profile
    ran: every rank of ``ranks`` at once, or one at a time while the others wait (a barrier of
    ``group``, ``None`` for the world, before each turn). Returns this rank's time.
    """
    time_s = 0.0
    for turn in ([rank] if concurrent else ranks):
        dist.barrier(group=group)
        if turn == rank:
            time_s = run()
    return time_s
