"""A naive reference of the executor's reference models, written from the definitions.

Independent of ``executor/`` (nothing is imported from it): every operation is spelled out
(RMSNorm and LayerNorm from their formulas, the rotary embedding, attention as an explicit
``softmax(q k^T / sqrt(Dh) + mask) v`` with a hand-written softmax, cross-entropy as
``logsumexp - logit``), one sample at a time in plain loops, and the step loss is the global mean
computed by hand: ``sum(token losses) / global tokens`` or the mean over samples of each
sample's mean token loss. Slow and small on purpose; its gradients (``torch.autograd.grad`` of
that loss with respect to a dict of parameter tensors) are what a planned step must reproduce.

Parameters are read by name from the state of a model of the same architecture (``Llama1D``:
``embed``, ``layers.i.{attn_norm, attn.qkv, attn.out, mlp_norm, mlp.gate, mlp.up, mlp.down}``,
``norm``, ``head``; ``STDiT2D``: ``embed``, ``layers.i.{spatial,temporal}.{attn_norm, attn.qkv,
attn.out, mlp_norm, mlp.0, mlp.2}``, ``norm``, ``head``; ``DiT3D``: ``embed``, ``layers.i.{attn_norm,
attn.qkv, attn.out, cross_norm, cross.text, cross.q, cross.kv, cross.out, mlp_norm, mlp.0, mlp.2}``,
``norm``, ``head``; ``JointDiT3D``: ``embed``, ``text``, ``layers.i.{attn_norm, text_attn_norm, attn.qkv,
attn.text_qkv, attn.out, attn.text_out, mlp_norm, mlp.0, mlp.2, text_mlp_norm, text_mlp.0, text_mlp.2}``
(the last layer without the text output and MLP), ``norm``, ``head``): the definitions below are the
architecture's, the numbers are the model's. With grouped-query attention (``num_kv_heads``) the
``attn.qkv`` rows hold, per key/value head, its query heads, its key and its value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

Params = Mapping[str, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class NaiveSample:
    """One sample of the step, whole."""

    inputs: torch.Tensor
    """Token ids ``(tokens,)`` (1D) or patches ``(tokens, channels)`` (2D, frame-major)."""
    targets: torch.Tensor
    """Next-token ids (1D) or target patches (2D)."""
    frames: int = 1
    """Frames (2D); tokens per frame is ``tokens / frames``."""


# ----------------------------------------------------------------------------- building blocks
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b``."""
    y = x @ weight.T
    return y if bias is None else y + bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * w`` with ``eps`` the dtype's machine epsilon (torch's default)."""
    eps = torch.finfo(x.dtype).eps
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``(x - mean) / sqrt(biased var + eps) * w + b``."""
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)``, sigmoid written out."""
    return x / (1.0 + torch.exp(-x))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation: ``x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def softmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim: ``exp(s - max) / sum(exp(s - max))``."""
    shifted = scores - scores.max(dim=-1, keepdim=True).values.detach()
    e = torch.exp(shifted)
    return e / e.sum(dim=-1, keepdim=True)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """One head group ``(heads, n, Dh)``: ``softmax(q k^T / sqrt(Dh) + mask) v``."""
    n, head_dim = q.shape[-2], q.shape[-1]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(head_dim)
    if causal:
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return softmax_rows(scores) @ v


def rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoFormer's rotary embedding (rotate-half form, base 10000) of ``(n, heads, Dh)``."""
    half = x.shape[-1] // 2
    inv_freq = torch.tensor([10000.0 ** (-i / half) for i in range(half)], dtype=x.dtype)
    angle = positions.to(x.dtype)[:, None] * inv_freq[None, :]
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., 2 * half:]], dim=-1)


def qkv_heads(h: torch.Tensor, weight: torch.Tensor, num_heads: int, num_kv_heads: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Project and split: ``q`` ``(n, heads, Dh)``, ``k`` and ``v`` ``(n, heads, Dh)`` too.

    The projection holds, per key/value head, the ``heads / kv_heads`` query heads that use it, then
    its key, then its value (per head ``[q | k | v]`` when there are as many key/value heads as
    query heads). Query head ``i`` attends with key/value head ``i // (heads / kv_heads)``, so the
    returned ``k`` and ``v`` repeat each key/value head for its query heads.
    """
    kv_heads = num_kv_heads or num_heads
    rep = num_heads // kv_heads
    n = h.shape[0]
    head_dim = weight.shape[0] // (num_heads + 2 * kv_heads)
    qkv = linear(h, weight).reshape(n, kv_heads, (rep + 2) * head_dim)
    q = qkv[..., :rep * head_dim].reshape(n, num_heads, head_dim)
    k = qkv[..., rep * head_dim:(rep + 1) * head_dim]
    v = qkv[..., (rep + 1) * head_dim:]
    of_query = torch.tensor([i // rep for i in range(num_heads)])  # key/value head of each query head
    return q, k[:, of_query], v[:, of_query]


# ----------------------------------------------------------------------------- 1D: LLaMA-style
def llama_logits(params: Params, token_ids: torch.Tensor, *, num_layers: int, num_heads: int,
                 num_kv_heads: int | None = None) -> torch.Tensor:
    """Logits ``(n, vocab)`` of one whole sample."""
    h = params["embed.weight"][token_ids]
    positions = torch.arange(token_ids.shape[0])
    for i in range(num_layers):
        p = f"layers.{i}."
        x = rms_norm(h, params[p + "attn_norm.weight"])
        q, k, v = qkv_heads(x, params[p + "attn.qkv.weight"], num_heads, num_kv_heads)
        q, k = rotary(q, positions), rotary(k, positions)
        o = attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), causal=True)
        h = h + linear(o.transpose(0, 1).reshape(h.shape[0], -1), params[p + "attn.out.weight"])
        x = rms_norm(h, params[p + "mlp_norm.weight"])
        gated = silu(linear(x, params[p + "mlp.gate.weight"])) * linear(x, params[p + "mlp.up.weight"])
        h = h + linear(gated, params[p + "mlp.down.weight"])
    return linear(rms_norm(h, params["norm.weight"]), params["head.weight"])


def cross_entropy_per_token(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log(sum(exp(logits))) - logits[target]`` per token, log-sum-exp written out."""
    top = logits.max(dim=-1, keepdim=True).values.detach()
    lse = torch.log(torch.exp(logits - top).sum(dim=-1)) + top[:, 0]
    picked = torch.stack([logits[t, int(targets[t])] for t in range(logits.shape[0])])
    return lse - picked


# ----------------------------------------------------------------------------- 2D: STDiT-style
def sincos(positions: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``[sin(p w_i), cos(p w_i)]`` with ``w_i = 10000^(-i / (dim/2))``."""
    half = dim // 2
    freqs = torch.tensor([10000.0 ** (-i / half) for i in range(half)], dtype=dtype)
    angle = positions.to(dtype)[:, None] * freqs[None, :]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1)


def dit_block(params: Params, prefix: str, h: torch.Tensor, *, frames: int, num_heads: int,
              temporal: bool) -> torch.Tensor:
    """One block: attention within each frame (spatial) or across frames per position (temporal)."""
    n = h.shape[0]
    spatial = n // frames
    x = layer_norm(h, params[prefix + "attn_norm.weight"], params[prefix + "attn_norm.bias"])
    q, k, v = qkv_heads(x, params[prefix + "attn.qkv.weight"], num_heads)
    # Token t is frame t // spatial, position t % spatial (frame-major).
    if temporal:
        sets = [[f * spatial + s for f in range(frames)] for s in range(spatial)]
    else:
        sets = [[f * spatial + s for s in range(spatial)] for f in range(frames)]
    rows = []
    for idx in sets:
        index = torch.tensor(idx)
        o = attention(q[index].transpose(0, 1), k[index].transpose(0, 1), v[index].transpose(0, 1),
                      causal=False)
        rows.append((index, o.transpose(0, 1)))
    out = torch.zeros_like(q).index_put(tuple([torch.cat([r[0] for r in rows])]),
                                        torch.cat([r[1] for r in rows]))
    h = h + linear(out.reshape(n, -1), params[prefix + "attn.out.weight"])
    x = layer_norm(h, params[prefix + "mlp_norm.weight"], params[prefix + "mlp_norm.bias"])
    x = gelu_tanh(linear(x, params[prefix + "mlp.0.weight"], params[prefix + "mlp.0.bias"]))
    return h + linear(x, params[prefix + "mlp.2.weight"], params[prefix + "mlp.2.bias"])


def stdit_prediction(params: Params, patches: torch.Tensor, *, frames: int, num_layers: int,
                     num_heads: int) -> torch.Tensor:
    """Per-patch prediction ``(n, channels)`` of one whole sample."""
    n = patches.shape[0]
    spatial = n // frames
    hidden = params["embed.weight"].shape[0]
    t = torch.arange(n)
    h = (linear(patches, params["embed.weight"], params["embed.bias"])
         + sincos(t % spatial, hidden, patches.dtype) + sincos(t // spatial, hidden, patches.dtype))
    for i in range(num_layers):
        for part, temporal in (("spatial", False), ("temporal", True)):
            h = dit_block(params, f"layers.{i}.{part}.", h, frames=frames, num_heads=num_heads,
                          temporal=temporal)
    h = layer_norm(h, params["norm.weight"], params["norm.bias"])
    return linear(h, params["head.weight"], params["head.bias"])


# ----------------------------------------------------------------------------- 3D: whole-clip DiT
def dit3d_prediction(params: Params, patches: torch.Tensor, *, frames: int, num_layers: int,
                     num_heads: int, num_kv_heads: int | None = None) -> torch.Tensor:
    """Per-patch prediction ``(n, channels)`` of one whole clip: per block, attention of every token
    to every token of the clip, attention of every token to the block's text tokens, GELU MLP."""
    n = patches.shape[0]
    spatial = n // frames
    hidden = params["embed.weight"].shape[0]
    head_dim = hidden // num_heads
    t = torch.arange(n)
    h = (linear(patches, params["embed.weight"], params["embed.bias"])
         + sincos(t % spatial, hidden, patches.dtype) + sincos(t // spatial, hidden, patches.dtype))
    for i in range(num_layers):
        p = f"layers.{i}."
        x = layer_norm(h, params[p + "attn_norm.weight"], params[p + "attn_norm.bias"])
        q, k, v = qkv_heads(x, params[p + "attn.qkv.weight"], num_heads, num_kv_heads)
        o = attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), causal=False)
        h = h + linear(o.transpose(0, 1).reshape(n, -1), params[p + "attn.out.weight"])
        x = layer_norm(h, params[p + "cross_norm.weight"], params[p + "cross_norm.bias"])
        text = params[p + "cross.text"]
        qc = linear(x, params[p + "cross.q.weight"]).reshape(n, num_heads, head_dim).transpose(0, 1)
        kv = linear(text, params[p + "cross.kv.weight"]).reshape(text.shape[0], num_heads, 2 * head_dim)
        kc, vc = kv[..., :head_dim].transpose(0, 1), kv[..., head_dim:].transpose(0, 1)
        scores = (qc @ kc.transpose(-1, -2)) / math.sqrt(head_dim)  # (heads, n, text)
        oc = (softmax_rows(scores) @ vc).transpose(0, 1).reshape(n, -1)
        h = h + linear(oc, params[p + "cross.out.weight"])
        x = layer_norm(h, params[p + "mlp_norm.weight"], params[p + "mlp_norm.bias"])
        x = gelu_tanh(linear(x, params[p + "mlp.0.weight"], params[p + "mlp.0.bias"]))
        h = h + linear(x, params[p + "mlp.2.weight"], params[p + "mlp.2.bias"])
    h = layer_norm(h, params["norm.weight"], params["norm.bias"])
    return linear(h, params["head.weight"], params["head.bias"])


# ----------------------------------------------------------------------------- 3D: joint text (MMDiT)
def _gelu_mlp(params: Params, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """``W2 gelu(W1 layer_norm(x) + b1) + b2`` with the norm ``<prefix>_norm``."""
    x = layer_norm(x, params[prefix + "_norm.weight"], params[prefix + "_norm.bias"])
    x = gelu_tanh(linear(x, params[prefix + ".0.weight"], params[prefix + ".0.bias"]))
    return linear(x, params[prefix + ".2.weight"], params[prefix + ".2.bias"])


def joint_dit3d_prediction(params: Params, patches: torch.Tensor, *, frames: int, num_layers: int,
                           num_heads: int, num_kv_heads: int | None = None) -> torch.Tensor:
    """Per-patch prediction ``(n, channels)`` of one whole clip with joint text attention (MMDiT,
    Esser et al. 2024): the text stream starts at ``text`` (``J`` tokens); per block both streams
    are layer-normed and projected with their own weights and attend together over the ``J + n``
    tokens of ``[text; clip]`` (every token to every token), each adds its own output projection,
    then its own GELU MLP. The last block is context-pre-only (SD3): the text gives keys and values
    only (its queries are computed and unused, no text output or MLP). Only the clip is predicted."""
    n = patches.shape[0]
    spatial = n // frames
    hidden = params["embed.weight"].shape[0]
    t = torch.arange(n)
    h = (linear(patches, params["embed.weight"], params["embed.bias"])
         + sincos(t % spatial, hidden, patches.dtype) + sincos(t // spatial, hidden, patches.dtype))
    text = params["text"]
    j = text.shape[0]
    for i in range(num_layers):
        p = f"layers.{i}."
        last = i == num_layers - 1
        x = layer_norm(h, params[p + "attn_norm.weight"], params[p + "attn_norm.bias"])
        xt = layer_norm(text, params[p + "text_attn_norm.weight"], params[p + "text_attn_norm.bias"])
        q, k, v = qkv_heads(x, params[p + "attn.qkv.weight"], num_heads, num_kv_heads)
        qt, kt, vt = qkv_heads(xt, params[p + "attn.text_qkv.weight"], num_heads, num_kv_heads)
        o = attention(torch.cat([qt, q]).transpose(0, 1), torch.cat([kt, k]).transpose(0, 1),
                      torch.cat([vt, v]).transpose(0, 1), causal=False).transpose(0, 1)
        h = h + linear(o[j:].reshape(n, -1), params[p + "attn.out.weight"])
        h = h + _gelu_mlp(params, p + "mlp", h)
        if not last:
            text = text + linear(o[:j].reshape(j, -1), params[p + "attn.text_out.weight"])
            text = text + _gelu_mlp(params, p + "text_mlp", text)
    h = layer_norm(h, params["norm.weight"], params["norm.bias"])
    return linear(h, params["head.weight"], params["head.bias"])


# ----------------------------------------------------------------------------- the step
def step_loss(params: Params, samples: Sequence[NaiveSample], *, kind: str, normalizer: str,
              num_layers: int, num_heads: int, num_kv_heads: int | None = None) -> torch.Tensor:
    """The plain large-batch loss of a step: a global mean over tokens or over samples.

    Args:
        params: Parameter tensors by name.
        samples: Every sample of the step (any order).
        kind: ``1d`` (cross-entropy), ``2d``, ``3d`` or ``3d_joint`` (mean squared error over channels).
        normalizer: ``tokens`` (mean over all tokens) or ``samples`` (mean of per-sample means).
        num_layers: Layers of the model.
        num_heads: Attention heads.
        num_kv_heads: Key/value heads of the self-attention (1D and 3D; ``None``: ``num_heads``).
    """
    per_sample: list[torch.Tensor] = []
    for sample in samples:
        if kind == "1d":
            logits = llama_logits(params, sample.inputs, num_layers=num_layers, num_heads=num_heads,
                                  num_kv_heads=num_kv_heads)
            per_sample.append(cross_entropy_per_token(logits, sample.targets))
        elif kind in ("3d", "3d_joint"):
            predict = joint_dit3d_prediction if kind == "3d_joint" else dit3d_prediction
            pred = predict(params, sample.inputs, frames=sample.frames, num_layers=num_layers,
                           num_heads=num_heads, num_kv_heads=num_kv_heads)
            per_sample.append(((pred - sample.targets) ** 2).sum(dim=-1) / pred.shape[-1])
        else:
            pred = stdit_prediction(params, sample.inputs, frames=sample.frames, num_layers=num_layers,
                                    num_heads=num_heads)
            per_sample.append(((pred - sample.targets) ** 2).sum(dim=-1) / pred.shape[-1])
    if normalizer == "tokens":
        total_tokens = sum(int(t.shape[0]) for t in per_sample)
        return sum((t.sum() for t in per_sample), per_sample[0].new_zeros(())) / total_tokens
    return sum((t.sum() / t.shape[0] for t in per_sample), per_sample[0].new_zeros(())) / len(per_sample)


def step_gradients(params: Params, samples: Sequence[NaiveSample], *, kind: str, normalizer: str,
                   num_layers: int, num_heads: int, num_kv_heads: int | None = None
                   ) -> tuple[float, dict[str, torch.Tensor]]:
    """The step loss and its gradient with respect to every parameter (by name)."""
    leaves = {name: t.detach().clone().requires_grad_(True) for name, t in params.items()}
    loss = step_loss(leaves, samples, kind=kind, normalizer=normalizer, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=num_kv_heads)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return float(loss.detach()), dict(zip(leaves, grads, strict=True))
