"""torchtitan 0.3.0's Llama 3 debug model under a DCP plan, against the plain model per document.

Run by ``bench/gpu_trainers.sh`` (which installs torchtitan and sets a timeout)::

    torchrun --nproc-per-node NGPU bench/gpu_trainers_titan.py --steps 3 --out bench-out/gpu_trainers.json

Every rank builds ``model_registry("debugmodel", attn_backend="sdpa")`` with the same seed, keeps its
initial weights on the CPU, swaps each attention's ``inner_attention`` for DCP's Ulysses one
(``executor/integrations/torchtitan.py``: Ulysses, per-sample causal attention, per-layer checkpoint
policy), plans one long-tailed batch of documents with the planner library (analytic cost model of
the debug model on the H200 cluster cut to the world size) and runs ``--steps`` times that planned
step (forward and backward of each micro-batch, the executor's gradient all-reduce); then rank 0
loads the initial weights into a fresh plain model (torchtitan's own SDPA attention), runs each
whole document with the plan's loss weights and compares the loss and every gradient. Rank 0
prints a table and writes JSON (command, machine load, GPU, group sizes, step times, predicted
step time, peak memory of the DCP steps, losses, worst relative gradient difference).

``--device cpu`` runs the same on gloo, for checking the script where torchtitan imports on a CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from provenance import default_out, provenance  # noqa: E402  (bench/provenance.py: command and commit)

from costmodel.analytic import analytic_cost_model  # noqa: E402
from costmodel.evaluate import CostModel  # noqa: E402
from costmodel.presets import load_cluster  # noqa: E402
from costmodel.specs import ModelSpec, Sample  # noqa: E402
from executor.data import SyntheticDataset  # noqa: E402
from executor.groups import GroupRegistry  # noqa: E402
from executor.integrations import torchtitan as tt  # noqa: E402
from executor.runtime import Executor  # noqa: E402
from planner.epoch import plan_samples  # noqa: E402
from planner.plan import Plan  # noqa: E402

logger = logging.getLogger("gpu_trainers_titan")


def _build(device: torch.device) -> Any:
    """torchtitan's Llama 3 debug model (fp32), seeded (its default ``flex`` attention: 0.3.0 refuses
    ``sdpa`` for language models; DCP and the reference swap the ``inner_attention`` anyway)."""
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    torch.manual_seed(0)
    with device:
        model = spec.model.build()
        model.init_states()
    return model


class PlainCausalAttention(torch.nn.Module):
    """The reference's ``inner_attention``: torch's causal SDPA over the whole document (no DCP code)."""

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                attention_masks: Any = None, scale: float | None = None, enable_gqa: bool = False,
                **kwargs: Any) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
                                             is_causal=True, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def _reference(device: torch.device, initial: dict[str, torch.Tensor]) -> Any:
    """The plain model: the initial weights, every ``inner_attention`` causal SDPA."""
    reference = _build(device)
    reference.load_state_dict(initial)
    for module in reference.modules():
        if isinstance(getattr(module, "inner_attention", None), torch.nn.Module):
            module.inner_attention = PlainCausalAttention()
    return reference


def _documents(world: int, *, docs_per_rank: int, max_tokens: int) -> list[Sample]:
    """A long-tailed batch: 64 to ``max_tokens`` tokens, ``docs_per_rank`` per rank."""
    return [Sample(id=f"doc-{i}", tokens=min(max_tokens, 64 + int(256 * 1.7 ** (i % 9))))
            for i in range(docs_per_rank * world)]


def _plan(samples: list[Sample], model: Any, *, world: int, rank: int, memory_tokens: int) -> Plan:
    """Rank 0 plans with the library (analytic cost model of this model), every rank gets the plan.
    With ``memory_tokens`` > 0 the planned memory is cut so that one rank holds that many tokens
    (as ``examples/common.py`` does): the debug model fits any H200 whole, so longer documents
    would otherwise never get a sequence-parallel group."""
    attn = next(m for m in model.modules() if hasattr(m, "inner_attention"))
    ffn = next(iter(model.layers.values())).feed_forward.w1.out_features
    spec = ModelSpec(name="titan-llama3-debugmodel", kind="1d", num_layers=len(model.layers),
                     hidden=model.tok_embeddings.embedding_dim, num_heads=attn.n_heads,
                     num_kv_heads=attn.n_kv_heads, ffn_hidden=ffn,
                     vocab=model.tok_embeddings.num_embeddings, causal=True)
    cluster = load_cluster("h200x8").model_copy(update={"name": f"h200x{world}", "num_gpus": world,
                                                        "gpus_per_node": world})
    if memory_tokens > 0:
        evaluator = CostModel(file=analytic_cost_model(spec, cluster.hardware), cluster=cluster)
        need = evaluator.fixed_bytes() + float(evaluator.activation_bytes(memory_tokens, group_size=1))
        hardware = cluster.hardware.model_copy(update={"name": f"{cluster.hardware.name}-tight",
                                                       "hbm_bytes": need / cluster.memory_cap_fraction})
        cluster = cluster.model_copy(update={"hardware": hardware, "name": f"{cluster.name}-tight"})
    box: list[Any] = [None]
    if rank == 0:
        cost_model = analytic_cost_model(spec, cluster.hardware)
        box[0] = plan_samples(samples, cluster=cluster, cost_model=cost_model, options={"time_limit_s": 5.0},
                              step=0).plan_json
    dist.broadcast_object_list(box, src=0)
    return Plan.model_validate_json(box[0])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    """Run the planned steps, then the reference on rank 0; print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="Times the planned step runs (timed).")
    parser.add_argument("--docs-per-rank", type=int, default=8, help="Documents in the batch per rank.")
    parser.add_argument("--max-tokens", type=int, default=8192, help="Longest document.")
    parser.add_argument("--memory-tokens", type=int, default=2048,
                        help="Plan as if a rank held this many tokens (0: the H200's memory).")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", default=str(default_out("gpu_trainers")))
    args = parser.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s: %(message)s")

    model = _build(device)
    initial = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    attn = next(m for m in model.modules() if hasattr(m, "inner_attention"))
    sizes = [d for d in range(1, world + 1)
             if attn.n_heads % d == 0 and (attn.n_kv_heads % d == 0 or d % attn.n_kv_heads == 0)]
    samples = _documents(world, docs_per_rank=args.docs_per_rank, max_tokens=args.max_tokens)
    plan = _plan(samples, model, world=world, rank=rank, memory_tokens=args.memory_tokens)
    swapped = tt.install(model, group_sizes=sizes)
    registry = GroupRegistry(world_size=world, rank=rank, group_sizes=sizes)
    executor = Executor(registry=registry, device=device)
    data = SyntheticDataset(samples, kind="1d", vocab=model.tok_embeddings.num_embeddings)
    rank_plan = plan.rank_view(rank)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times_s, loss = [], 0.0
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        executor.begin_step(rank_plan, step=0)
        share = torch.zeros((), device=device)
        for work in executor.micro_batches(rank_plan, load_sample=data.load):
            logits = model(**tt.model_inputs(work))[0, :work.targets.shape[0]].float()
            micro_loss = work.loss(F.cross_entropy(logits, work.targets, reduction="none"))
            micro_loss.backward()
            share += micro_loss.detach()
        executor.sync_gradients(model)
        _sync(device)
        times_s.append(time.perf_counter() - start)
        dist.all_reduce(share)
        loss = float(share)
    peak_bytes = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"times_s": times_s, "peak_bytes": peak_bytes})

    if rank == 0:
        reference = _reference(device, initial)
        norm, ref_loss = plan.loss_normalizer, torch.zeros((), device=device)
        for group in plan.groups:
            for micro in group.micro_batches:
                for ps in micro.samples:
                    item = data.load(ps.sample)
                    inputs, targets = item["inputs"], item["targets"]
                    assert isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor)
                    logits = reference(inputs[None].to(device))[0].float()
                    weight = 1.0 / norm.total if norm.kind == "tokens" else 1.0 / (ps.sample.tokens * norm.total)
                    ref_loss = ref_loss + F.cross_entropy(logits, targets.to(device), reduction="sum") * weight
        ref_loss.backward()
        grads = dict(model.named_parameters())
        worst, where = 0.0, ""
        for name, p in reference.named_parameters():
            if p.grad is None:
                continue
            got = grads[name].grad
            rel = float("inf") if got is None else float((got - p.grad).abs().max()) / float(p.grad.abs().max())
            if rel > worst:
                worst, where = rel, name
        step_s = [max(g["times_s"][i] for g in gathered) for i in range(args.steps)]
        peaks = [g["peak_bytes"] for g in gathered if g["peak_bytes"] is not None]
        result = {
            **provenance(), "load_avg": list(os.getloadavg()),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "world_size": world, "attention_modules_swapped": swapped,
            "num_documents": len(samples), "tokens": sum(s.tokens for s in samples),
            "group_sizes": [g.size for g in plan.groups], "solver_status": plan.solver.status,
            "step_time_s": step_s, "median_step_time_s": statistics.median(step_s),
            "predicted_step_time_s": plan.predicted_step_time_s,
            "peak_bytes_max": max(peaks) if peaks else None,
            "memory_tokens": args.memory_tokens,
            "loss": loss, "reference_loss": float(ref_loss.detach()),
            "loss_rel_diff": abs(loss - float(ref_loss.detach())) / abs(float(ref_loss.detach())),
            "max_grad_rel_diff": worst, "max_grad_rel_diff_param": where,
            "not_measured": "the reference's own step time; FSDP2 (gradients summed by the executor's "
                            "all-reduce); torchtitan's trainer loop (config, data loader, optimizer)",
        }
        _print_table(result)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}", flush=True)
    dist.destroy_process_group()


def _print_table(result: dict[str, Any]) -> None:
    peak = result["peak_bytes_max"]
    rows = [
        ("device", f"{result['device']} x {result['world_size']}"),
        ("documents / tokens", f"{result['num_documents']} / {result['tokens']:,}"),
        ("groups (sizes)", f"{result['group_sizes']} ({result['solver_status']})"),
        ("step time, median (s)", f"{result['median_step_time_s']:.4f}"),
        ("predicted step time (s)", f"{result['predicted_step_time_s']:.4f}"),
        ("peak memory, max rank (GiB)", "n/a" if peak is None else f"{peak / 2**30:.2f}"),
        ("loss DCP / reference", f"{result['loss']:.6f} / {result['reference_loss']:.6f}"),
        ("loss relative difference", f"{result['loss_rel_diff']:.2e}"),
        ("worst gradient rel. difference", f"{result['max_grad_rel_diff']:.2e} ({result['max_grad_rel_diff_param']})"),
    ]
    width = max(len(k) for k, _ in rows)
    print("torchtitan Llama 3 debugmodel under a DCP plan", flush=True)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}", flush=True)


if __name__ == "__main__":
    main()
