"""Baselines under the same cost model and validator as the planner (docs/design.md, 'Baselines').

One file per baseline, registered here by the name ``Plan.baselines_s`` records:

* ``bucket-sp{d}`` (``bucket.py``): bucket parallel as published with DCP, at the fixed SP
  size ``d`` of the run (``bucket-sp4`` is the paper's; 1, 2 and 8 too, reports pick the best
  per workload);
* ``static-best`` (``static_best.py``): the best fixed SP size, LPT-balanced, packed, cheapest
  fitting policy per sample;
* ``megatron-dyncp`` (``megatron_dyncp.py``): Megatron-Core's dynamic-CP scheduler;
* ``dcp-greedy`` (``dcp_greedy.py``): DCP's published random greedy scheduler (seeded);
* ``ring-cp`` (``ring_cp.py``): Megatron-Core's ring context parallelism at one CP size for the
  run (the smallest on which the workload's longest sample fits), tokens balanced over replicas;
* ``usp`` (``usp.py``): a USP hybrid at one size and one Ulysses x ring split for the run
  (``fixed_cp.py`` holds what the two share);
* ``naive`` (``naive.py``): SP size 1, round-robin; a sensitivity row, never a headline.

A baseline that cannot hold the batch (a sample does not fit its rule) has no time in
``Plan.baselines_s`` and is named in ``baseline_drafts``' ``not_holding``. The *strongest*
baseline of a step is the fastest of all but ``naive``, among those that hold it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from costmodel.specs import Sample
from planner.assemble import Draft
from planner.baselines.bucket import bucket_draft
from planner.baselines.dcp_greedy import dcp_greedy_draft
from planner.baselines.megatron_dyncp import megatron_dyncp_draft
from planner.baselines.naive import naive_draft
from planner.baselines.ring_cp import ring_cp_draft
from planner.baselines.static_best import static_best_draft
from planner.baselines.usp import usp_draft
from planner.costs import CostTable
from planner.layouts import apply_layouts

BUCKET_SIZES = (1, 2, 4, 8)
"""Fixed SP sizes of the bucket baseline (the paper's 4 among them)."""

NOT_HEADLINE = frozenset({"naive"})
"""Baselines left out of the strongest-baseline comparison."""


@dataclass(frozen=True, slots=True)
class Baseline:
    """A registered baseline."""

    name: str
    """Name in ``Plan.baselines_s``."""
    description: str
    """One line for legends."""
    build: Callable[..., Draft | None]
    """``build(table, seed=..., reference=...)``: its draft, or None when it cannot hold the
    batch (``reference``: the workload's longest sample, for rules fixed for a whole run)."""
    fixed_layout: bool = False
    """True when the baseline sets its groups' attention layouts itself (``ring-cp``, ``usp``);
    the others run each size at the table's layout (``planner.layouts.apply_layouts``)."""


def _bucket(d: int) -> Baseline:
    return Baseline(name=f"bucket-sp{d}",
                    description=f"bucket parallel at SP {d}: shape buckets, largest batch that "
                                f"fits, full recompute, dealt round-robin"
                                + (" (DCP paper)" if d == 4 else ""),
                    build=partial(bucket_draft, group_size=d))


REGISTRY: dict[str, Baseline] = {b.name: b for b in [
    *(_bucket(d) for d in BUCKET_SIZES),
    Baseline(name="static-best", build=static_best_draft,
             description="best fixed SP size, LPT-balanced, packed, cheapest fitting policy"),
    Baseline(name="megatron-dyncp", build=megatron_dyncp_draft,
             description="Megatron-Core dynamic CP: pow2 size per length, longest first, 5% cap"),
    Baseline(name="dcp-greedy", build=dcp_greedy_draft,
             description="DCP's scheduler: random greedy group fill, accumulation counts"),
    Baseline(name="ring-cp", build=ring_cp_draft, fixed_layout=True,
             description="Megatron-Core ring CP at the run's fixed size (longest sample fits), tokens balanced"),
    Baseline(name="usp", build=usp_draft, fixed_layout=True,
             description="USP hybrid: fixed size, Ulysses inside a node x ring across, tokens balanced"),
    Baseline(name="naive", build=naive_draft,
             description="SP 1, samples dealt round-robin (sensitivity only)"),
]}
"""Every baseline by name, in report order."""


def baseline_drafts(table: CostTable, *, seed: int = 0, reference: Sample | None = None,
                    extra_bucket_sizes: Sequence[int] = (), not_holding: list[str] | None = None
                    ) -> dict[str, Draft]:
    """Every baseline draft that can hold the batch, by name.

    Args:
        table: The batch's cost table.
        seed: Seed of the randomised baselines (``dcp-greedy``).
        reference: The workload's longest sample (a bucket size, a fixed CP size must hold it),
            if known.
        extra_bucket_sizes: More fixed SP sizes for the bucket baseline (``bucket-sp{d}``).
        not_holding: When given, the names of the baselines that cannot hold the batch are
            appended to it (in registry order).

    Raises:
        ValueError: for an extra bucket size below 1.
    """
    entries = list(REGISTRY.values())
    for d in extra_bucket_sizes:
        if d < 1:
            raise ValueError(f"extra bucket size must be at least 1, got {d}")
        if f"bucket-sp{d}" not in REGISTRY:
            entries.append(_bucket(d))
    out: dict[str, Draft] = {}
    for baseline in entries:
        draft = baseline.build(table, seed=seed, reference=reference)
        if draft is not None:
            out[baseline.name] = draft
        elif not_holding is not None:
            not_holding.append(baseline.name)
    return out


def with_layouts(name: str, draft: Draft, table: CostTable) -> Draft:
    """A baseline's draft at the layouts it runs: its own for a ``fixed_layout`` baseline, else
    each size's layout in the table (``planner.layouts.apply_layouts``)."""
    baseline = REGISTRY.get(name)
    return draft if baseline is not None and baseline.fixed_layout else apply_layouts(draft, table)


def strongest(baselines_s: Mapping[str, float]) -> tuple[str, float] | None:
    """The fastest baseline of a step, ``naive`` excepted (None when there is none)."""
    found = [(t, name) for name, t in baselines_s.items() if name not in NOT_HEADLINE]
    if not found:
        return None
    t, name = min(found)
    return name, t


def description(name: str) -> str:
    """Legend line of a baseline name (``bucket-sp{d}`` for any ``d``)."""
    if name in REGISTRY:
        return REGISTRY[name].description
    if name.startswith("bucket-sp") and name[len("bucket-sp"):].isdigit():
        return _bucket(int(name[len("bucket-sp"):])).description
    return ""
