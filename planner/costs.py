"""Cost tables: every sample class's time and memory on every allowed group size, at once.

Samples with the same shape cost the same, so the planner works on *classes* (unique
``(frames, tokens per frame)`` shapes). For each class and allowed size ``d`` the table holds
the cheapest checkpoint policy that lets the sample fit a micro-batch on its own (``k_min``),
its time and activation bytes under that policy, and what the intra-step policy choice
(``planner.search.intra``) needs for any other policy: time and bytes at ``k = 0`` and their
change per recomputed layer (both exactly linear in ``k`` for ``0 <= k <= L - 1``; ``k = L`` is
dominated by ``L - 1``), all from ``costmodel.evaluate.CostModel``.

A size column has one attention layout (issue 25): its ring degree ``r`` (Ulysses over ``d/r``
ranks x ring over ``r``), chosen among the sizes' allowed layouts (``ring_options``, from
``planner.layouts``) as the one that holds the most samples, then the least GPU-time for them.
A ring's cost per layer call is not additive over samples (a hop carries the whole call's
block); the table charges each sample the ring it would have alone, an upper bound of its share
(the exact cost of each micro-batch is the assembler's), and keeps for the lower bounds
(:meth:`CostTable.for_bounds`) per class the least time over every allowed layout with only the
ring's parts that are additive (merges, the last hop's bytes).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from costmodel.evaluate import CostModel, GroupLayout
from costmodel.specs import Sample

INF = math.inf


def allowed_sizes(cost_model: CostModel, *, mode: str, max_group_size: int | None,
                  explicit: Sequence[int] | None) -> list[int]:
    """Group sizes the planner may use, ascending.

    Sizes are those of ``ModelSpec.allowed_group_sizes`` (Ulysses: a size divides the query
    heads, and divides the key/value heads or is a multiple of them, each key/value head then
    replicated over ``d / kv_heads`` ranks) at most the world size and ``max_group_size``;
    ``mode='pow2'`` keeps powers of two; ``explicit`` lists them directly.

    Raises:
        ValueError: naming an explicit size the model or the world does not allow.
    """
    world = cost_model.cluster.num_gpus
    limit = world if max_group_size is None else min(world, max_group_size)
    heads_ok = set(cost_model.allowed_group_sizes(max_size=limit))
    if explicit is not None:
        for d in explicit:
            if d not in heads_ok:
                model = cost_model.file.model
                raise ValueError(
                    f"group size {d} is not allowed: it must divide num_heads={model.num_heads}, "
                    f"divide kv_heads={model.kv_heads} or be a multiple of it, and be at most {limit} "
                    f"(allowed: {sorted(heads_ok)})")
        return sorted(set(explicit))
    sizes = sorted(heads_ok)
    if mode == "pow2":
        sizes = [d for d in sizes if d & (d - 1) == 0]
    return sizes


def ring_bound_weights(tokens: np.ndarray, counts: np.ndarray | None) -> np.ndarray:
    """How much each class counts when the lower bounds pick a ring column's additive form
    (``CostModel.ring_alone_exposed_s``): its samples times their attention work (``s^2``), so the
    long samples the bounds hinge on (the longest, the largest choices) keep their tighter form;
    weighting by counts alone let many short hop-bound samples pick the hop-bound form, and the
    bound of 256 text samples on Qwen3-30B-A3B fell from 3.27% to 4.32% under the plans."""
    s = np.asarray(tokens, dtype=np.float64)
    n = np.ones_like(s) if counts is None else np.asarray(counts, dtype=np.float64)
    return n * (s / max(float(s.max(initial=1.0)), 1.0)) ** 2


@dataclass(frozen=True, slots=True)
class SampleClasses:
    """The batch grouped by shape.

    Attributes:
        class_of: Class index of every sample (batch order).
        members: Sample indices of every class, in batch order.
        tokens: Tokens of every class.
        frames: Frames of every class.
        spatial: Tokens per frame of every class.
    """

    class_of: list[int]
    members: list[list[int]]
    tokens: np.ndarray
    frames: np.ndarray
    spatial: np.ndarray

    @classmethod
    def of(cls, samples: Sequence[Sample]) -> SampleClasses:
        """Group samples by ``shape_key``; classes are numbered in order of first appearance."""
        index: dict[tuple[int, int], int] = {}
        class_of: list[int] = []
        members: list[list[int]] = []
        shapes: list[tuple[int, int, int]] = []
        for i, s in enumerate(samples):
            # ``Sample.shape_key`` inlined (its two properties cost more than the loop's rest).
            f, h, w = s.frames, s.height, s.width
            key = (1 if f is None else f, s.tokens if h is None or w is None else h * w)
            c = index.get(key)
            if c is None:
                c = len(members)
                index[key] = c
                members.append([])
                shapes.append((s.tokens, key[0], key[1]))
            class_of.append(c)
            members[c].append(i)
        arr = np.array(shapes, dtype=np.float64).reshape(-1, 3)
        return cls(class_of=class_of, members=members, tokens=arr[:, 0], frames=arr[:, 1],
                   spatial=arr[:, 2])

    @property
    def num_classes(self) -> int:
        """Distinct shapes."""
        return len(self.members)


class CostTable:
    """Per class x allowed size: cheapest fitting policy, its time and bytes.

    Times are for an aligned contiguous placement (``CostModel.default_nodes``); the plan
    assembler recomputes exact numbers for the actual placement.
    """

    def __init__(self, cost_model: CostModel, samples: Sequence[Sample], *, sizes: Sequence[int],
                 memory_safety_fraction: float = 0.0, intra_policies: bool = False,
                 ring_options: Mapping[int, Sequence[int]] | None = None) -> None:
        self.cost_model = cost_model
        self.intra_policies = intra_policies
        """Whether the search prices groups with per-micro-batch policies (``search.intra``)."""
        self.samples = list(samples)
        self.classes = SampleClasses.of(self.samples)
        self.sizes = list(sizes)
        self._col_of = {d: j for j, d in enumerate(self.sizes)}
        self.num_layers = cost_model.num_layers
        # Fixed seconds of a micro-batch with one policy throughout, per size (aligned placement);
        # the search uses the smallest (a lower value keeps its bounds valid), the plan assembler
        # the exact figure of each micro-batch (its placement and mix of policies).
        # The parts of a micro-batch's fixed time (``CostModel.microbatch_fixed_s``): a constant,
        # and per layer call ``(forward + backward, forward)`` seconds for each size (filled with
        # each column's layout by ``_fill_size``).
        self.overhead_s_by_size = np.zeros(len(self.sizes))
        self.microbatch_base_s = float(cost_model.file.compute.microbatch_overhead_s)
        self.call_s_by_size = np.zeros(len(self.sizes))
        self.call_fwd_s_by_size = np.zeros(len(self.sizes))
        self.ring_options = {d: tuple(sorted((ring_options or {}).get(d, (1,)))) for d in self.sizes}
        """Ring degrees each size may take (1: pure Ulysses)."""
        self.ring_degrees = [1] * len(self.sizes)
        """The ring degree of each size column (chosen in ``_choose_layout``)."""
        self.grad_sync_s = cost_model.grad_sync_time_s()
        budget = cost_model.activation_budget_bytes()
        reserved = cost_model.reserved_budget_fraction(memory_safety_fraction)  # a forced fit's margin or the safety
        self.budget_bytes = budget * (1.0 - reserved) if budget > 0 else budget
        num_c, num_d = self.classes.num_classes, len(self.sizes)
        self.k_min = np.full((num_c, num_d), -1, dtype=np.int64)
        self.time_s = np.full((num_c, num_d), INF)
        self.mem_bytes = np.full((num_c, num_d), INF)
        # Per policy k in [0, L-1]: time = time0_s + k * recompute_s_per_layer and
        # bytes = mem0_bytes - k * saved_bytes_per_layer (read by planner.search.intra).
        self.time0_s = np.zeros((num_c, num_d))
        self.recompute_s_per_layer = np.zeros((num_c, num_d))
        self.mem0_bytes = np.zeros((num_c, num_d))
        self.saved_bytes_per_layer = np.zeros((num_c, num_d))
        self._columns: dict[int, tuple[list[float], ...]] = {}
        self._rows: tuple[list[list[float]], list[list[float]], list[list[int]]] | None = None
        self._bound_time_s = np.full((num_c, num_d), INF)
        self._bound_overhead_s = INF
        counts = np.array([len(m) for m in self.classes.members], dtype=np.float64)  # samples per class
        for j, d in enumerate(self.sizes):
            self._choose_layout(j, d, counts)
        self.overhead_s = float(self.overhead_s_by_size.min()) if self.sizes else 0.0
        self._check_finite()
        # Fastest fitting size per class (ties: smaller size).
        fits = np.isfinite(self.time_s)
        self.fits_anywhere = fits.any(axis=1)

    def _check_finite(self) -> None:
        """Refuse a cost model whose times overflow float64 on this batch (an uploaded file can
        hold coefficients near 1e308: every comparison of the search would then fail)."""
        parts = {"micro-batch fixed time": self.overhead_s_by_size, "layer call time": self.call_s_by_size,
                 "gradient sync time": np.asarray([self.grad_sync_s]),
                 "sample time": np.where(np.isfinite(self.mem_bytes), self.time_s, 0.0),
                 "recompute time": self.recompute_s_per_layer}
        bad = [name for name, values in parts.items() if not np.isfinite(values).all()]
        if bad:
            raise ValueError(f"cost model {self.cost_model.file.id!r} predicts a non-finite "
                             f"{', '.join(bad)} on this batch: its coefficients are too large to "
                             "evaluate in float64")

    _COLUMN_ARRAYS = ("k_min", "time_s", "mem_bytes", "time0_s", "recompute_s_per_layer", "mem0_bytes",
                      "saved_bytes_per_layer")
    _SIZE_ARRAYS = ("overhead_s_by_size", "call_s_by_size", "call_fwd_s_by_size")

    @property
    def has_ring(self) -> bool:
        """Whether a column may run a ring (its costs then bound a micro-batch's from above)."""
        return any(r > 1 for opts in self.ring_options.values() for r in opts)

    def ring_degree_of(self, d: int) -> int:
        """The ring degree of size ``d``'s column."""
        return self.ring_degrees[self.size_index(d)]

    def layout_of(self, d: int) -> GroupLayout | None:
        """The cost model's layout of size ``d``'s column at an aligned placement (None: pure
        Ulysses), what a baseline that runs size ``d`` at the table's layout is priced with."""
        r = self.ring_degree_of(d)
        return None if r == 1 else self.cost_model.place(first_rank=0, group_size=d, ring_degree=r)

    def _choose_layout(self, j: int, d: int, counts: np.ndarray) -> None:
        """Fill column ``j`` with each allowed layout of size ``d`` and keep the one under which the
        most samples fit, then the least GPU-time of the classes that fit under all such layouts.
        The lower bounds' view keeps the least time over every layout (``for_bounds``).
        ``counts``: samples per class (the same for every size: computed once)."""
        best: tuple[tuple[float, ...], dict[str, np.ndarray], int] | None = None
        filled = []
        for r in self.ring_options[d]:
            lower_ring_s = self._fill_size(j, d, r, counts=counts)
            col = {name: getattr(self, name)[:, j].copy() for name in self._COLUMN_ARRAYS}
            col |= {name: getattr(self, name)[j].copy() for name in self._SIZE_ARRAYS}
            filled.append((r, col))
            fits = np.isfinite(col["time_s"])
            # lower bound of any sample's time under this layout: the ring's additive parts only
            bound = np.where(fits, col["time_s"] - lower_ring_s, INF)
            self._bound_time_s[:, j] = np.minimum(self._bound_time_s[:, j], bound)
            self._bound_overhead_s = min(self._bound_overhead_s, float(col["overhead_s_by_size"]))
        most = max(float(counts[np.isfinite(col["time_s"])].sum()) for _, col in filled)
        tied = [(r, col) for r, col in filled if float(counts[np.isfinite(col["time_s"])].sum()) == most]
        common = np.logical_and.reduce([np.isfinite(col["time_s"]) for _, col in tied])
        for r, col in tied:
            area = float((counts[common] * col["time_s"][common]).sum()) * d
            key = (area, float(r))
            if best is None or key < best[0]:
                best = (key, col, r)
        assert best is not None
        _, col, r = best
        for name in self._COLUMN_ARRAYS:
            getattr(self, name)[:, j] = col[name]
        for name in self._SIZE_ARRAYS:
            getattr(self, name)[j] = col[name]
        self.ring_degrees[j] = r

    def for_bounds(self) -> CostTable:
        """This table as the lower bounds must read it: per class and size the least time over
        every allowed layout of the size, with only the additive parts of a ring (a shallow copy;
        the table itself when no size may run a ring)."""
        if not self.has_ring:
            return self
        view = copy.copy(self)
        view.time_s = self._bound_time_s
        view.overhead_s = min(self._bound_overhead_s, self.overhead_s)
        view._rows = None
        view._columns = {}
        return view

    def _fill_size(self, j: int, d: int, r: int = 1, *, counts: np.ndarray | None = None) -> np.ndarray:
        """Fill column ``j`` for size ``d`` under ring degree ``r``; returns, per class, the part of
        its time at ``k_min`` that is the ring's non-additive exposure (0 without a ring; the
        additive part's form chosen for the batch's ``counts`` per class, ``ring_alone_exposed_s``)."""
        cm, c = self.cost_model, self.classes
        layout = None if r == 1 else cm.place(first_rank=0, group_size=d, ring_degree=r)
        self.overhead_s_by_size[j] = cm.microbatch_fixed_s(group_size=d, layout=layout)
        call_f, call_b = cm.layer_call_s(group_size=d, layout=layout)
        self.call_s_by_size[j], self.call_fwd_s_by_size[j] = call_f + call_b, call_f
        layers = self.num_layers
        # Bytes at k = 0, L and 1 in one evaluation (rows of a broadcast: the same numbers).
        act0, act_full, act1 = cm.activation_bytes(
            c.tokens, group_size=d, recompute_layers=np.array([[0.0], [layers], [1.0]]), layout=layout)
        k = np.zeros(len(c.tokens), dtype=np.int64)
        need = act0 > self.budget_bytes
        if need.any() and layers >= 1:
            slope = (act1 - act_full) / max(layers - 1, 1)  # bytes saved per extra layer
            with np.errstate(divide="ignore", invalid="ignore"):
                est = np.where(slope > 0, np.ceil((act1 - self.budget_bytes) / slope) + 1, 1)
            est = np.clip(np.nan_to_num(est, nan=1.0), 1, layers).astype(np.int64)
            k = np.where(need, est, 0)
            # Correct the estimate against the cost model itself (floating-point edges).
            for _ in range(3):
                act = cm.activation_bytes(c.tokens, group_size=d, recompute_layers=k, layout=layout)
                up = need & (act > self.budget_bytes) & (k < layers)
                if not up.any():
                    break
                k = np.where(up, k + 1, k)
            while True:
                lower = np.maximum(k - 1, 1)
                act_lower = cm.activation_bytes(c.tokens, group_size=d, recompute_layers=lower, layout=layout)
                down = need & (k > 1) & (act_lower <= self.budget_bytes)
                if not down.any():
                    break
                k = np.where(down, lower, k)
        act = cm.activation_bytes(c.tokens, group_size=d, recompute_layers=k, layout=layout)
        ok = act <= self.budget_bytes
        # Seconds at k_min, 0 and 1 in one evaluation.
        t, t0, t1 = cm.sample_time_s(
            c.tokens, group_size=d, frames=c.frames, spatial=c.spatial,
            recompute_layers=np.stack([k.astype(np.float64), np.zeros(len(k)), np.ones(len(k))]), layout=layout)
        ring_s = np.zeros(len(k))
        if layout is not None:
            # each sample's ring alone (an upper bound of its share in a call), exactly linear in
            # k: L x (forward + backward) plus one forward per recomputed layer
            exp = np.stack(cm.ring_alone_exposed_s(c.tokens, layout=layout), axis=1)
            # the additive part (a lower bound of each sample's share of any call it is in)
            lower = np.stack(cm.ring_alone_exposed_s(c.tokens, layout=layout, additive_only=True,
                                                     weights=ring_bound_weights(c.tokens, counts)), axis=1)
            per_k = exp[:, 0]
            t0 = t0 + layers * exp.sum(axis=1)
            t1 = t1 + layers * exp.sum(axis=1) + per_k
            t = t + layers * exp.sum(axis=1) + k * per_k
            ring_s = layers * (exp - lower).sum(axis=1) + k * (exp[:, 0] - lower[:, 0])
            ok &= c.tokens >= 2 * r  # the zig-zag cuts every sample into 2r chunks
        self.k_min[:, j] = np.where(ok, k, -1)
        self.time_s[:, j] = np.where(ok, t, INF)
        self.mem_bytes[:, j] = np.where(ok, act, INF)
        self.time0_s[:, j] = t0
        self.recompute_s_per_layer[:, j] = t1 - t0
        self.mem0_bytes[:, j] = act0
        self.saved_bytes_per_layer[:, j] = act0 - act1 if layers >= 2 else 0.0
        return np.asarray(ring_s, dtype=np.float64)

    def column(self, j: int) -> tuple[list[float], ...]:
        """Per-class rows of size column ``j`` as lists (cached): ``(time0_s,
        recompute_s_per_layer, mem0_bytes, saved_bytes_per_layer, time_s, mem_bytes, k_min)``."""
        col = self._columns.get(j)
        if col is None:
            col = (self.time0_s[:, j].tolist(), self.recompute_s_per_layer[:, j].tolist(),
                   self.mem0_bytes[:, j].tolist(), self.saved_bytes_per_layer[:, j].tolist(),
                   self.time_s[:, j].tolist(), self.mem_bytes[:, j].tolist(),
                   self.k_min[:, j].astype(np.float64).tolist())
            self._columns[j] = col
        return col

    def rows(self) -> tuple[list[list[float]], list[list[float]], list[list[int]]]:
        """Per class, over every size column (cached): time and bytes at ``k_min`` and the
        rank of each size by GPU-seconds (0: the most efficient; ties by column)."""
        if self._rows is None:
            sizes = np.asarray(self.sizes, dtype=np.float64)
            area = self.time_s * sizes[None, :]
            rank = np.argsort(np.argsort(area, axis=1, kind="stable"), axis=1, kind="stable")
            self._rows = (self.time_s.tolist(), self.mem_bytes.tolist(), rank.tolist())
        return self._rows

    def size_index(self, d: int) -> int:
        """Column of group size ``d``.

        Raises:
            ValueError: if ``d`` is not an allowed size.
        """
        col = self._col_of.get(d)
        if col is None:
            raise ValueError(f"group size {d} is not among the allowed sizes {self.sizes}")
        return col

    def sample_time(self, i: int, j: int) -> float:
        """Time of sample ``i`` at size column ``j`` under its ``k_min`` (inf if it cannot fit)."""
        return float(self.time_s[self.classes.class_of[i], j])

    def sample_mem(self, i: int, j: int) -> float:
        """Activation bytes of sample ``i`` at size column ``j`` under its ``k_min``."""
        return float(self.mem_bytes[self.classes.class_of[i], j])

    def policy(self, i: int, j: int) -> int:
        """``k_min`` of sample ``i`` at size column ``j`` (-1 if it cannot fit)."""
        return int(self.k_min[self.classes.class_of[i], j])

    def smallest_fitting_size(self, i: int) -> int | None:
        """Smallest allowed size on which sample ``i`` fits (any policy), or None."""
        row = self.k_min[self.classes.class_of[i]]
        for j, d in enumerate(self.sizes):
            if row[j] >= 0:
                return d
        return None
