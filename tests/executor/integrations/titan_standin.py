"""A small decoder with torchtitan 0.3's calling convention, for the CPU tests of
``executor/integrations/torchtitan.py`` (torchtitan itself does not import on a CPU-only torch).

What it copies from torchtitan (``models/common/decoder.py``, ``models/common/attention.py``):
``Decoder.forward(tokens, positions, attention_masks)`` passes ``attention_masks`` to every layer
as ``layer(h, attention_masks, positions)``; ``GQAttention`` has ``n_heads``, ``n_kv_heads`` and an
``inner_attention`` module called as ``inner_attention(q_BLNH, k_BLNH, v_BLNH,
attention_masks=..., scale=..., enable_gqa=...)`` returning ``(B, L, N, H)``; rotary embedding at
the given positions. The plain inner attention is causal SDPA over the whole sequence (one sample).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from executor.runtime import Executor
from planner.plan import Plan
from tests.executor.helpers import dataset_for

VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 32, 16, 4, 2, 3


class SDPAInner(nn.Module):
    """torchtitan's ``ScaledDotProductAttention`` (causal, no masks)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attention_masks: object = None,
                scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        assert attention_masks is None
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             scale=scale, is_causal=True, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``(B, L, N, H)`` at ``positions`` ``(B, L)``."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000.0 ** (torch.arange(half, dtype=x.dtype) / half))
    angles = positions[..., None, None].to(x.dtype) * freqs  # (B, L, 1, half)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x1 * angles.sin() + x2 * angles.cos()], dim=-1)


class GQAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = HEADS, KV_HEADS, DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.inner_attention: nn.Module = SDPAInner()

    def forward(self, x: torch.Tensor, attention_masks: object, positions: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = _rope(self.wq(x).view(b, n, HEADS, self.head_dim), positions)
        k = _rope(self.wk(x).view(b, n, KV_HEADS, self.head_dim), positions)
        v = self.wv(x).view(b, n, KV_HEADS, self.head_dim)
        out = self.inner_attention(q, k, v, attention_masks=attention_masks, scale=None, enable_gqa=True)
        return self.wo(out.contiguous().flatten(2))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = GQAttention()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.feed_forward = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.SiLU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor, attention_masks: object, positions: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), attention_masks, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm, self.lm_head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                attention_masks: object = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(tokens.shape[1])[None]
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, attention_masks, positions)
        return self.lm_head(self.norm(h))


def build(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder().to(torch.float64)


def reference_grads(plan: Plan) -> tuple[float, dict[str, torch.Tensor]]:
    """The plain decoder on each whole sample, the plan's normaliser; loss and gradients."""
    model = build()
    data = dataset_for(plan, "1d")
    norm = plan.loss_normalizer
    total = torch.zeros((), dtype=torch.float64)
    for group in plan.groups:
        for micro in group.micro_batches:
            for ps in micro.samples:
                item = data.load(ps.sample)
                logits = model(item["inputs"][None])[0]  # type: ignore[index]
                losses = F.cross_entropy(logits, item["targets"], reduction="none")  # type: ignore[arg-type]
                weight = 1.0 / norm.total if norm.kind == "tokens" else 1.0 / (ps.sample.tokens * norm.total)
                total = total + losses.sum() * weight
    total.backward()
    return float(total.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run_step(executor: Executor, model: Decoder, plan: Plan) -> float:
    """One planned step through ``executor.integrations.torchtitan``; this rank's loss share."""
    from executor.integrations import torchtitan as tt

    rank_plan = plan.rank_view(executor.rank)
    data = dataset_for(plan, "1d")
    executor.begin_step(rank_plan, step=rank_plan.step or 0)
    share = 0.0
    for work in executor.micro_batches(rank_plan, load_sample=data.load):
        logits = model(**tt.model_inputs(work))[0, :work.targets.shape[0]]
        loss = work.loss(F.cross_entropy(logits, work.targets, reduction="none"))
        loss.backward()
        share += float(loss)
    executor.sync_gradients(model)
    return share
