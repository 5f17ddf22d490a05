"""What the ring's cost function says about long samples: one layer's attention per layout.

For Llama-3.1-8B (32 query, 8 key/value heads) on the h200x32 preset (8 GPUs a node), a single
sample of 128k or 512k tokens on groups of 8, 16 and 32 with every layout ``u x r`` the heads
allow: forward compute of the pairs, what the ring adds (``exposed``: hops the compute does not
hide, merges) and the Ulysses all-to-alls over ``u``, from ``costmodel.ring.ring_layer_time_s``
with the preset cost model and the hardware's unfitted p2p links (``default_p2p_links``: NVLink
and network bandwidths, 10/20 us latencies). Writes ``--out`` (default ``bench-out/ring_cost.json``).

    .venv/bin/python bench/ring_cost.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from costmodel.evaluate import CostModel
from costmodel.presets import default_cost_model_file, load_cluster
from costmodel.ring import default_p2p_links, ring_kv_buffer_bytes, ring_layer_time_s

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    from provenance import default_out  # bench/, the script's folder, is on sys.path
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--cluster", default="h200x32")
    parser.add_argument("--out", type=Path, default=default_out("ring_cost"))
    args = parser.parse_args()
    cluster = load_cluster(args.cluster)
    cm = CostModel(file=default_cost_model_file(args.model, cluster.hardware.name), cluster=cluster)
    links = default_p2p_links(cluster.hardware)
    allowed = set(cm.file.model.allowed_group_sizes(max_size=cluster.num_gpus))
    rows = []
    for tokens in (131072, 524288):
        for d in (8, 16, 32):
            for u in sorted(allowed):
                if d % u:
                    continue
                r = d // u
                t = ring_layer_time_s(cm, [tokens], ulysses_degree=u, ring_degree=r, first_rank=0, links=links)
                rows.append({"tokens": tokens, "group_size": d, "ulysses_degree": u, "ring_degree": r,
                             "forward_s": t.forward_s, "exposed_forward_s": t.exposed_forward_s,
                             "alltoall_forward_s": t.alltoall_forward_s,
                             "layer_forward_s": t.forward_s + t.alltoall_forward_s,
                             "ring_kv_buffer_bytes": ring_kv_buffer_bytes([tokens], cm.file.model, ulysses_degree=u,
                                                                          ring_degree=r)})
    print(f"{'tokens':>7} {'d':>3} {'u x r':>7} {'attn fwd ms':>11} {'exposed ms':>10} {'a2a ms':>7} "
          f"{'total ms':>8} {'kv buf MiB':>10}")
    for row in rows:
        print(f"{row['tokens']:>7} {row['group_size']:>3} {row['ulysses_degree']:>3} x {row['ring_degree']:<2}"
              f"{row['forward_s'] * 1e3:>12.3f} {row['exposed_forward_s'] * 1e3:>10.3f} "
              f"{row['alltoall_forward_s'] * 1e3:>7.3f} {row['layer_forward_s'] * 1e3:>8.3f} "
              f"{row['ring_kv_buffer_bytes'] / 2**20:>10.1f}")
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from provenance import provenance

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**provenance(), "model": args.model, "cluster": args.cluster,
                                    "p2p_links": links.model_dump(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
