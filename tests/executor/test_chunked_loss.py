"""The chunked LM loss (``executor/chunked_loss.py``): exact against the plain loss, and the bytes
it holds are the ones the cost model charges.

Exactness: fp64, the loss and the gradients of the hidden states, the head's weight and bias
within 1e-10 of ``F.cross_entropy`` on the whole logits, for chunks of one token, uneven chunks,
a chunk of the whole shard and longer, ignored targets and per-token loss weights (as
``MicroBatchWork.loss`` applies them).

Memory: the peak of live bytes on CPU (``LiveBytesTracker``) of a forward+backward, less what
the test counts by hand (the gradients of the hidden states and of the head, and the inputs the
tracker sees through views), is one chunk's bytes as ``chunk_peak_bytes`` and the cost model's
``loss_chunk_bytes`` say; the whole-logits loss holds the cost model's per-token bytes for every
token.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from pydantic import ValidationError

from costmodel.analytic import analytic_cost_model
from costmodel.model_terms import FP32_BYTES, WHOLE_LOSS_FP32_BUFFERS, loss_chunk_bytes
from costmodel.presets import load_hardware
from costmodel.profiling.memtrack import LiveBytesTracker
from costmodel.specs import ModelSpec
from executor.chunked_loss import IGNORE_INDEX, check_chunk_tokens, chunk_peak_bytes, chunked_token_losses
from executor.models import ModelConfig

TOL = 1e-10


def _inputs(tokens: int, hidden: int, vocab: int, *, dtype: torch.dtype, seed: int = 0, bias: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) / hidden ** 0.5).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    return h, w, b, targets


@pytest.mark.parametrize("chunk", [1, 7, 64, 250, 4096])
@pytest.mark.parametrize("bias", [False, True])
def test_loss_and_gradients_equal_the_whole_logits_loss(chunk: int, bias: bool) -> None:
    h, w, b, targets = _inputs(250, 24, 97, dtype=torch.float64, bias=bias)
    targets[::9] = IGNORE_INDEX
    weights = torch.rand(250, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    params = [t for t in (h, w, b) if t is not None]
    plain = F.cross_entropy(F.linear(h, w, b), targets, reduction="none", ignore_index=IGNORE_INDEX)
    expected = torch.autograd.grad((plain * weights).sum(), params)
    losses = chunked_token_losses(h, w, targets, chunk_tokens=chunk, bias=b)
    assert losses.dtype == torch.float64 and losses.shape == (250,)
    assert float((losses - plain).detach().abs().max()) <= TOL
    assert bool((losses[::9] == 0).all())
    got = torch.autograd.grad((losses * weights).sum(), params)
    for name, g, e in zip(("hidden", "weight", "bias"), got, expected, strict=False):
        assert float((g - e).abs().max()) <= TOL, name


def test_whole_logits_option_is_the_plain_loss() -> None:
    h, w, _, targets = _inputs(40, 8, 33, dtype=torch.float64)
    plain = F.cross_entropy(h @ w.t(), targets, reduction="none")
    assert torch.equal(chunked_token_losses(h, w, targets, chunk_tokens=0), plain)


def test_a_shard_without_tokens_gives_no_loss_and_zero_gradients() -> None:
    h, w, _, targets = _inputs(0, 8, 33, dtype=torch.float64)
    losses = chunked_token_losses(h, w, targets, chunk_tokens=16)
    assert losses.shape == (0,)
    losses.sum().backward()
    assert w.grad is not None and float(w.grad.abs().max()) == 0.0


def test_fp32_and_bf16_losses_follow_the_plain_loss() -> None:
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        h, w, _, targets = _inputs(300, 32, 500, dtype=dtype)
        plain = F.cross_entropy((h @ w.t()).float(), targets, reduction="none")
        losses = chunked_token_losses(h, w, targets, chunk_tokens=64)
        assert losses.dtype == torch.float32
        assert float((losses - plain).detach().abs().max()) <= tol, dtype


@pytest.mark.parametrize("bad", [-1, -4096])
def test_a_negative_chunk_is_refused_naming_the_option(bad: int) -> None:
    h, w, _, targets = _inputs(10, 8, 33, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"loss_chunk_tokens={bad} must be positive"):
        chunked_token_losses(h, w, targets, chunk_tokens=bad)
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        ModelConfig(loss_chunk_tokens=bad)
    with pytest.raises(ValidationError, match="loss_chunk_tokens"):
        ModelSpec(name="m", kind="1d", num_layers=1, hidden=8, num_heads=2, ffn_hidden=16, vocab=33,
                  loss_chunk_tokens=bad)
    with pytest.raises(ValueError, match="larger than the sample"):
        check_chunk_tokens(20, tokens=10)


def _peak_less_inputs(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, chunk: int) -> int:
    """Peak live bytes of forward+backward less the inputs h and w (the tracker counts a storage
    an operator returns, views of the inputs included: the first two views make it count both
    whichever path runs). What is left is the loss's working memory, the gradients of h and w
    where they coexist with it, and per-token vectors (losses, log-sum-exp, masks: under 64 B a
    token)."""
    with LiveBytesTracker() as tracker:
        h.view_as(h), w.view_as(w)
        chunked_token_losses(h, w, targets, chunk_tokens=chunk).sum().backward()
    return tracker.peak_bytes - (h.nbytes + w.nbytes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_held_bytes_are_one_chunk_as_the_cost_model_charges(dtype: torch.dtype) -> None:
    tokens, hidden, vocab, chunk = 2048, 32, 4096, 256
    h, w, _, targets = _inputs(tokens, hidden, vocab, dtype=dtype)
    # backward allocates both gradients first, then runs chunk by chunk
    measured = _peak_less_inputs(h, w, targets, chunk) - (h.nbytes + w.nbytes)
    predicted = chunk_peak_bytes(chunk_tokens=chunk, vocab=vocab, dtype_bytes=h.element_size())
    assert predicted <= measured <= predicted + 64 * tokens
    if dtype == torch.bfloat16:  # the analytic model's dtype: its charge is this count
        spec = ModelSpec(name="tiny", kind="1d", num_layers=1, hidden=hidden, num_heads=4, ffn_hidden=64,
                         vocab=vocab, loss_chunk_tokens=chunk)
        assert loss_chunk_bytes(spec) == predicted == chunk * vocab * (2 + 4)
        file = analytic_cost_model(spec, load_hardware("h100-sxm"))
        assert file.activation.loss_chunk_bytes == predicted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_logits_hold_the_cost_models_bytes_per_token_and_chunks_save_them(dtype: torch.dtype) -> None:
    tokens, hidden, vocab, chunk = 2048, 32, 4096, 256
    h, w, _, targets = _inputs(tokens, hidden, vocab, dtype=dtype)
    # the peak is in the log-softmax's backward, before the head's GEMMs make the gradients
    whole = _peak_less_inputs(h, w, targets, 0)
    per_token = WHOLE_LOSS_FP32_BUFFERS * FP32_BYTES * vocab
    assert tokens * per_token <= whole <= tokens * (per_token + 64)
    chunked = _peak_less_inputs(h, w, targets, chunk)
    assert whole > 7 * chunked  # 2,048 tokens of 12 B a logit vs 256 tokens of 4-6 B


def test_under_autocast_backward_projects_as_forward_did() -> None:
    # Under bf16 autocast the forward's logits are bf16: backward must project the same way, or
    # its softmax (from fp32 logits against the bf16 log-sum-exp) is off by bf16's rounding.
    h, w, _, targets = _inputs(300, 32, 500, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(h, w)
        losses = chunked_token_losses(h, w, targets, chunk_tokens=64)
    z = logits.detach().float()
    plain = torch.logsumexp(z, 1) - z.gather(1, targets[:, None])[:, 0]
    assert float((losses - plain).detach().abs().max()) <= 1e-5
    dz = torch.softmax(z, 1) - F.one_hot(targets, 500).float()  # the softmax gradient of those logits
    got_h, got_w = torch.autograd.grad(losses.sum(), (h, w))
    assert float((got_h - dz @ w.detach()).abs().max()) <= 1e-5
    assert float((got_w - dz.t() @ h.detach()).abs().max()) <= 1e-4
