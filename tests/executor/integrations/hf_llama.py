"""The Hugging Face Llama of the integration tests: config, reference step, world-4 worker part.

A small random-initialised ``LlamaConfig`` (grouped-query attention: 8 query heads over 4
key/value heads, so groups of 1, 2 and 4 divide them), built in the test, no download. The
reference is the plain ``transformers`` model (``sdpa`` attention, which keeps fp64 in fp64;
``eager`` computes its softmax in fp32) in one process on the whole padded batch.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from executor.runtime import Executor
from planner.plan import Plan
from tests.executor import scenarios
from tests.executor.helpers import CONFIG, dataset_for

NUM_LAYERS = CONFIG.num_layers  # the scenario plans' policies range over 0..3


def llama_config(*, kv_heads: int = 4) -> Any:
    """The small Llama configuration (vocabulary of the synthetic data); ``kv_heads=2`` puts the
    scenarios' groups of 4 past the key/value heads (each rank gets a replicated head)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=CONFIG.vocab, hidden_size=32, intermediate_size=48,
                       num_hidden_layers=NUM_LAYERS, num_attention_heads=8, num_key_value_heads=kv_heads,
                       max_position_embeddings=64, attention_dropout=0.0)


def build(attn_implementation: str, *, dtype: torch.dtype, seed: int = 0, kv_heads: int = 4) -> Any:
    """A Llama with the given attention, deterministically initialised (same on every rank)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(copy.deepcopy(llama_config(kv_heads=kv_heads)),
                                          attn_implementation=attn_implementation)
    return model.to(dtype)


def sample_ids(plan: Plan) -> list[torch.Tensor]:
    """Every sample's full token ids (inputs then the last target), in plan order."""
    data = dataset_for(plan, "1d")
    out = []
    for group in plan.groups:
        for micro in group.micro_batches:
            for ps in micro.samples:
                item = data.load(ps.sample)
                inputs, targets = item["inputs"], item["targets"]
                assert isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor)
                out.append(torch.cat([inputs, targets[-1:]]))
    return out


def reference_backward(model: Any, plan: Plan, *, own_loss: bool) -> float:
    """The plain step on the whole batch (right-padded), gradients into ``model``; its loss.

    ``own_loss``: the model's own loss (``labels=``: mean over every predicted token, computed
    in fp32 by ``transformers``); otherwise the plan's normaliser by hand from the logits.
    """
    ids = sample_ids(plan)
    batch, longest = len(ids), max(len(x) for x in ids)
    inputs = torch.zeros(batch, longest, dtype=torch.long)
    labels = torch.full((batch, longest), -100, dtype=torch.long)
    mask = torch.zeros(batch, longest, dtype=torch.long)
    for i, x in enumerate(ids):
        inputs[i, :len(x)], labels[i, :len(x)], mask[i, :len(x)] = x, x, 1
    if own_loss:
        assert plan.loss_normalizer.kind == "tokens"
        loss = model(input_ids=inputs, attention_mask=mask, labels=labels, use_cache=False).loss
    else:
        logits = model(input_ids=inputs, attention_mask=mask, use_cache=False).logits
        per_sample = [F.cross_entropy(logits[i, :len(x) - 1], x[1:], reduction="sum") for i, x in enumerate(ids)]
        if plan.loss_normalizer.kind == "tokens":
            loss = sum(per_sample) / sum(len(x) - 1 for x in ids)
        else:
            loss = sum(s / (len(x) - 1) for s, x in zip(per_sample, ids, strict=True)) / batch
    loss.backward()
    return float(loss.detach())


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gradients by parameter name (zeros where none)."""
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in model.named_parameters()}


def worst_relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest ``max|got - want| / max|want|`` over the parameters, and that parameter's name."""
    worst, where = 0.0, ""
    for name, ref in want.items():
        scale = float(ref.abs().max())
        assert scale > 0.0, f"{name}: zero reference gradient"
        rel = float((got[name].to(ref.dtype) - ref).abs().max()) / scale
        if rel > worst:
            worst, where = rel, name
    return worst, where


def check_world_step(world: list[dict[str, object]], run: str, index: int, *, dtype: torch.dtype,
                     own_loss: bool, loss_rel: float, grad_rel: float, kv_heads: int = 4) -> None:
    """The world's planned step ``run`` on scenario plan ``index`` equals the plain model's.

    The ranks' results ``{run}_loss_{index}`` sum to :func:`reference_backward`'s loss within
    ``loss_rel``, and every rank's ``{run}_grad_{index}`` is the plain model's gradients within
    ``grad_rel`` (relative to each parameter's largest reference gradient).
    """
    plan = scenarios.plans_1d()[index]
    model = build("sdpa", dtype=dtype, kv_heads=kv_heads)
    loss = reference_backward(model, plan, own_loss=own_loss)
    reference = grads(model)
    shares = [float(res[f"{run}_loss_{index}"]) for res in world]  # type: ignore[arg-type]
    assert sum(shares) == pytest.approx(loss, rel=loss_rel), f"{run}: shares {shares} vs plain loss {loss}"
    for r, res in enumerate(world):
        worst, where = worst_relative(res[f"{run}_grad_{index}"], reference)  # type: ignore[arg-type]
        assert worst <= grad_rel, f"rank {r}: {where} relative diff {worst:.2e}"


def run_step(executor: Executor, model: Any, plan: Plan, *, loss_chunk_tokens: int = 0) -> float:
    """One planned step of the DCP Llama on this rank (the lines a user's loop has); its loss share.
    ``loss_chunk_tokens``: the loss in chunks of that many tokens (``hf.lm_token_losses``), 0 from
    the whole logits."""
    from executor.integrations import hf_transformers as hf

    rank_plan = plan.rank_view(executor.rank)
    executor.begin_step(rank_plan, step=plan.step or 0)
    data = dataset_for(plan, "1d")
    share = 0.0
    for work in executor.micro_batches(rank_plan, load_sample=data.load):
        if loss_chunk_tokens:
            loss = work.loss(hf.lm_token_losses(model, work, loss_chunk_tokens=loss_chunk_tokens))
        else:
            logits = model(**hf.model_inputs(work)).logits
            loss = work.loss(hf.token_losses(logits, work.targets))
        loss.backward()
        share += float(loss.detach())
    executor.sync_gradients(model)
    return share
