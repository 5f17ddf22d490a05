"""Counted vs predicted activation bytes of the models' real layer classes, per checkpoint policy.

For Llama-3.1-8B, Qwen2.5-7B, Qwen3-8B, Mistral-7B, Wan2.1 (1.3B and 14B ratios) and HunyuanVideo
(dual- and single-stream blocks):

* counted: the bytes a stack of the model's own transformers / diffusers layer class saves for
  backward in bfloat16 (``costmodel.profiling.coefficients.stack_counts``: saved-tensor hooks,
  unique storages, a checkpointed layer's input), on one sample;
* predicted: the analytic default's coefficients for the model (``costmodel.analytic``, from
  ``costmodel/presets/activation_bytes.json``) through ``costmodel.memory_costs.kept_bytes``;
* generic: the same with the model's family removed (the formula of its kind, what the
  analytic default predicted before the families were counted).

Shapes: two layers at the model's width ratios (4 query heads of 64, Qwen2.5 7; video heads of
32) under every policy ``k = 0, 1, 2``, and one layer at the real hidden size (``k = 0, 1``);
never the narrow shapes or token counts the table was counted at.

Run (about 3 minutes on an idle 2-core machine; ``--quick`` skips the real hidden sizes)::

    .venv/bin/python bench/saved_bytes.py --out bench/results/saved_bytes.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from provenance import default_out, provenance  # bench/ (the script's folder) is on sys.path

from costmodel.analytic import analytic_cost_model
from costmodel.memory_costs import kept_bytes
from costmodel.model_config import model_spec_from_config
from costmodel.policy import policy_name
from costmodel.presets import load_hardware, load_model
from costmodel.profiling.coefficients import ratio_spec, stack_counts
from costmodel.profiling.real_classes import config_of, real_blocks
from costmodel.specs import ModelSpec

MISTRAL_7B_CONFIG = {"model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "vocab_size": 32768, "sliding_window": None, "_name_or_path": "Mistral-7B-v0.3"}
"""Mistral-7B-v0.3's config.json widths (no preset is a Mistral)."""

MODELS = ("llama-3.1-8b", "qwen2.5-7b", "qwen3-8b", "mistral-7b", "wan2.1-1.3b", "wan2.1-14b", "hunyuanvideo-13b")
TINY_TOKENS = 80
REAL_TOKENS = 24


def load(name: str) -> ModelSpec:
    """A preset, or Mistral-7B from its config."""
    return model_spec_from_config(MISTRAL_7B_CONFIG) if name == "mistral-7b" else load_model(name)


def block_kinds(model: ModelSpec) -> tuple[str | None, ...]:
    return ("dual", "single") if model.family == "hunyuanvideo" else (None,)


def rows_for(spec: ModelSpec, *, block_kind: str | None, tokens: int, label: str) -> list[dict[str, Any]]:
    """Counted, predicted and generic bytes of ``spec``'s stack under every policy."""
    start = time.perf_counter()
    counted = stack_counts(real_blocks(config_of(spec), block_kind=block_kind), tokens=[tokens],
                           num_layers=spec.num_layers)
    count_s = time.perf_counter() - start
    if block_kind is not None:  # all layers of this kind
        spec = spec.model_copy(update={"dual_stream_layers": spec.num_layers if block_kind == "dual" else 0})
    hardware = load_hardware("h100-sxm")
    file = analytic_cost_model(spec, hardware)
    generic = analytic_cost_model(spec.model_copy(update={"family": None}), hardware)
    rows = []
    for k in range(spec.num_layers + 1):
        got = counted[(k, tokens)]
        predicted = kept_bytes(file, tokens, recompute_layers=k)
        rows.append({"model": label, "block": block_kind or "layer", "hidden": spec.hidden,
                     "num_layers": spec.num_layers,
                     "tokens": tokens, "policy": policy_name(k, spec.num_layers), "counted_bytes": got,
                     "predicted_bytes": predicted, "ratio": predicted / got,
                     "generic_ratio": kept_bytes(generic, tokens, recompute_layers=k) / got, "count_s": count_s})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out("saved_bytes"))
    parser.add_argument("--quick", action="store_true", help="Only the narrow shapes.")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for name in MODELS:
        model = load(name)
        tiny = ratio_spec(model, heads=7 if model.family == "qwen2" else 4, head_dim=64 if model.kind == "1d" else 32)
        shapes = [(tiny, TINY_TOKENS, f"{name} (ratios, h={tiny.hidden})")]
        # Wan2.1-14B's real block has 1.4 GB of weights; 1.3B's real width is counted
        if not args.quick and name != "wan2.1-14b":
            one = model.model_copy(update={"num_layers": 1, "dual_stream_layers": 1 if model.dual_stream_layers else 0})
            shapes.append((one, REAL_TOKENS, f"{name} (h={model.hidden})"))
        for spec, tokens, label in shapes:
            for kind in block_kinds(model):
                for row in rows_for(spec, block_kind=kind, tokens=tokens, label=label):
                    rows.append(row)
                    print(f"{row['model']:<36} {row['block']:<6} {row['policy']:<11} "
                          f"counted {row['counted_bytes']:>12,} "
                          f"predicted {row['predicted_bytes']:>14,.0f} ratio {row['ratio']:.4f} "
                          f"(generic formula {row['generic_ratio']:.3f})", flush=True)
    ratios = [r["ratio"] for r in rows]
    print(f"{len(rows)} rows, ratio {min(ratios):.4f} .. {max(ratios):.4f}")
    result = {"bench": "saved_bytes", "rows": rows, "min_ratio": min(ratios), "max_ratio": max(ratios),
              "load_average": os.getloadavg(), **provenance()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
