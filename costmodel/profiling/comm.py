"""Communication profile: ``all_to_all_single``, ``all_reduce`` and ring hops over every group size.

Run on every rank of an initialised ``torch.distributed`` world (``dcp profile-comm`` under
``torchrun``: gloo on CPU, NCCL on GPU). Groups are contiguous ranks; for each size ``d`` the
world is tiled from rank 0 with groups ``[0, d), [d, 2d), ...`` (ranks left over sit idle), and
every group is created once, up front, in the same order on every rank. All groups of one size
run at the same time, as they do in training. Each rank times each operation after a group
barrier, interleaving the (op, message size) points round by round; a record's time is the
slowest rank's median (and the slowest rank's min and max).

``p2p`` (op ``p2p``) is one hop of ring attention (``executor/ring.py``): every rank of a group
sends its message to the next rank and receives as much from the previous one, in one
``batch_isend_irecv`` (gloo and NCCL); ``costmodel.ring.fit_p2p`` fits its intra- and inter-node
links. ``ring_step`` is that hop as a ring step runs it: posted, a matrix product of
``ring_compute_dims`` computed meanwhile, then waited for; each round also times the hop alone
and the product alone, so a record carries all three (``costmodel.ring.fit`` fits the share of the
shorter one the overlap does not hide, and the fixed cost per step).

A group's placement comes from the nodes it spans: ranks are put on nodes by host name (or by
``gpus_per_node`` when given, e.g. to emulate several nodes on one machine).
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from costmodel.profiling.format import CommRecord
from costmodel.profiling.sweep import log_sizes

logger = logging.getLogger(__name__)

ELEMENT_BYTES = 4  # float32 messages


@dataclass(kw_only=True, frozen=True, slots=True)
class CommSweepConfig:
    """What the communication sweep runs."""

    bytes_min: int = 64 * 1024
    """Smallest message per rank in bytes."""
    bytes_max: int = 8 * 1024 * 1024
    """Largest message per rank in bytes."""
    num_sizes: int = 6
    """Log-spaced message sizes."""
    ops: tuple[str, ...] = ("alltoall", "allreduce")
    """Operations to measure: ``alltoall``, ``allreduce``, ``p2p`` (a ring hop), ``ring_step`` (a
    hop beside a computation)."""
    ring_compute_dims: tuple[int, ...] = (128, 256, 512)
    """``ring_step``: sizes ``n`` of the ``n x n`` products computed beside each hop (varied, so the
    records span hops shorter and longer than the computation)."""
    group_sizes: tuple[int, ...] = ()
    """Group sizes; empty = every size from 2 to the world size."""
    gpus_per_node: int = 0
    """Ranks per node; 0 = detect from host names."""
    warmup: int = 3
    """Untimed operations per point."""
    repeats: int = 10
    """Timed operations per point."""
    clock: Literal["wall", "thread"] = "wall"
    """``wall``: elapsed time; ``thread``: the calling thread's CPU time (CPU only: what an
    operation costs the rank's compute thread, its waits and gloo's own threads excluded)."""

    def __post_init__(self) -> None:
        if not 0 < self.bytes_min <= self.bytes_max:
            raise ValueError(f"need 0 < bytes_min <= bytes_max, got {self.bytes_min}, {self.bytes_max}")
        if self.num_sizes < 1 or self.repeats < 1 or self.warmup < 0 or self.gpus_per_node < 0:
            raise ValueError(
                f"need num_sizes >= 1, repeats >= 1, warmup >= 0, gpus_per_node >= 0; got "
                f"{self.num_sizes}, {self.repeats}, {self.warmup}, {self.gpus_per_node}"
            )
        if self.clock not in ("wall", "thread"):
            raise ValueError(f"clock must be wall or thread, got {self.clock!r}")
        unknown = set(self.ops) - {"alltoall", "allreduce", "p2p", "ring_step"}
        if unknown or not self.ops:
            raise ValueError(f"ops must be among alltoall, allreduce, p2p and ring_step, got {self.ops}")
        if not self.ring_compute_dims or any(n < 1 for n in self.ring_compute_dims):
            raise ValueError(f"ring_compute_dims must be positive sizes, got {self.ring_compute_dims}")
        if any(d < 2 for d in self.group_sizes):
            raise ValueError(f"group sizes must be >= 2, got {self.group_sizes}")


@dataclass(frozen=True, slots=True)
class _Group:
    size: int
    ranks: tuple[int, ...]
    num_nodes: int
    handle: Any


def node_of_ranks(world_size: int, gpus_per_node: int) -> list[int]:
    """Node index of every rank: by ``gpus_per_node`` if positive, else by gathered host names."""
    if gpus_per_node > 0:
        return [r // gpus_per_node for r in range(world_size)]
    hosts: list[Any] = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    order: dict[str, int] = {}
    return [order.setdefault(h, len(order)) for h in hosts]


def create_groups(config: CommSweepConfig) -> list[_Group]:
    """Every contiguous group of every size, created in the same order on every rank."""
    world = dist.get_world_size()
    sizes = sorted(set(config.group_sizes)) or list(range(2, world + 1))
    too_big = [d for d in sizes if d > world]
    if too_big:
        raise ValueError(f"group sizes {too_big} exceed the world size {world}")
    nodes = node_of_ranks(world, config.gpus_per_node)
    groups = []
    for d in sizes:
        for start in range(0, world - d + 1, d):
            ranks = tuple(range(start, start + d))
            handle = dist.new_group(list(ranks))
            groups.append(_Group(d, ranks, len({nodes[r] for r in ranks}), handle))
    return groups


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_points(points: list[tuple[str, int]], group: _Group, *, device: torch.device,
                 config: CommSweepConfig) -> list[tuple[float, float, float]]:
    """(median, min, max) seconds of each ``(op, numel)`` point on this rank's group.

    Points are interleaved: every round runs each point once (after a group barrier), so that a
    busy period of the machine is spread over all points.
    """
    buffers = [(torch.ones(numel, dtype=torch.float32, device=device),
                torch.empty(numel, dtype=torch.float32, device=device)) for _, numel in points]

    def run(i: int) -> None:
        send, recv = buffers[i]
        if points[i][0] == "alltoall":
            dist.all_to_all_single(recv, send, group=group.handle)
        elif points[i][0] == "p2p":
            _ring_hop(send, recv, group)
        else:
            dist.all_reduce(send, group=group.handle)

    for i in range(len(points)):
        for _ in range(config.warmup):
            run(i)
    _sync(device)
    times: list[list[float]] = [[] for _ in points]
    now = time.thread_time if config.clock == "thread" and device.type == "cpu" else time.perf_counter
    for _ in range(config.repeats):
        for i in range(len(points)):
            dist.barrier(group=group.handle)
            _sync(device)
            t0 = now()
            run(i)
            _sync(device)
            times[i].append(max(now() - t0, 1e-9))
    return [(statistics.median(t), min(t), max(t)) for t in times]


def _ring_hop(send: torch.Tensor, recv: torch.Tensor, group: _Group) -> None:
    """One ring hop: send to the next rank of the group, receive from the previous one."""
    me = group.ranks.index(dist.get_rank())
    d = group.size
    ops = [dist.P2POp(dist.isend, send, group.ranks[(me + 1) % d], group.handle),
           dist.P2POp(dist.irecv, recv, group.ranks[(me - 1) % d], group.handle)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()


def _time_ring_steps(points: list[tuple[int, int]], group: _Group, *, device: torch.device,
                     config: CommSweepConfig) -> list[tuple[float, float, float, float, float]]:
    """``(step median, step min, step max, hop median, compute median)`` of each ``(numel, n)``
    point: the hop of ``numel`` floats beside an ``n x n`` product, the hop alone, the product
    alone, interleaved round by round after a group barrier."""
    hops = [(torch.ones(numel, dtype=torch.float32, device=device),
             torch.empty(numel, dtype=torch.float32, device=device)) for numel, _ in points]
    mats = {n: torch.randn(n, n, dtype=torch.float32, device=device) for _, n in points}
    me = group.ranks.index(dist.get_rank())

    def post(i: int) -> list[Any]:
        send, recv = hops[i]
        ops = [dist.P2POp(dist.isend, send, group.ranks[(me + 1) % group.size], group.handle),
               dist.P2POp(dist.irecv, recv, group.ranks[(me - 1) % group.size], group.handle)]
        return list(dist.batch_isend_irecv(ops))

    def hop(i: int) -> None:
        for req in post(i):
            req.wait()

    def compute(i: int) -> None:
        m = mats[points[i][1]]
        torch.mm(m, m)

    def step(i: int) -> None:
        reqs = post(i)
        compute(i)
        for req in reqs:
            req.wait()

    kinds = (step, hop, compute)
    for i in range(len(points)):
        for _ in range(config.warmup):
            for run in kinds:
                run(i)
    _sync(device)
    times: list[list[list[float]]] = [[[], [], []] for _ in points]
    now = time.thread_time if config.clock == "thread" and device.type == "cpu" else time.perf_counter
    for _ in range(config.repeats):
        for i in range(len(points)):
            for j, run in enumerate(kinds):
                dist.barrier(group=group.handle)
                _sync(device)
                t0 = now()
                run(i)
                _sync(device)
                times[i][j].append(max(now() - t0, 1e-9))
    return [(statistics.median(t[0]), min(t[0]), max(t[0]), statistics.median(t[1]), statistics.median(t[2]))
            for t in times]


def run_comm_sweep(config: CommSweepConfig, *, device: torch.device,
                   progress: Callable[[int, int, str], None] | None = None) -> list[CommRecord]:
    """Measure the sweep on this rank; returns the records on rank 0 (an empty list elsewhere).

    Raises:
        ValueError: when the world has a single rank or a group size exceeds it.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        raise ValueError("profile-comm needs at least 2 ranks (run it under torchrun)")
    groups = create_groups(config)
    sizes = sorted({g.size for g in groups})
    byte_counts = log_sizes(config.bytes_min, config.bytes_max, config.num_sizes)
    backend = str(dist.get_backend())
    records: list[CommRecord] = []
    for step, d in enumerate(sizes):
        of_size = [g for g in groups if g.size == d]
        # all-to-all splits evenly: a multiple of d elements
        points = [(op, max(d, nbytes // ELEMENT_BYTES // d * d) if op != "p2p" else max(1, nbytes // ELEMENT_BYTES))
                  for op in config.ops if op != "ring_step" for nbytes in byte_counts]
        ring_points = [(max(1, nbytes // ELEMENT_BYTES), n) for nbytes in byte_counts
                       for n in config.ring_compute_dims] if "ring_step" in config.ops else []
        stats = torch.zeros(len(points), len(of_size), 3, dtype=torch.float64, device=device)
        ring_stats = torch.zeros(len(ring_points), len(of_size), 5, dtype=torch.float64, device=device)
        dist.barrier()
        for j, group in enumerate(of_size):
            if rank in group.ranks:
                if points:
                    measured = _time_points(points, group, device=device, config=config)
                    stats[:, j] = torch.tensor(measured, dtype=torch.float64, device=device)
                if ring_points:
                    steps = _time_ring_steps(ring_points, group, device=device, config=config)
                    ring_stats[:, j] = torch.tensor(steps, dtype=torch.float64, device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank of each group
        dist.all_reduce(ring_stats, op=dist.ReduceOp.MAX)
        if progress is not None and rank == 0:
            progress(step + 1, len(sizes), f"group size {d}: {len(points)} points")
        if rank != 0:
            continue
        host = stats.cpu()
        for i, (op, numel) in enumerate(points):
            for j, group in enumerate(of_size):
                median, lo, hi = (float(v) for v in host[i, j].tolist())
                records.append(CommRecord(
                    op=op, group_size=d, num_nodes=group.num_nodes,  # type: ignore[arg-type]
                    bytes_per_rank=float(numel * ELEMENT_BYTES), time_s=median, time_s_min=lo,
                    time_s_max=hi, num_repeats=config.repeats, backend=backend,
                ))
        ring_host = ring_stats.cpu()
        for i, (numel, _) in enumerate(ring_points):
            for j, group in enumerate(of_size):
                median, lo, hi, hop_s, compute_s = (float(v) for v in ring_host[i, j].tolist())
                records.append(CommRecord(
                    op="ring_step", group_size=d, num_nodes=group.num_nodes,
                    bytes_per_rank=float(numel * ELEMENT_BYTES),
                    time_s=median, time_s_min=lo, time_s_max=hi, num_repeats=config.repeats, backend=backend,
                    compute_s=compute_s, hop_s=hop_s))
    logger.info("rank %d: communication sweep of %d group sizes done", rank, len(sizes))
    return records
