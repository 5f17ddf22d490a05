"""The executor's measured peak on real-class Llama and Wan against the cost model's prediction (CPU).

For a transformers ``LlamaForCausalLM`` (the executor's ``hf_transformers`` integration: DCP
attention, per-sample checkpoint policies in every ``LlamaDecoderLayer``, the chunked LM loss) and a diffusers
``WanTransformer3DModel`` (``hf_wan``: DCP processors, per-token modulation), at Llama-3.1-8B's
and Wan2.1-1.3B's width ratios (narrow, random weights, bfloat16), one micro-batch of three
samples under three checkpoint policies (``none``, ``selective-2``, ``full`` of 4 layers) runs
forward, loss and backward on one rank, as the executor hands it out (:class:`MicroBatchWork`):

* measured: the peak of live bytes over forward+backward above the start
  (``costmodel.profiling.memtrack.LiveBytesTracker``; parameters, their preallocated
  gradients and the inputs excluded: model states are not activations);
* predicted: ``CostModel.activation_bytes`` of the three samples (summed) under the same
  policies, plus the chunked loss's one chunk of logits (``loss_chunk_bytes``, Llama), from the
  analytic default of the model (kept bytes from the counted family coefficients,
  ``costmodel/presets/activation_bytes.json``) with the one term that depends on the device's
  kernels, the backward's transient working set per token, taken from the real block's profile
  on this CPU (``costmodel.profiling.module_count.profile_module``: the slope over tokens of one
  layer's peak minus its kept bytes).

Run (about a minute on an idle 2-core machine)::

    .venv/bin/python bench/executor_peak_real.py --out bench/results/executor_peak_real.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
from provenance import default_out, provenance  # bench/ (the script's folder) is on sys.path

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.presets import load_hardware, load_model
from costmodel.profiling.coefficients import ratio_spec
from costmodel.profiling.memtrack import LiveBytesTracker
from costmodel.profiling.module_count import default_dtype, profile_module
from costmodel.profiling.real_classes import config_of, real_blocks
from costmodel.specs import ClusterSpec, ModelSpec
from executor.context import SPContext
from executor.layout import PackedLayout, SampleShape
from executor.runtime import MicroBatchWork

DTYPE = torch.bfloat16
NUM_LAYERS = 4
POLICIES = (0, 2, 4)
"""none, selective-2, full."""
TEXT_LENGTHS = (320, 192, 256)
VIDEO_SHAPES = ((2, 8, 10), (1, 12, 16), (3, 6, 8))
"""(frames, height, width) in patches."""
VOCAB = 512
"""A small vocabulary: the logits and loss are another term (``working_bytes_per_token``)."""
LOSS_CHUNK_TOKENS = 128
"""The chunked LM loss (``hf_transformers.lm_token_losses``) this many tokens at a time."""


def transient_per_token(spec: ModelSpec) -> float:
    """One real layer's backward working set per token above its kept bytes, on this CPU: the
    slope between two token counts (``profile_module``, untimed)."""
    blocks = real_blocks(config_of(spec))
    rows = profile_module(blocks.factory, blocks.make_inputs, blocks.call, tokens=[128, 384], num_layers=1,
                          policies=[0], dtype=DTYPE, repeats=0)
    return (rows[1].transient_bytes - rows[0].transient_bytes) / (rows[1].tokens - rows[0].tokens)


def work_for(samples: tuple[SampleShape, ...], inputs: torch.Tensor, targets: torch.Tensor) -> MicroBatchWork:
    """The micro-batch as the executor hands it to one rank of a group of one (token-mean loss)."""
    layout = PackedLayout(samples=samples, group_size=1, index_in_group=0)
    total = sum(s.tokens for s in samples)
    return MicroBatchWork(index=0, ctx=SPContext(layout=layout, group=None), inputs=inputs, targets=targets,
                          token_weights=torch.full((total,), 1.0 / total, dtype=torch.float64),
                          recompute_layers=POLICIES, sample_ids=tuple(f"s{i}" for i in range(len(samples))))


def peak(model: torch.nn.Module, step: Any, inputs: list[torch.Tensor]) -> float:
    """Live-bytes peak of ``step()`` (forward, loss, backward) above the start."""
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    with LiveBytesTracker(exclude=[*params, *(p.grad for p in params if p.grad is not None), *inputs]) as tracker:
        step()
    for p in params:
        p.grad = None
    return float(tracker.peak_bytes)


def llama_case() -> tuple[ModelSpec, float, list[int]]:
    """(spec, measured peak, sample tokens) of the Llama micro-batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from executor.integrations import hf_transformers as hf

    spec = ratio_spec(load_model("llama-3.1-8b"), heads=4, head_dim=64, num_layers=NUM_LAYERS).model_copy(
        update={"vocab": VOCAB, "loss_chunk_tokens": LOSS_CHUNK_TOKENS})
    fields = {k: v for k, v in config_of(spec).items() if k != "model_type"}
    config = LlamaConfig(**fields, attention_dropout=0.0)
    torch.manual_seed(0)
    with default_dtype(DTYPE):
        model = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=hf.register()).to(DTYPE)
    hf.prepare(model, group_sizes=[1])
    total = sum(TEXT_LENGTHS)
    gen = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(VOCAB, (total,), generator=gen), torch.randint(VOCAB, (total,), generator=gen)
    work = work_for(tuple(SampleShape(tokens=n) for n in TEXT_LENGTHS), ids, targets)

    def step() -> None:
        losses = hf.lm_token_losses(model, work, loss_chunk_tokens=spec.loss_chunk_tokens)
        work.loss(losses).backward()

    return spec, peak(model, step, [ids, targets]), list(TEXT_LENGTHS)


def wan_case() -> tuple[ModelSpec, float, list[int]]:
    """(spec, measured peak, sample tokens) of the Wan micro-batch."""
    from diffusers import WanTransformer3DModel

    from executor.integrations import hf_wan

    spec = ratio_spec(load_model("wan2.1-1.3b"), heads=4, head_dim=32, num_layers=NUM_LAYERS)
    text_tokens = spec.cross_attention_tokens
    torch.manual_seed(0)
    with default_dtype(DTYPE):
        model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=spec.num_heads,
                                      attention_head_dim=spec.head_size, in_channels=16, out_channels=16,
                                      text_dim=spec.hidden, freq_dim=64, ffn_dim=spec.ffn_hidden,
                                      num_layers=NUM_LAYERS, rope_max_seq_len=64).to(DTYPE)
    hf_wan.prepare(model, group_sizes=[1])
    gen = torch.Generator().manual_seed(0)
    videos = [torch.randn((16, f, 2 * h, 2 * w), generator=gen).to(DTYPE) for f, h, w in VIDEO_SHAPES]
    targets = torch.cat([hf_wan.patchify(v, (1, 2, 2)) for v in videos])
    texts = torch.randn((len(videos), text_tokens, spec.hidden), generator=gen).to(DTYPE)
    timesteps = torch.tensor([100, 500, 900])
    shapes = tuple(SampleShape(tokens=f * h * w, frames=f) for f, h, w in VIDEO_SHAPES)
    work = work_for(shapes, targets, targets)

    def step() -> None:
        pred = hf_wan.forward(model, work, videos=videos, timesteps=timesteps, texts=texts)
        work.loss(hf_wan.token_losses(pred, work.targets)).backward()

    return spec, peak(model, step, [*videos, targets, texts]), [s.tokens for s in shapes]


def compare(spec: ModelSpec, measured: float, tokens: list[int], *, transient: float | None = None,
            generic: bool = False) -> dict[str, Any]:
    """The prediction of the micro-batch's peak and its ratio to the measurement (``generic``: the
    analytic default without the family's counted bytes, the formula of its kind)."""
    hardware = load_hardware("h100-sxm")
    file = analytic_cost_model(spec.model_copy(update={"family": None}) if generic else spec, hardware)
    if transient is None:
        transient = transient_per_token(spec.model_copy(update={"num_layers": 1, "dual_stream_layers": 0}))
    activation = file.activation.model_copy(update={"transient_bytes_per_token": transient})
    file = file.model_copy(update={"activation": activation})
    cost = CostModel(file=file, cluster=ClusterSpec(name="one-rank", hardware=hardware, num_gpus=1, gpus_per_node=1))
    # the samples' bytes and the loss's one chunk of logits (the one per-token-free working term)
    predicted = float(cost.activation_bytes(tokens, group_size=1, recompute_layers=list(POLICIES)).sum()
                      + file.activation.loss_chunk_bytes)
    return {"model": spec.name, "family": spec.family, "hidden": spec.hidden, "num_layers": spec.num_layers,
            "tokens": tokens, "policies": list(POLICIES), "measured_peak_bytes": measured,
            "predicted_peak_bytes": predicted, "ratio": predicted / measured,
            "kept_none_bytes_per_token_layer": activation.bytes_per_token_layer_none,
            "transient_bytes_per_token_cpu": transient}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out("executor_peak_real"))
    args = parser.parse_args()
    rows = []
    for case in (llama_case, wan_case):
        spec, measured, tokens = case()
        row = compare(spec, measured, tokens)
        row["generic_ratio"] = compare(spec, measured, tokens, transient=row["transient_bytes_per_token_cpu"],
                                       generic=True)["ratio"]
        rows.append(row)
        print(f"{row['model']:<28} tokens {row['tokens']} policies {row['policies']}: measured "
              f"{row['measured_peak_bytes'] / 2**20:8.2f} MiB, predicted {row['predicted_peak_bytes'] / 2**20:8.2f} "
              f"MiB, ratio {row['ratio']:.4f} (generic formula {row['generic_ratio']:.4f})", flush=True)
    result = {"bench": "executor_peak_real", "rows": rows, "load_average": os.getloadavg(), **provenance()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
