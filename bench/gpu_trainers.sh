#!/usr/bin/env bash
# torchtitan 0.3.0's Llama 3 debug model under a DCP plan on the visible GPUs (NCCL), against the
# plain torchtitan model on each whole document. NOT RUN YET: written in a session without a GPU;
# torchtitan 0.3.0 does not import on a CPU-only torch (models/common/token_dispatcher.py ->
# distributed/minimal_async_ep/kernels.py imports triton, and tools/utils.py falls back to the
# 'cuda' device type when no accelerator is present). Budget: about 2 minutes on one H200.
#
#   bash bench/gpu_trainers.sh            # every visible GPU (one GPU: groups of one only)
#
# What it does: installs torchtitan 0.3.0 and the pieces it imports without touching torch
# (--no-deps), builds model_registry("debugmodel") on every rank with the same seed, swaps each
# attention's inner_attention for DCP's Ulysses one (executor/integrations/torchtitan.py), plans
# a long-tailed batch of documents with the planner library (analytic cost model of the debug
# model, the H200 cluster cut to the world size), runs STEPS planned steps (forward, backward,
# gradient all-reduce) and on rank 0 the plain model on each whole document with the plan's loss
# normalisation; writes the loss, the worst relative gradient difference, the step time and the
# peak memory to bench/results/gpu_trainers.json.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
STEPS=${STEPS:-3}
OUT=${OUT:-bench/results/gpu_trainers.json}

"$PY" -c "import torch; assert torch.cuda.is_available(), 'needs a CUDA GPU'"
"$PY" -m pip install -q --no-deps "torchtitan==0.3.0" "tyro==1.0.17" "torchdata==0.11.0" "einops==0.8.2" \
  "docstring_parser==0.18.0" "typeguard==4.6.1" "spmd_types==0.2.3" "torch_checkpointing==0.1.1" \
  "tensorboard==2.21.0" "tensorboard-data-server==0.7.2" "Markdown==3.11.3"

DRIVER=$(mktemp --suffix=.py)
trap 'rm -f "$DRIVER"' EXIT
cat > "$DRIVER" <<'PYEOF'
import copy, json, os, sys, time
import torch, torch.distributed as dist, torch.nn.functional as F

from costmodel.analytic import analytic_cost_model
from costmodel.presets import load_cluster
from costmodel.specs import ModelSpec, Sample
from executor.data import SyntheticDataset
from executor.groups import GroupRegistry
from executor.integrations import torchtitan as tt
from executor.runtime import Executor
from planner.epoch import plan_samples
from planner.plan import Plan
from torchtitan.models.llama3 import model_registry

steps, out = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
device = torch.device("cuda")
spec = model_registry("debugmodel")
torch.manual_seed(0)
with device:
    model = spec.model.build()
    model.init_states()
reference = copy.deepcopy(model) if rank == 0 else None
attn = next(m for m in model.modules() if hasattr(m, "inner_attention"))
heads, kv_heads = attn.n_heads, attn.n_kv_heads
sizes = [d for d in range(1, world + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
tt.install(model, group_sizes=sizes)
registry = GroupRegistry(world_size=world, rank=rank, group_sizes=sizes)
executor = Executor(registry=registry, device=device)
layers = list(model.layers.values())
dim, vocab = spec.model.dim, spec.model.vocab_size
mspec = ModelSpec(name="titan-debugmodel", kind="1d", num_layers=len(layers), hidden=dim, num_heads=heads,
                  ffn_hidden=4 * dim, vocab=vocab, causal=True)
cluster = load_cluster("h200x8").model_copy(update={"name": f"h200x{world}", "num_gpus": world,
                                                    "gpus_per_node": world})
samples = [Sample(id=f"doc-{i}", tokens=min(8192, 64 + int(256 * 1.7 ** (i % 9)))) for i in range(8 * world)]
data = SyntheticDataset(samples, kind="1d", vocab=vocab)
plan_json = [None]
if rank == 0:
    plan_json[0] = plan_samples(samples, cluster=cluster, cost_model=analytic_cost_model(mspec, cluster.hardware),
                                options={"time_limit_s": 5.0}, step=0).plan_json
dist.broadcast_object_list(plan_json, src=0)
plan = Plan.model_validate_json(plan_json[0])
rank_plan = plan.rank_view(rank)
times, loss_total = [], 0.0
for step in range(steps):
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(); start = time.perf_counter()
    executor.begin_step(rank_plan, step=0)
    share = torch.zeros((), device=device)
    for work in executor.micro_batches(rank_plan, load_sample=data.load):
        logits = model(**tt.model_inputs(work))[0, :work.targets.shape[0]].float()
        loss = work.loss(F.cross_entropy(logits, work.targets, reduction="none"))
        loss.backward()
        share += loss.detach()
    executor.sync_gradients(model)
    torch.cuda.synchronize(); times.append(time.perf_counter() - start)
    dist.all_reduce(share)
    loss_total = float(share)
result = {"world_size": world, "group_sizes": [g.size for g in plan.groups], "loss": loss_total,
          "step_time_s": times, "predicted_step_time_s": plan.predicted_step_time_s,
          "peak_bytes": torch.cuda.max_memory_allocated()}
if rank == 0:
    norm, ref_loss = plan.loss_normalizer, torch.zeros((), device=device)
    for group in plan.groups:
        for micro in group.micro_batches:
            for ps in micro.samples:
                item = data.load(ps.sample)
                logits = reference(item["inputs"][None].to(device))[0].float()
                w = 1.0 / norm.total if norm.kind == "tokens" else 1.0 / (ps.sample.tokens * norm.total)
                ref_loss = ref_loss + F.cross_entropy(logits, item["targets"].to(device), reduction="sum") * w
    ref_loss.backward()
    grads = dict(model.named_parameters())
    worst = max(float((grads[n].grad - p.grad).abs().max()) / float(p.grad.abs().max())
                for n, p in reference.named_parameters() if p.grad is not None)
    result.update({"reference_loss": float(ref_loss), "max_grad_rel_diff": worst})
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
dist.destroy_process_group()
PYEOF

"$PY" -m torch.distributed.run --nproc-per-node "$NGPU" "$DRIVER" "$STEPS" "$OUT"
