"""The ring's cost function (costmodel/ring/) and the p2p profile it is fitted on.

Hand-computed step times (compute-bound and transfer-bound rings), the ring's compute adding up
to the Ulysses pairs of the same group, p2p links recovered exactly from records made by the
formula, and ``dcp profile-comm --ops p2p`` under torchrun on 4 gloo ranks (2 emulated nodes)
fitted and checked on the records it was fitted on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from costmodel.evaluate import CostModel
from costmodel.profiling.format import CommRecord, read_profile
from costmodel.ring import (
    P2PLinks,
    RingCoefficients,
    default_p2p_links,
    fit_p2p,
    kv_bytes_per_token,
    p2p_time_s,
    ring_attention_time_s,
    ring_kv_buffer_bytes,
    ring_layer_time_s,
    step_s,
)
from costmodel.schema import LinkFit
from tests.planner.tiny import TINY_HW, tiny_cluster, tiny_cost_model

LINKS = P2PLinks(intra=LinkFit(placement="intra", group_size=2, num_nodes=1, alpha_s=1e-5, bytes_per_s=1e9),
                 inter=LinkFit(placement="inter", group_size=2, num_nodes=2, alpha_s=3e-5, bytes_per_s=1e8))


RING = RingCoefficients(exposed_fraction=0.25, step_overhead_s=5e-6)
IDEAL = RingCoefficients(exposed_fraction=0.0, step_overhead_s=0.0)


def _ring(tokens: list[int], *, r: int, u: int = 1, kv: float = 100.0, crosses: bool = False,
          ring: RingCoefficients = RING, block=None) -> tuple[float, float, float, float]:  # type: ignore[no-untyped-def]
    return ring_attention_time_s(tokens, ulysses_degree=u, ring_degree=r, forward_s_per_pair=1e-9,
                                 backward_s_per_pair=2e-9, kv_bytes_per_token=kv, query_channels=64,
                                 links=LINKS, crosses_nodes=crosses, hbm_bytes_per_s=1e12, ring=ring,
                                 block_multipliers=block)


def test_compute_bound_ring_hides_most_of_its_hops() -> None:
    # 4,096 tokens on a ring of 4: a block is 1,024 tokens, 4,096^2/16 = 1,048,576 pairs per step
    fwd, bwd, exp_f, exp_b = _ring([4096], r=4)
    block = 4096**2 / 16 * 1e-9
    hop, hop2 = 1e-5 + 1024 * 100 / 1e9, 1e-5 + 2 * 1024 * 100 / 1e9
    assert hop2 < block  # the hops hide under the block's attention, but for a quarter of them
    merges = 3 * 1024 * 64 * 12 / 1e12
    # 3 steps of max(c, h) + 0.25 min(c, h) + 5 us, the last block and its 5 us, the merges
    assert fwd == pytest.approx(3 * (block + 0.25 * hop + 5e-6) + block + 5e-6 + merges, rel=1e-12)
    assert exp_f == pytest.approx(3 * 0.25 * hop + 4 * 5e-6 + merges, rel=1e-9)
    assert bwd == pytest.approx(3 * (2 * block + 0.25 * hop2 + 5e-6) + 2 * block + 5e-6 + hop, rel=1e-12)
    assert exp_b == pytest.approx(3 * 0.25 * hop2 + 4 * 5e-6 + hop, rel=1e-9)
    # an ideal overlap (the published defaults at 0): only the merges and the hop home are exposed
    _, _, ideal_f, ideal_b = _ring([4096], r=4, ring=IDEAL)
    assert (ideal_f, ideal_b) == pytest.approx((merges, hop), rel=1e-9)


def test_transfer_bound_ring_pays_its_hops_across_nodes() -> None:
    fwd, _, exp_f, _ = _ring([4096], r=4, kv=4096.0, crosses=True)
    block = 4096**2 / 16 * 1e-9
    hop = 3e-5 + 1024 * 4096 / 1e8
    assert hop > block
    assert fwd == pytest.approx(3 * (hop + 0.25 * block + 5e-6) + block + 5e-6 + 3 * 1024 * 64 * 12 / 1e12,
                                rel=1e-12)
    assert exp_f > 3 * (hop - block) * 0.999


def test_a_ring_step_runs_its_block_at_the_blocks_efficiency() -> None:
    """Each step's kernel on a 1,024-token block at 1.5x the time per pair (a curve's multiplier)
    where the per-sample terms charge 1.0 (the whole sample's kernel): the ring adds the 0.5."""
    block_pairs_s = 4096**2 / 16 * 1e-9
    slow = _ring([4096], r=4, ring=IDEAL, block=lambda s: (1.5 * np.ones_like(s), 1.5 * np.ones_like(s)))
    fast = _ring([4096], r=4, ring=IDEAL)
    assert slow[2] - fast[2] == pytest.approx(4 * 0.5 * block_pairs_s, rel=1e-9)
    assert slow[3] - fast[3] == pytest.approx(4 * 0.5 * 2 * block_pairs_s, rel=1e-9)


def test_a_step_overlaps_as_its_coefficients_say() -> None:
    ring = RingCoefficients(exposed_fraction=0.4, step_overhead_s=1e-5)
    c, h = np.array([3e-3, 1e-3]), np.array([1e-3, 3e-3])
    assert step_s(c, h, ring).tolist() == pytest.approx([3e-3 + 0.4e-3 + 1e-5, 3e-3 + 0.4e-3 + 1e-5])
    assert step_s(c, h, IDEAL).tolist() == pytest.approx([3e-3, 3e-3])


def test_ring_compute_adds_up_to_the_ulysses_pairs() -> None:
    tokens = [3000, 1000, 512]
    for u, r in ((1, 2), (2, 2), (1, 4), (4, 2)):
        fwd, _, exp_f, _ = _ring(tokens, r=r, u=u)
        assert fwd - exp_f == pytest.approx(sum(t * t for t in tokens) / (u * r) * 1e-9, rel=1e-12)
    assert _ring(tokens, r=1, u=4)[2:] == (0.0, 0.0)


def test_kv_bytes_and_buffers_follow_the_heads() -> None:
    model = tiny_cost_model(num_heads=4).model.model_copy(update={"num_kv_heads": 2})
    assert kv_bytes_per_token(model, ulysses_degree=1) == 2 * 2 * 16 * 2
    assert kv_bytes_per_token(model, ulysses_degree=2) == 2 * 1 * 16 * 2
    assert kv_bytes_per_token(model, ulysses_degree=4) == 2 * 1 * 16 * 2  # one replicated head
    assert ring_kv_buffer_bytes([1000, 600], model, ulysses_degree=2, ring_degree=4) == 4 * 400 * 64
    assert ring_kv_buffer_bytes([1000], model, ulysses_degree=4, ring_degree=1) == 0.0


def test_layer_time_uses_the_cost_model_and_the_placement() -> None:
    cm = CostModel(file=tiny_cost_model(num_heads=4), cluster=tiny_cluster(num_gpus=8, gpus_per_node=4))
    inside = ring_layer_time_s(cm, [2048], ulysses_degree=2, ring_degree=2, first_rank=0, links=LINKS)
    across = ring_layer_time_s(cm, [2048], ulysses_degree=2, ring_degree=4, first_rank=0, links=LINKS)
    assert inside.alltoall_forward_s > 0 and across.exposed_forward_s > inside.exposed_forward_s
    pure_ring = ring_layer_time_s(cm, [2048], ulysses_degree=1, ring_degree=4, first_rank=0, links=LINKS)
    assert pure_ring.alltoall_forward_s == 0.0
    with pytest.raises(ValueError, match="needs an inter-node p2p link"):
        ring_layer_time_s(cm, [2048], ulysses_degree=1, ring_degree=8, first_rank=0,
                          links=P2PLinks(intra=LINKS.intra))


def test_p2p_fit_recovers_the_links_it_was_made_from() -> None:
    records = [CommRecord(op="p2p", group_size=2, num_nodes=n, bytes_per_rank=b, time_s=float(t),
                          time_s_min=float(t), time_s_max=float(t), num_repeats=1)
               for n in (1, 2) for b in (4096.0, 65536.0, 1048576.0)
               for t in [p2p_time_s(LINKS, b, crosses_nodes=n > 1)]]
    links, errors = fit_p2p(records)
    for got, want in ((links.intra, LINKS.intra), (links.inter, LINKS.inter)):
        assert got is not None and want is not None
        assert got.alpha_s == pytest.approx(want.alpha_s, rel=1e-6)
        assert got.bytes_per_s == pytest.approx(want.bytes_per_s, rel=1e-6)
    assert max(errors.values()) < 1e-9
    with pytest.raises(ValueError, match="intra-node p2p records of two or more sizes"):
        fit_p2p(records[3:])
    assert default_p2p_links(TINY_HW).intra.bytes_per_s == TINY_HW.nvlink_bytes_per_s_per_direction


@pytest.mark.timeout(200)
def test_profile_comm_measures_and_fits_ring_hops(tmp_path: Path) -> None:
    out = tmp_path / "p2p.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m",
           "dcp_cli.main", "profile-comm", "--out", str(out), "--ops", "p2p", "--gpus-per-node", "2",
           "--bytes-min", "4096", "--bytes-max", "1048576", "--num-sizes", "4", "--repeats", "5",
           "--warmup", "1", "--group-sizes", "2,4", "-q"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = read_profile(out)
    assert {(r.op, r.group_size, r.num_nodes) for r in profile.comm} == {("p2p", 2, 1), ("p2p", 4, 2)}
    links, errors = fit_p2p(profile.comm)
    assert links.inter is not None and links.intra.bytes_per_s > 0
    # The fit is checked on the records it was fitted on, as the all-to-all's is; the CLI prints it.
    assert "p2p intra: alpha" in proc.stdout and "MAPE on its 8 records" in proc.stdout, proc.stdout
    for name, link in (("intra", links.intra), ("inter", links.inter)):
        recs = [r for r in profile.comm if r.placement == name]
        mape = sum(abs(float(p2p_time_s(links, r.bytes_per_rank, crosses_nodes=name == "inter")) - r.time_s)
                   / r.time_s for r in recs) / len(recs)
        assert mape == pytest.approx(errors[name], rel=1e-9)
        print(f"p2p {name}: {link.alpha_s * 1e6:.1f} us, {link.bytes_per_s / 1e9:.3f} GB/s, MAPE {mape:.1%}")
