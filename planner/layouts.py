"""Which attention layouts a group may run, and the choice of each group's layout (issue 25).

A group of ``d`` ranks splits its attention as Ulysses over ``u`` ranks x ring over ``r = d/u``
rank-sets (``executor/ring_layout.py``). The layouts a size may take (:func:`layout_options`):

* ``u`` divides the query heads and divides the key/value heads or is a multiple of them
  (``ModelSpec.allowed_group_sizes``, the GQA rule: past the key/value heads Ulysses replicates
  each head over the ranks whose query heads use it);
* a ring (``r > 1``) needs attention over whole samples (kinds ``1d`` and ``3d``): it cannot split
  the ``2d`` kind's spatial and temporal attention, nor run joint text attention (MMDiT-style,
  ``ModelSpec.joint_attention_tokens``; cross-attention to text, as Wan's, is fine); and it cuts
  every sample into ``2r`` zig-zag chunks, so a sample of fewer than ``2r`` tokens cannot run on
  it (``planner.costs`` marks it as not fitting that column);
* ``layout="ulysses"`` keeps ``r = 1`` (the sizes the heads allow, as before rings);
  ``"ring"`` makes every group of two or more ranks a pure ring (``u = 1``, any size);
  ``"auto"`` allows, per size, pure Ulysses (where the heads allow the size), the pure ring and
  one Ulysses x ring layout (:func:`hybrid_ulysses_degree`), so sizes past the heads run only as
  rings. Every hybrid ``u x r`` costs an executor strided ring process groups
  (:func:`num_process_groups`); one per size keeps the set small (Llama-3.1-8B on 64 ranks: 368
  groups, against 822 for every ``u x r``), and an epoch declares them (:func:`config_layouts`).

Each size column of the cost table takes the layout that holds the most samples for the least
GPU-time (``planner.costs.CostTable``); once the search has placed the samples,
:func:`choose_group_layouts` re-chooses every group's layout among its size's options, exactly,
for its own samples, micro-batches and placement: Ulysses inside a node and the ring across
nodes where that is cheaper, a different ``u x r`` where the group's samples favour it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from costmodel.evaluate import CostModel
from planner.assemble import BatchArrays, Draft, DraftGroup, draft_costs
from planner.config import PlannerConfig
from planner.costs import CostTable

Layout = Literal["auto", "ulysses", "ring"]
LAYOUTS: tuple[str, ...] = ("auto", "ulysses", "ring")

DEFAULT_IN_NODE_RING_MARGIN = 0.04
"""Inside a node, the share of the pure-Ulysses time a ring must save, for a cost model that
carries no held-out error (analytic): fitted models were seen pricing in-node rings 1.5-3.6%
cheaper than they run under the published ring behaviour (``docs/planner.md``, "Default layout"),
so a smaller predicted saving is within the model's error."""

_MARGIN_TERMS = ("compute_time", "ring_attention", "ring_step")
"""The fitted terms (``CostModelFile.fit_quality``) whose held-out error bands a ring's saving."""


def in_node_ring_margin(config: PlannerConfig, cost_model: CostModel) -> float:
    """The share of the pure-Ulysses time an in-node ring must save: the config's
    ``in_node_ring_margin``, else the largest held-out MAPE of the cost model's compute and ring
    terms where it was fitted, else :data:`DEFAULT_IN_NODE_RING_MARGIN`."""
    if config.in_node_ring_margin is not None:
        return config.in_node_ring_margin
    errors = [q.mape for name, q in cost_model.file.fit_quality.items() if name in _MARGIN_TERMS and q.num_heldout]
    return max(errors) if errors else DEFAULT_IN_NODE_RING_MARGIN


def _in_one_node(cost_model: CostModel, group: DraftGroup) -> bool:
    gpn = cost_model.cluster.gpus_per_node
    return group.first_rank // gpn == (group.first_rank + group.size - 1) // gpn


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
    if layout == "ring" and model.joint_attention_tokens:
        raise ValueError(f"layout='ring': model {model.name!r} joins {model.joint_attention_tokens} text tokens to "
                         "every self-attention (joint attention, executor/joint.py), which runs on pure Ulysses "
                         "groups only; use layout='ulysses' or 'auto'")
    whole = whole and not model.joint_attention_tokens  # cross-attention (Wan) leaves self-attention whole
    ulysses = model.allowed_group_sizes(max_size=limit)
    options: dict[int, set[int]] = {}
    if layout == "ring":
        options = {d: {d} for d in range(1, limit + 1)}
    elif layout == "auto" and whole:
        # Only the sizes ``mode`` keeps when no sizes are given (powers of two: 15 of 16,384 sizes;
        # every size's layouts cost 0.05 s there).
        pow2_only = explicit is None and mode == "pow2"
        for d in range(1, limit + 1):
            if pow2_only and d & (d - 1):
                continue
            options[d] = {d // hybrid_ulysses_degree(cost_model, d), d} | ({1} if d in ulysses else set())
    else:
        options = {u: {1} for u in ulysses}
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


def hybrid_ulysses_degree(cost_model: CostModel, size: int) -> int:
    """The Ulysses degree of a size's one Ulysses x ring layout under ``layout="auto"``: the largest
    degree the heads allow that divides ``size`` and the node (the rule of the ``usp`` baseline,
    ``planner/baselines/usp.py``), so the all-to-alls stay inside a node and the ring crosses nodes."""
    gpn = cost_model.cluster.gpus_per_node
    return max(u for u in cost_model.file.model.allowed_group_sizes(max_size=min(size, gpn))
               if size % u == 0 and gpn % u == 0)


def apply_layouts(draft: Draft, table: CostTable) -> Draft:
    """The draft with every group that names no layout (``ring_degree == 1``) at its size column's
    ring degree, the layout the table priced it with (the search and most baselines see only the
    table); a group that names a ring (a fixed ring or USP baseline) keeps it."""
    return [g if g.ring_degree > 1 or g.size not in table.ring_options else
            DraftGroup(size=g.size, first_rank=g.first_rank, micro_batches=g.micro_batches,
                       ring_degree=table.ring_degree_of(g.size)) for g in draft]


def ring_chunks_fit(draft: Draft, arrays: BatchArrays) -> bool:
    """True when every sample of every ring group has the ``2r`` tokens its zig-zag chunks need."""
    by_degree: dict[int, list[list[tuple[int, int]]]] = {}  # ring degree -> its groups' micro-batches
    for g in draft:
        if g.ring_degree > 1:
            by_degree.setdefault(g.ring_degree, []).extend(g.micro_batches)
    for r, mbs in by_degree.items():
        idx = np.fromiter((i for mb in mbs for i, _ in mb), dtype=np.int64)
        if not (arrays.tokens[idx] >= 2 * r).all():
            return False
    return True


def choose_group_layouts(draft: Draft, arrays: BatchArrays, table: CostTable, *, in_node_margin: float = 0.0
                         ) -> Draft:
    """Each group at the fastest of its size's layouts for its own samples and placement (exact
    costs, ``planner.assemble.draft_costs``), among those where every sample has ``2r`` tokens
    or more and every micro-batch stays under the table's activation budget; a group keeps its
    layout unless another is strictly faster. A group inside one node whose size allows pure
    Ulysses then runs a ring only where it saves more than ``in_node_margin`` of the Ulysses time
    (:func:`in_node_ring_margin`); with a margin of 0 the step time never grows."""
    cm: CostModel = table.cost_model
    limit = cm.fixed_bytes() + table.budget_bytes
    out: Draft = list(draft)
    # The groups with a choice, their current times, and their shortest sample.
    choosing = [gi for gi, g in enumerate(draft)
                if g.micro_batches and len(table.ring_options.get(g.size, (g.ring_degree,))) >= 2]
    if not choosing:
        return out
    best_s = dict(zip(choosing, (c.time_s for c in draft_costs([draft[gi] for gi in choosing], arrays, cm)),
                      strict=True))
    shortest = {gi: min(arrays.tokens[i] for mb in draft[gi].micro_batches for i, _ in mb) for gi in choosing}
    # Per group inside one node, its pure-Ulysses layout and time where that holds its samples.
    ulysses: dict[int, tuple[DraftGroup, float]] = {
        gi: (draft[gi], best_s[gi]) for gi in choosing if draft[gi].ring_degree == 1}
    # Each ring degree for every group that may take it, costed in one call (draft_costs prices each
    # group alone); ascending, as each group's options are, so each group sees them in its order.
    for r in sorted({r for gi in choosing for r in table.ring_options[draft[gi].size]}):
        takers = [gi for gi in choosing if r in table.ring_options[draft[gi].size]
                  and r != draft[gi].ring_degree and shortest[gi] >= 2 * r]
        cands = [DraftGroup(size=draft[gi].size, first_rank=draft[gi].first_rank,
                            micro_batches=draft[gi].micro_batches, ring_degree=r) for gi in takers]
        for gi, cand, costs in zip(takers, cands, draft_costs(cands, arrays, cm), strict=True):
            fits = max(costs.microbatch_peak_bytes) <= limit * (1 + 1e-12)
            if r == 1 and fits:
                ulysses[gi] = (cand, costs.time_s)
            if fits and costs.time_s < best_s[gi] * (1 - 1e-9):
                out[gi], best_s[gi] = cand, costs.time_s
    if in_node_margin > 0:
        for gi, (cand, u_s) in ulysses.items():
            if out[gi].ring_degree > 1 and _in_one_node(cm, out[gi]) and not best_s[gi] < u_s * (1 - in_node_margin):
                out[gi], best_s[gi] = cand, u_s
    return out


def ring_savings_s(draft: Draft, arrays: BatchArrays, cost_model: CostModel, *, limit_bytes: float
                   ) -> list[float | None]:
    """Per group of the draft, what its ring saves against pure Ulysses of its size on the same ranks
    and micro-batches (Ulysses time minus the group's, exact costs), each micro-batch at its own
    recompute policies or, where pure Ulysses cannot hold it so (a ring keeps fewer bytes per rank),
    fully checkpointed: None for a pure-Ulysses group, and for a ring group whose size the heads do
    not allow as pure Ulysses or whose micro-batches pure Ulysses cannot hold under ``limit_bytes``."""
    out: list[float | None] = [None] * len(draft)
    model = cost_model.file.model
    rings = [gi for gi, g in enumerate(draft) if g.ring_degree > 1 and g.micro_batches
             and g.size in model.allowed_group_sizes(max_size=g.size)]
    if not rings:
        return out
    own = draft_costs([draft[gi] for gi in rings], arrays, cost_model)
    alts = [DraftGroup(size=draft[gi].size, first_rank=draft[gi].first_rank, micro_batches=draft[gi].micro_batches)
            for gi in rings]
    full = cost_model.num_layers - 1
    alts = [DraftGroup(size=a.size, first_rank=a.first_rank, micro_batches=[
        mb if peak <= limit_bytes * (1 + 1e-12) else [(i, full) for i, _ in mb]
        for mb, peak in zip(a.micro_batches, c.microbatch_peak_bytes, strict=True)])
        for a, c in zip(alts, draft_costs(alts, arrays, cost_model), strict=True)]
    alt = draft_costs(alts, arrays, cost_model)
    for gi, c_own, c_alt in zip(rings, own, alt, strict=True):
        if max(c_alt.microbatch_peak_bytes) <= limit_bytes * (1 + 1e-12):
            out[gi] = c_alt.time_s - c_own.time_s
    return out


def registry_layouts(options: dict[int, tuple[int, ...]]) -> tuple[list[int], list[tuple[int, int]]]:
    """What an executor's ``executor.groups.GroupRegistry`` must be given so that every plan made
    under these options runs: the group sizes (``group_sizes``) and the Ulysses x ring layouts
    ``(u, r)`` with ``r > 1`` (``layouts``)."""
    return list(options), sorted({(d // r, r) for d, rs in options.items() for r in rs if r > 1})


def declared_layouts(options: dict[int, tuple[int, ...]]) -> list[tuple[int, int, int]]:
    """Every ``(size, ulysses_degree, ring_degree)`` a plan made under these options may use (what
    an epoch declares, ``EpochStatus.layouts``, and an executor's registry builds), ascending."""
    return sorted((d, d // r, r) for d, rs in options.items() for r in rs)


def config_layouts(cost_model: CostModel, config: PlannerConfig) -> list[tuple[int, int, int]]:
    """:func:`declared_layouts` of a planner configuration (its layout, sizes, largest and explicit
    sizes): every layout :func:`planner.planning.plan_batch` may give a group under it."""
    return declared_layouts(layout_options(cost_model, layout=config.layout, mode=config.sizes,
                                           max_group_size=config.max_group_size, explicit=config.group_sizes))


def num_process_groups(world_size: int, layouts: Sequence[tuple[int, int, int]]) -> int:
    """Process groups an executor's registry creates for these layouts on ``world_size`` ranks,
    counted from the layouts alone (the registry counts what it creates, ``GroupRegistry.num_groups``).

    Every contiguous block of every size ``s > 1``: ``N - s + 1`` groups. A layout ``u x r`` with
    ``u, r > 1`` on each block ``f .. f + ur - 1`` (``f <= N - ur``) adds its strided rings
    ``{a, a + u, ..., a + (r - 1) u}``, ``a < N - ur + u`` (``N - ur + u`` of them, shared only by
    layouts of the same ``u`` and ``r``), and its Ulysses subgroups, the blocks of ``u`` ranks
    starting at ``f + j u`` (``j < r``), when ``u`` is not a size itself (then they are blocks of
    that size already). A pure ring (``u = 1``) and pure Ulysses (``r = 1``) add nothing: their
    groups are contiguous blocks.
    """
    sizes = {d for d, _, _ in layouts if d <= world_size}
    count = sum(world_size - s + 1 for s in sizes if s > 1)
    hybrids = {(u, r) for d, u, r in layouts if d <= world_size and u > 1 and r > 1}
    count += sum(world_size - u * r + u for u, r in hybrids)
    for u in {u for u, _ in hybrids} - sizes:
        starts = {f + j * u for v, r in hybrids if v == u for f in range(world_size - u * r + 1) for j in range(r)}
        count += len(starts)
    return count
