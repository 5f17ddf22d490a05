"""The LM loss in chunks vs whole logits: predicted peak per rank at 1M tokens, and the bytes the
real loss holds on CPU against what the cost model charges.

1. Predicted (analytic cost model, Llama-3.1-8B from ``examples/configs/llama-3.1-8b/config.json``
   on the ``h200x24`` preset): one sample of 1,048,576 tokens on the largest group the planner
   allows (16 ranks) with every layer checkpointed: model states, fixed working memory (the
   loss's one chunk included), activations and the peak per rank against the cap, for whole
   logits (``loss_chunk_tokens = 0``) and chunks of 1,024 / 4,096 (the default) / 8,192 tokens,
   and the forward+backward time of that sample (the chunks' head recompute). Then ``dcp plan``'s
   step 0 of ``text-millionctx`` (its longest document 882,023 tokens) under each: planned or
   refused, and the plan's largest predicted peak per rank.
2. Measured (CPU, ``LiveBytesTracker``): one forward+backward of the loss alone on ``T`` tokens
   of a ``V``-word vocabulary in bf16 (``executor.chunked_loss.chunked_token_losses``), the peak
   of live bytes less its inputs (and, chunked, the two gradients it allocates before its
   chunks; the whole loss peaks before its GEMMs make them), against the cost model's charge: whole,
   ``T x 12 B x V`` (``WHOLE_LOSS_FP32_BUFFERS`` fp32 buffers a logit); chunked, one chunk
   ``c x V x (2 + 4) B`` (``loss_chunk_bytes``).

Run (about half a minute on an idle 2-core machine; ~0.5 GB of memory)::

    .venv/bin/python bench/loss_chunk.py --out bench/results/loss_chunk.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from provenance import default_out, provenance  # bench/ (the script's folder) is on sys.path

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.model_choice import with_loss_chunk
from costmodel.model_config import model_spec_from_config
from costmodel.model_terms import FP32_BYTES, WHOLE_LOSS_FP32_BUFFERS, loss_chunk_bytes
from costmodel.presets import load_cluster
from costmodel.profiling.memtrack import LiveBytesTracker
from costmodel.specs import ModelSpec
from dcp_cli.plan import plan_rows
from executor.chunked_loss import chunked_token_losses

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/configs/llama-3.1-8b/config.json"
CHUNKS = (0, 1024, 4096, 8192)
GIB = 2 ** 30
logger = logging.getLogger("bench.loss_chunk")


def predicted_rows(*, cluster: str, tokens: int) -> list[dict[str, Any]]:
    """Per chunk: the 1M-token sample's peak per rank on the largest group, fully checkpointed."""
    base = model_spec_from_config(CONFIG)
    spec = load_cluster(cluster)
    rows = []
    for chunk in CHUNKS:
        model = with_loss_chunk(base, chunk, max_sample_tokens=tokens)
        cm = CostModel(file=analytic_cost_model(model, spec.hardware), cluster=spec)
        d = max(cm.allowed_group_sizes())
        layers = cm.num_layers
        act = float(cm.activation_bytes(tokens, group_size=d, recompute_layers=layers))
        peak = cm.fixed_bytes() + act
        rows.append({"loss_chunk_tokens": chunk, "group_size": d, "model_state_bytes": cm.model_state_bytes(),
                     "fixed_working_bytes": cm.fixed_working_bytes(), "loss_chunk_bytes": loss_chunk_bytes(model),
                     "activation_bytes": act, "peak_bytes": peak, "memory_cap_bytes": spec.memory_cap_bytes,
                     "fits": peak <= spec.memory_cap_bytes,
                     "time_s": float(cm.sample_time_s(tokens, group_size=d, recompute_layers=layers))})
    return rows


def plan_row(chunk: int, *, cluster: str) -> dict[str, Any]:
    """``dcp plan``'s step 0 of ``text-millionctx`` for Llama-3.1-8B with this chunk."""
    try:
        row = plan_rows(workload="text-millionctx", cluster=cluster, steps=1, seed=0, batch_size=256,
                        budget_s=0.05, model=model_spec_from_config(CONFIG), loss_chunk_tokens=chunk)[0]
    except ValueError as exc:
        return {"loss_chunk_tokens": chunk, "planned": False, "refusal": str(exc)}
    return {"loss_chunk_tokens": chunk, "planned": True, "peak_mem_bytes": row["peak_mem_bytes"],
            "memory_cap_bytes": row["memory_cap_bytes"], "step_time_s": row["step_time_s"],
            "groups": row["group_sizes"]}


def measured_rows(*, tokens: int, hidden: int, vocab: int, chunks: tuple[int, ...]) -> list[dict[str, Any]]:
    """Per chunk: the loss's peak live bytes on CPU (bf16) less inputs (and gradients), and the charge."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for chunk in chunks:
        h = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).requires_grad_()
        w = (torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5).to(torch.bfloat16).requires_grad_()
        targets = torch.randint(0, vocab, (tokens,), generator=gen)
        with LiveBytesTracker() as tracker:
            h.view_as(h), w.view_as(w)  # count the inputs whichever path runs, to take them off
            chunked_token_losses(h, w, targets, chunk_tokens=chunk).sum().backward()
        # chunked: both gradients are allocated before the chunks run; whole: after its peak
        measured = tracker.peak_bytes - (h.nbytes + w.nbytes) * (2 if chunk else 1)
        spec = ModelSpec(name="bench", kind="1d", num_layers=1, hidden=hidden, num_heads=1, ffn_hidden=hidden,
                         vocab=vocab, loss_chunk_tokens=chunk)
        charged = loss_chunk_bytes(spec) if chunk else tokens * WHOLE_LOSS_FP32_BUFFERS * FP32_BYTES * vocab
        rows.append({"loss_chunk_tokens": chunk, "tokens": tokens, "vocab": vocab, "measured_bytes": measured,
                     "charged_bytes": charged, "ratio": measured / charged})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="h200x24")
    parser.add_argument("--tokens", type=int, default=1_048_576, help="The long sample (predicted part).")
    parser.add_argument("--cpu-tokens", type=int, default=4096)
    parser.add_argument("--cpu-vocab", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=default_out("loss_chunk"))
    args = parser.parse_args()
    load_start = list(os.getloadavg())
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    predicted = predicted_rows(cluster=args.cluster, tokens=args.tokens)
    logger.info("Llama-3.1-8B, one %s-token sample on %s, largest group, full checkpointing (GiB per rank)",
                f"{args.tokens:,}", args.cluster)
    logger.info("%8s %4s %8s %8s %8s %8s %8s %5s %9s", "chunk", "d", "states", "fixed", "loss", "act", "peak",
                "fits", "time s")
    for r in predicted:
        logger.info("%8s %4d %8.2f %8.2f %8.2f %8.2f %8.2f %5s %9.1f", r["loss_chunk_tokens"] or "whole",
                    r["group_size"], r["model_state_bytes"] / GIB, r["fixed_working_bytes"] / GIB,
                    r["loss_chunk_bytes"] / GIB, r["activation_bytes"] / GIB, r["peak_bytes"] / GIB,
                    "yes" if r["fits"] else "no", r["time_s"])
    logger.info("cap %.2f GiB per rank", predicted[0]["memory_cap_bytes"] / GIB)
    plans = [plan_row(chunk, cluster=args.cluster) for chunk in CHUNKS]
    logger.info("dcp plan -w text-millionctx -c %s, step 0:", args.cluster)
    for p in plans:
        what = (f"planned, peak {p['peak_mem_bytes'] / GIB:.2f} GiB per rank, step {p['step_time_s']:.1f} s"
                if p["planned"] else f"refused: {p['refusal'][:90]}")
        logger.info("  chunk %-6s %s", p["loss_chunk_tokens"] or "whole", what)
    measured = measured_rows(tokens=args.cpu_tokens, hidden=64, vocab=args.cpu_vocab, chunks=(0, 256, 1024))
    logger.info("CPU, bf16, %s tokens x %s vocabulary: the loss's peak less inputs (and gradients) (MiB)",
                f"{args.cpu_tokens:,}", f"{args.cpu_vocab:,}")
    for m in measured:
        logger.info("  chunk %-6s measured %8.2f charged %8.2f ratio %.4f", m["loss_chunk_tokens"] or "whole",
                    m["measured_bytes"] / 2 ** 20, m["charged_bytes"] / 2 ** 20, m["ratio"])
    load_end = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**provenance(), "model_config": str(CONFIG.relative_to(ROOT)),
                                    "cluster": args.cluster, "tokens": args.tokens,
                                    "loadavg_at_start": load_start, "loadavg_at_end": load_end,
                                    "predicted": predicted, "plans": plans, "measured_cpu": measured}, indent=1) + "\n")
    logger.info("wrote %s (load %.1f -> %.1f)", args.out, load_start[0], load_end[0])


if __name__ == "__main__":
    main()
