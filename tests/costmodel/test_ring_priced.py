"""The cost model prices Ulysses x ring groups (issue 25): the evaluator's time and memory of a
ring plan against sums worked out here from the file's coefficients, pure-Ulysses numbers
unchanged, p2p links in the cost-model file (round trip, old files, ``dcp fit``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from costmodel.evaluate import CostModel, GroupLayout
from costmodel.fit import fit_profiles
from costmodel.presets import load_hardware, load_model
from costmodel.profiling.format import CommRecord
from costmodel.schema import CostModelFile, LinkFit, P2PLinks, RingCoefficients
from costmodel.specs import Sample
from planner.plan import GroupPlan, LossNormalizer, LowerBound, MicroBatch, Plan, PlannedSample, SolverInfo
from planner.timeline import step_timeline
from planner.validate import simulate, validate_plan
from tests.costmodel.test_fit_synthetic import synthetic_profile
from tests.planner.tiny import tiny_cluster, tiny_cost_model

# Slow links, so that the hops of the tiny model's rings are not hidden by their attention.
LINKS = P2PLinks(intra=LinkFit(placement="intra", group_size=2, num_nodes=1, alpha_s=1e-5, bytes_per_s=1e8),
                 inter=LinkFit(placement="inter", group_size=2, num_nodes=2, alpha_s=4e-5, bytes_per_s=2e7))


def _cost_model(*, gpus: int = 8, gpn: int = 4) -> CostModel:
    file = tiny_cost_model(num_heads=4)
    file = file.model_copy(update={"comm": file.comm.model_copy(update={"p2p": LINKS})})
    return CostModel(file=file, cluster=tiny_cluster(num_gpus=gpus, gpus_per_node=gpn, hbm_bytes=1e12))


# The tiny model's coefficients (tests/planner/tiny.py), written out: 3 layers, 4 heads of 16.
L, HEADS, HEAD_DIM = 3, 4, 16
FWD = {"tok": 2e-6, "pair": 1e-9, "sample": 2e-4}
BWD = {"tok": 4e-6, "pair": 2.5e-9, "sample": 2e-4}
OVERHEAD_S, A2A_BYTES, A2A_OPS = 1.5e-3, 200.0, 4
A2A_INTRA = (5e-5, 1e9)
HBM = 1e12


def _hand_ring(tokens: list[int], *, u: int, r: int, crosses: bool) -> tuple[float, float]:
    """Exposed (forward, backward) seconds of one layer call's ring, by hand."""
    alpha, bw = (4e-5, 2e7) if crosses else (1e-5, 1e8)
    kv_bytes = 2 * max(HEADS / u, 1) * HEAD_DIM * 2  # k and v, bf16, this rank's heads
    pairs = sum(s * s for s in tokens) / (u * r * r)
    block = sum(tokens) / r
    f_blk, b_blk = FWD["pair"] * pairs, BWD["pair"] * pairs
    hop, hop2 = alpha + block * kv_bytes / bw, alpha + 2 * block * kv_bytes / bw
    merges = (r - 1) * block * (HEADS // u * HEAD_DIM) * 12 / HBM
    # a step: max(c, h) + exposed_fraction * min(c, h) + step_overhead_s (the published defaults)
    phi, step = RingCoefficients().exposed_fraction, RingCoefficients().step_overhead_s
    fwd = (r - 1) * (max(f_blk, hop) + phi * min(f_blk, hop) + step) + f_blk + step + merges
    bwd = (r - 1) * (max(b_blk, hop2) + phi * min(b_blk, hop2) + step) + b_blk + step + hop
    return fwd - r * f_blk, bwd - r * b_blk


def _hand_microbatch_s(tokens: list[int], ks: list[int], *, u: int, r: int, crosses: bool) -> float:
    d = u * r
    a2a_s_per_token = A2A_BYTES * (u - 1) / u / A2A_INTRA[1] if u > 1 else 0.0
    call = A2A_OPS * A2A_INTRA[0] if u > 1 else 0.0  # every call's all-to-all latency, per pass
    total = OVERHEAD_S + (L + max(ks) - min(ks)) * 2 * call + max(ks) * call
    for s, k in zip(tokens, ks, strict=True):
        f = FWD["tok"] * s / d + FWD["pair"] * s * s / d + FWD["sample"]
        b = BWD["tok"] * s / d + BWD["pair"] * s * s / d + BWD["sample"]
        total += L * (f + b) + k * f + (2 * L + k) * a2a_s_per_token * s / d
    for layer in range(L):  # a layer splits its samples by checkpoint flag, each call its own ring
        kept = [s for s, k in zip(tokens, ks, strict=True) if k > layer]
        plain = [s for s, k in zip(tokens, ks, strict=True) if k <= layer]
        for part, passes in ((kept, 2), (plain, 1)):  # a checkpointed call reruns its forward
            if part:
                ef, eb = _hand_ring(part, u=u, r=r, crosses=crosses)
                total += passes * ef + eb
    return total


def _plan(cm: CostModel, groups: list[tuple[int, int, int, list[list[tuple[Sample, int]]]]]) -> Plan:
    """A plan of ``(first_rank, size, ring_degree, micro-batches)`` with the cost model's numbers."""
    out = []
    for first, size, r, mbs in groups:
        layout = None if r == 1 else cm.place(first_rank=first, group_size=size, ring_degree=r)
        planned = []
        for mb in mbs:
            samples, ks = [s for s, _ in mb], [k for _, k in mb]
            t = cm.microbatch_time_s(samples, group_size=size, recompute_layers=ks, layout=layout)
            peak = cm.microbatch_peak_bytes(samples, group_size=size, recompute_layers=ks, layout=layout)
            planned.append(MicroBatch(samples=[PlannedSample(sample=s, recompute_layers=k, predicted_time_s=0.0,
                                                             predicted_activation_bytes=0.0) for s, k in mb],
                                      predicted_time_s=t, predicted_peak_mem_bytes=peak))
        out.append(GroupPlan(ranks=list(range(first, first + size)), micro_batches=planned,
                             predicted_time_s=sum(m.predicted_time_s for m in planned),
                             predicted_peak_mem_bytes=max((m.predicted_peak_mem_bytes for m in planned),
                                                          default=cm.fixed_bytes()),
                             ring_degree=r))
    slowest = max(g.predicted_time_s for g in out)
    sync = cm.grad_sync_time_s()
    all_samples = [s for *_, mbs in groups for mb in mbs for s, _ in mb]
    return Plan(num_ranks=cm.cluster.num_gpus, groups=out, predicted_step_time_s=slowest + sync,
                grad_sync_time_s=sync, lower_bound=LowerBound(value_s=0.0, kind="none"),
                solver=SolverInfo(status="HEURISTIC", method="hand", wall_time_s=0.0),
                loss_normalizer=LossNormalizer(kind="tokens", total=sum(s.tokens for s in all_samples)),
                cost_model_id=cm.file.id, cluster_name=cm.cluster.name)


def test_ring_plan_time_is_the_hand_sum_and_valid() -> None:
    cm = _cost_model()
    a, b, c = Sample(id="a", tokens=2048), Sample(id="b", tokens=1024), Sample(id="c", tokens=640)
    plan = _plan(cm, [(0, 4, 2, [[(a, 0), (b, 0)], [(c, 1), (b.model_copy(update={"id": "b2"}), 0)]]),
                      (4, 4, 4, [[(Sample(id="d", tokens=4096), 2)]])])
    report = simulate(plan, cm)
    # group 0: 2 x 2 inside node 0 (Ulysses pairs [0,1], [2,3]; the ring stays in the node)
    mb0 = _hand_microbatch_s([2048, 1024], [0, 0], u=2, r=2, crosses=False)
    mb1 = _hand_microbatch_s([640, 1024], [1, 0], u=2, r=2, crosses=False)
    spans = report.timelines[0].spans
    assert spans[0].end_s - spans[0].start_s == pytest.approx(mb0, rel=1e-12)
    assert spans[1].end_s - spans[1].start_s == pytest.approx(mb1, rel=1e-12)
    # group 1: a pure ring of 4 inside node 1
    only = report.timelines[1].spans[0]
    assert only.end_s - only.start_s == pytest.approx(
        _hand_microbatch_s([4096], [2], u=1, r=4, crosses=False), rel=1e-12)
    samples = [ps.sample for g in plan.groups for mb in g.micro_batches for ps in mb.samples]
    assert validate_plan(plan, samples, cost_model=cm) == []
    # the timeline's parts add up to the same times, the ring's share apart
    tl = step_timeline(plan, cm)
    seg = tl.groups[0].micro_batches[0]
    assert seg.time_s == pytest.approx(mb0, rel=1e-12) and seg.ring_s > 0
    assert tl.totals_rank_s()["ring"] > 0


def test_ring_across_nodes_pays_the_inter_node_link() -> None:
    cm = _cost_model(gpus=8, gpn=4)
    s = [Sample(id="x", tokens=4096)]
    across = cm.place(first_rank=0, group_size=8, ring_degree=2)
    assert (across.ulysses_degree, across.alltoall_nodes, across.ring_crosses_nodes) == (4, 1, True)
    got = cm.microbatch_time_s(s, group_size=8, recompute_layers=[0], layout=across)
    assert got == pytest.approx(_hand_microbatch_s([4096], [0], u=4, r=2, crosses=True), rel=1e-12)
    inside = GroupLayout(ulysses_degree=4, ring_degree=2, alltoall_nodes=1, ring_crosses_nodes=False)
    assert got > cm.microbatch_time_s(s, group_size=8, recompute_layers=[0], layout=inside)


def test_ring_degree_one_is_todays_ulysses() -> None:
    cm = _cost_model()
    samples = [Sample(id="a", tokens=3000), Sample(id="b", tokens=700)]
    for first, d in ((0, 2), (0, 4), (0, 8), (2, 2)):
        layout = cm.place(first_rank=first, group_size=d, ring_degree=1)
        nodes = layout.alltoall_nodes
        for ks in ([0, 0], [3, 1]):
            assert cm.microbatch_time_s(samples, group_size=d, recompute_layers=ks, num_nodes=nodes) == \
                cm.microbatch_time_s(samples, group_size=d, recompute_layers=ks, layout=layout)
            assert cm.microbatch_peak_bytes(samples, group_size=d, recompute_layers=ks) == \
                cm.microbatch_peak_bytes(samples, group_size=d, recompute_layers=ks, layout=layout)
            assert cm.ring_exposed_s([3000, 700], ks, layout=layout) == 0.0


def test_ring_peak_memory_adds_its_key_value_buffers() -> None:
    cm = _cost_model()
    samples = [Sample(id="a", tokens=3000), Sample(id="b", tokens=1000)]
    for u, r in ((2, 2), (1, 4)):
        layout = cm.place(first_rank=0, group_size=4, ring_degree=r)
        ring = cm.microbatch_peak_bytes(samples, group_size=4, recompute_layers=[1, 0], layout=layout)
        ulysses = cm.microbatch_peak_bytes(samples, group_size=4, recompute_layers=[1, 0])
        kv_bytes = 2 * (HEADS / u) * HEAD_DIM * 2  # 4 kv heads: no replication at u <= 4
        assert ring - ulysses == pytest.approx(4 * 4000 / r * kv_bytes, rel=1e-12)


def test_layout_must_match_the_group() -> None:
    cm = _cost_model()
    with pytest.raises(ValueError, match="does not multiply to the group size 8"):
        cm.microbatch_time_s([Sample(id="a", tokens=64)], group_size=8, recompute_layers=[0],
                             layout=GroupLayout(ulysses_degree=2, ring_degree=2))
    with pytest.raises(ValueError, match="ring_degree=3 does not divide the group size 4"):
        cm.place(first_rank=0, group_size=4, ring_degree=3)


def test_cost_model_file_round_trips_with_p2p_links(tmp_path: Path) -> None:
    file = _cost_model().file
    path = tmp_path / "cm.json"
    file.save(path)
    back = CostModelFile.load(path)
    assert back == file and back.digest() == file.digest() and back.comm.p2p == LINKS
    # a file written before p2p links: no key, same digest as before, the hardware's links
    old = tiny_cost_model(num_heads=4)
    assert "p2p" not in json.loads(old.model_dump_json())["comm"]
    old_path = tmp_path / "old.json"
    old_path.write_text(old.model_dump_json())
    loaded = CostModelFile.load(old_path)
    assert loaded.comm.p2p is None
    cm = CostModel(file=loaded, cluster=tiny_cluster(num_gpus=8, gpus_per_node=4))
    hw = cm.cluster.hardware
    assert cm.p2p_links.intra.bytes_per_s == hw.nvlink_bytes_per_s_per_direction
    assert cm.p2p_links.inter is not None and cm.p2p_links.inter.bytes_per_s == hw.network_bytes_per_s_per_gpu


def test_fit_fits_p2p_links_and_checks_them_on_their_records() -> None:
    profile = synthetic_profile(load_model("llama-7b"), noise=0.0)
    alpha, bw = 8e-6, 3e11
    p2p = [CommRecord(op="p2p", group_size=2, num_nodes=1, bytes_per_rank=b, time_s=alpha + b / bw,
                      time_s_min=alpha + b / bw, time_s_max=alpha + b / bw, num_repeats=1)
           for b in (1e5, 1e6, 1e7, 1e8)]
    result = fit_profiles([profile.model_copy(update={"comm": [*profile.comm, *p2p]})])
    links = result.file.comm.p2p
    assert links is not None
    assert links.intra.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert links.intra.bytes_per_s == pytest.approx(bw, rel=1e-6)
    # no inter-node records: the profile hardware's analytic link, said in the notes
    assert links.inter is not None
    assert links.inter.bytes_per_s == load_hardware("h200-sxm").network_bytes_per_s_per_gpu
    assert "p2p inter: not measured" in result.file.notes
    assert result.file.fit_quality["p2p"].mape < 1e-9 and result.file.fit_quality["p2p"].num_points == 4
    # without p2p records nothing changes
    assert fit_profiles([profile]).file.comm.p2p is None


def test_each_sample_alone_is_the_ring_of_a_one_sample_call() -> None:
    cm = _cost_model()
    tokens = [64, 640, 2048, 4096]
    for first, d, r in ((0, 4, 2), (0, 4, 4), (0, 8, 2), (2, 4, 4)):
        layout = cm.place(first_rank=first, group_size=d, ring_degree=r)
        exp_f, exp_b = cm.ring_alone_exposed_s(tokens, layout=layout)
        low_f, low_b = cm.ring_alone_exposed_s(tokens, layout=layout, additive_only=True)
        for s, f, b, lf, lb in zip(tokens, exp_f, exp_b, low_f, low_b, strict=True):
            one = cm.ring_layer_time([s], layout=layout)
            assert (f, b) == pytest.approx((one.exposed_forward_s, one.exposed_backward_s), rel=1e-12)
            assert 0 < lf <= f and 0 < lb <= b
        # the additive part bounds a shared call from below: the samples' parts sum under it
        both = cm.ring_layer_time(tokens, layout=layout)
        assert sum(low_f) <= both.exposed_forward_s * (1 + 1e-12)
        assert sum(low_b) <= both.exposed_backward_s * (1 + 1e-12)
        assert both.exposed_forward_s <= sum(exp_f) * (1 + 1e-12)  # alone: an upper bound
