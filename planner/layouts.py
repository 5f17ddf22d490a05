"""Which attention layouts a group may run, and the choice of each group's layout (issue 25).

A group of ``d`` ranks splits its attention as Ulysses over ``u`` ranks x ring over ``r = d/u``
rank-sets (``executor/ring_layout.py``). The layouts a size may take (:func:`layout_options`):

* ``u`` divides the query heads and divides the key/value heads or is a multiple of them
  (``ModelSpec.allowed_group_sizes``, the GQA rule: past the key/value heads Ulysses replicates
  each head over the ranks whose query heads use it);
* a ring (``r > 1``) needs attention over whole samples (kinds ``1d`` and ``3d``): it cannot split
  the ``2d`` kind's spatial and temporal attention; and it cuts every sample into ``2r`` zig-zag
  chunks, so a sample of fewer than ``2r`` tokens cannot run on it (``planner.costs`` marks it as
  not fitting that column);
* ``layout="ulysses"`` keeps ``r = 1`` (the sizes the heads allow, as before rings);
  ``"ring"`` makes every group of two or more ranks a pure ring (``u = 1``, any size);
  ``"auto"`` allows every ``u x r`` above, so sizes past the heads run only as Ulysses x ring.

Each size column of the cost table takes the layout that holds the most samples for the least
GPU-time (``planner.costs.CostTable``); once the search has placed the samples,
:func:`choose_group_layouts` re-chooses every group's layout among its size's options, exactly,
for its own samples, micro-batches and placement: Ulysses inside a node and the ring across
nodes where that is cheaper, a different ``u x r`` where the group's samples favour it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from costmodel.evaluate import CostModel
from planner.assemble import BatchArrays, Draft, DraftGroup, draft_costs
from planner.costs import CostTable

Layout = Literal["auto", "ulysses", "ring"]
LAYOUTS: tuple[str, ...] = ("auto", "ulysses", "ring")


def layout_options(cost_model: CostModel, *, layout: str, mode: str, max_group_size: int | None,
                   explicit: Sequence[int] | None) -> dict[int, tuple[int, ...]]:
    """Allowed group sizes (ascending) and the ring degrees each may run.

    Args:
        cost_model: The cost model bound to the cluster.
        layout: ``auto``, ``ulysses`` or ``ring`` (module docstring).
        mode: ``pow2`` keeps sizes that are powers of two, ``any`` every size.
        max_group_size: Largest size (default: the world).
        explicit: Sizes given directly (each must have a layout).

    Raises:
        ValueError: for an unknown layout, ``ring`` on a model whose attention a ring cannot split,
            or an explicit size no layout allows (naming it and the allowed ones).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {list(LAYOUTS)}")
    model = cost_model.file.model
    world = cost_model.cluster.num_gpus
    limit = world if max_group_size is None else min(world, max_group_size)
    whole = cost_model.attention != "spatial_temporal"
    if layout == "ring" and not whole:
        raise ValueError(f"layout='ring': model {model.name!r} is kind {model.kind!r}, whose spatial and temporal "
                         "attention a ring cannot split; use layout='ulysses' or 'auto'")
    ulysses = model.allowed_group_sizes(max_size=limit)
    options: dict[int, set[int]] = {}
    if layout == "ring":
        options = {d: {d} for d in range(1, limit + 1)}
    else:
        for u in ulysses:
            for r in range(1, limit // u + 1) if layout == "auto" and whole else (1,):
                options.setdefault(u * r, set()).add(r)
    if explicit is not None:
        for d in explicit:
            if d not in options:
                raise ValueError(
                    f"group size {d} is not allowed: it must divide num_heads={model.num_heads}, divide "
                    f"kv_heads={model.kv_heads} or be a multiple of it"
                    + (" (its Ulysses degree, times a ring degree)" if layout == "auto" and whole else "")
                    + f", and be at most {limit} (layout={layout!r}; allowed: {sorted(options)})")
        keep = set(explicit)
    elif mode == "pow2":
        keep = {d for d in options if d & (d - 1) == 0}
    else:
        keep = set(options)
    return {d: tuple(sorted(options[d])) for d in sorted(keep)}


def apply_layouts(draft: Draft, table: CostTable) -> Draft:
    """The draft with every group that names no layout (``ring_degree == 1``) at its size column's
    ring degree, the layout the table priced it with (the search and most baselines see only the
    table); a group that names a ring (a fixed ring or USP baseline) keeps it."""
    return [g if g.ring_degree > 1 or g.size not in table.ring_options else
            DraftGroup(size=g.size, first_rank=g.first_rank, micro_batches=g.micro_batches,
                       ring_degree=table.ring_degree_of(g.size)) for g in draft]


def ring_chunks_fit(draft: Draft, arrays: BatchArrays) -> bool:
    """True when every sample of every ring group has the ``2r`` tokens its zig-zag chunks need."""
    return all(arrays.tokens[i] >= 2 * g.ring_degree for g in draft if g.ring_degree > 1
               for mb in g.micro_batches for i, _ in mb)


def choose_group_layouts(draft: Draft, arrays: BatchArrays, table: CostTable) -> Draft:
    """Each group at the fastest of its size's layouts for its own samples and placement (exact
    costs, ``planner.assemble.draft_costs``), among those where every sample has ``2r`` tokens
    or more and every micro-batch stays under the table's activation budget; a group keeps its
    layout unless another is strictly faster, so the step time never grows."""
    cm: CostModel = table.cost_model
    limit = cm.fixed_bytes() + table.budget_bytes
    out: Draft = []
    for g in draft:
        options = table.ring_options.get(g.size, (g.ring_degree,))
        if not g.micro_batches or len(options) < 2:
            out.append(g)
            continue
        shortest = min(arrays.tokens[i] for mb in g.micro_batches for i, _ in mb)
        best, best_s = g, draft_costs([g], arrays, cm)[0].time_s
        for r in options:
            if r == g.ring_degree or shortest < 2 * r:
                continue
            cand = DraftGroup(size=g.size, first_rank=g.first_rank, micro_batches=g.micro_batches, ring_degree=r)
            costs = draft_costs([cand], arrays, cm)[0]
            if max(costs.microbatch_peak_bytes) <= limit * (1 + 1e-12) and costs.time_s < best_s * (1 - 1e-9):
                best, best_s = cand, costs.time_s
        out.append(best)
    return out


def registry_layouts(options: dict[int, tuple[int, ...]]) -> tuple[list[int], list[tuple[int, int]]]:
    """What an executor's ``executor.groups.GroupRegistry`` must be given so that every plan made
    under these options runs: the group sizes (``group_sizes``) and the Ulysses x ring layouts
    ``(u, r)`` with ``r > 1`` (``layouts``)."""
    return list(options), sorted({(d // r, r) for d, rs in options.items() for r in rs if r > 1})
