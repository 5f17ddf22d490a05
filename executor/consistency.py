"""Digest agreement: all ranks check they execute the same plan before a step.

One ``all_gather`` over the world of four int64 per rank: the step, two 60-bit chunks of the
plan digest (120 bits), and a flag for a plan that does not even fit this rank (wrong rank or
world). Every rank runs the same collective whatever it holds, so a mismatch can never hang;
every rank then raises the same :class:`PlanMismatchError` naming the step and the digests.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from planner.plan import RankPlan

_CHUNK_HEX = 15  # 60 bits per int64


class PlanMismatchError(RuntimeError):
    """Ranks hold different plans (or one holds a plan that is not its own)."""


def digest_words(digest: str) -> tuple[int, int]:
    """The first 120 bits of a hex digest as two non-negative int64 values."""
    if len(digest) < 2 * _CHUNK_HEX:
        raise ValueError(f"digest {digest!r} is shorter than {2 * _CHUNK_HEX} hex characters")
    return int(digest[:_CHUNK_HEX], 16), int(digest[_CHUNK_HEX:2 * _CHUNK_HEX], 16)


def check_plan_agreement(rank_plan: RankPlan, *, step: int, rank: int, world_size: int,
                         group: dist.ProcessGroup | None = None,
                         device: torch.device | str = "cpu") -> None:
    """Raise on every rank unless all ranks hold the same plan for ``step``.

    Args:
        rank_plan: This rank's view of the plan.
        step: The step the caller is about to execute.
        rank: This rank.
        world_size: Ranks in the world.
        group: Process group to agree over (default: the world).
        device: Where the small tensor lives (``cuda`` under NCCL).

    Raises:
        PlanMismatchError: on every rank, when any rank's step, digest, rank or world differs.
    """
    own = rank_plan.rank == rank and rank_plan.num_ranks == world_size
    plan_step = -1 if rank_plan.step is None else rank_plan.step
    hi, lo = digest_words(rank_plan.plan_digest)
    mine = torch.tensor([plan_step if plan_step >= 0 else step, hi, lo, int(own)],
                        dtype=torch.int64, device=device)
    if world_size == 1:
        rows = [mine]
    else:
        rows = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(rows, mine, group=group)
    table = torch.stack(rows).cpu().tolist()
    expected = [step, hi, lo, 1]
    if all(row[:3] == table[0][:3] and row[3] == 1 for row in table) and table[0][0] == step:
        return
    lines = []
    for r, row in enumerate(table):
        marks = []
        if row[0] != step:
            marks.append(f"step {row[0]}")
        if row[3] != 1:
            marks.append("plan for another rank or world")
        if row[1:3] != expected[1:3]:
            marks.append("digest differs from this rank's")
        lines.append(f"rank {r}: digest {row[1]:015x}{row[2]:015x}..."
                     + (f" ({', '.join(marks)})" if marks else ""))
    raise PlanMismatchError(
        f"plan disagreement before step {step} (seen from rank {rank}):\n  " + "\n  ".join(lines)
    )
