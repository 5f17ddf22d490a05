"""Evaluation under :class:`~executor.integrations.hf_trainer.DCPTrainer`: the ``Trainer``'s own
evaluation loop, run on the model's plain attention.

Which way, and why. ``trainer.evaluate()``, ``trainer.predict()`` and ``eval_strategy='steps'``
run ``Trainer.evaluation_loop`` unchanged: each rank evaluates its shard of the eval set (the
``Trainer``'s distributed sampler, padded batches of ``per_device_eval_batch_size``), the losses
and predictions are gathered over the processes (``accelerate``'s ``gather_for_metrics``, which
drops the sampler's repeated rows) and the metrics computed as the plain ``Trainer`` computes them.
Only the attention differs from training: for the loop's duration the model runs the attention
implementation it had before ``DCPTrainer`` switched it to Ulysses (``sdpa`` by default) and its
decoder layers run their own ``forward`` (:func:`plain_attention`). So the metrics are the plain
``Trainer``'s by construction (same batches, same reduction, same attention kernel), and a
``compute_metrics`` or ``preprocess_logits_for_metrics`` of the user's works as before.

The other way, planning the eval set's batches like training steps, would spread one long eval
sample over a sequence-parallel group; it was not chosen because an evaluation's forward keeps no
activations for a backward (a sample that trains on one rank under a plan's checkpointing
evaluates on one rank), the ``Trainer``'s metrics are defined on its own batches (the mean over
batches of each batch's mean loss, weighted by the batch's rows), which a plan's packing would not
reproduce, and evaluation would need a planned eval epoch on the service. Its limit: an eval sample
must fit one rank's memory in a forward without a cache.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from executor.integrations import hf_transformers as hf
from executor.integrations.hf_trainer_data import IGNORE_INDEX

logger = logging.getLogger(__name__)

DEFAULT_EVAL_ATTENTION = "sdpa"
"""The attention evaluation runs on when the model was given to ``DCPTrainer`` already on DCP's."""


def eval_attention_of(model: nn.Module, *, requested: str | None) -> str:
    """The attention implementation evaluation runs on: ``requested``, else the model's own
    (before ``DCPTrainer`` switches it), else :data:`DEFAULT_EVAL_ATTENTION`.

    Raises:
        ValueError: when ``requested`` is DCP's own attention (it needs a plan).
    """
    if requested == hf.ATTENTION_NAME:
        raise ValueError(f"eval_attention={requested!r}: evaluation runs without a plan; name a plain "
                         "attention implementation ('sdpa', 'eager', ...)")
    if requested:
        return requested
    own = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return own if own and own != hf.ATTENTION_NAME else DEFAULT_EVAL_ATTENTION


@contextmanager
def plain_attention(model: nn.Module, *, implementation: str) -> Iterator[None]:
    """Run ``model`` (the ``Trainer``'s unwrapped model) on ``implementation`` and its decoder layers'
    own ``forward`` inside the block; DCP's attention and checkpoint policies again after it."""
    layers = hf.decoder_layers(model)
    policy_forwards = [layer.__dict__.pop("forward", None) for layer in layers]  # set by hf.prepare
    previous = getattr(model.config, "_attn_implementation", None)
    model.set_attn_implementation(implementation)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_attn_implementation(previous)  # type: ignore[operator]
        for layer, forward in zip(layers, policy_forwards, strict=True):
            if forward is not None:
                layer.forward = forward  # type: ignore[method-assign]


@dataclass(kw_only=True, frozen=True, slots=True)
class CausalLMPadding:
    """The evaluation collator ``DCPTrainer`` uses when the script gives none: rows of ``input_ids``
    (and optional ``labels``) right-padded into a batch; padding has label ``-100`` and attention
    mask 0, so the model's causal LM loss is the mean over each row's own targets."""

    pad_token_id: int = 0
    """Token id of the padding (never trained on or scored)."""

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        """Pad ``rows`` to the longest.

        Raises:
            ValueError: naming a row with no tokens or labels of another length.
        """
        if not rows:
            raise ValueError("an evaluation batch needs at least one row")
        width = max(len(row["input_ids"]) for row in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            row_ids = torch.as_tensor(row["input_ids"], dtype=torch.long).reshape(-1)
            row_labels = row_ids if row.get("labels") is None else torch.as_tensor(row["labels"]).reshape(-1)
            if row_ids.numel() == 0 or row_labels.shape != row_ids.shape:
                raise ValueError(f"evaluation row {i}: {row_ids.numel()} input_ids and {row_labels.numel()} "
                                 "labels (need the same, at least one)")
            ids[i, :row_ids.numel()] = row_ids
            labels[i, :row_ids.numel()] = row_labels
            mask[i, :row_ids.numel()] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def pad_token_id_of(model: nn.Module) -> int:
    """The model config's ``pad_token_id``, else 0."""
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    return int(pad) if pad is not None else 0
