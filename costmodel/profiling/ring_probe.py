"""What a ring step costs on one device: its attention on a block, and its hop beside compute.

* :func:`measure_ring_attention`: one rank's attention of a sample of ``s`` tokens as a ring of
  ``r`` runs it, ``r`` block steps of ``s/r`` queries against ``s/r`` keys and values for the
  rank's ``H/u`` heads with the log-sum-exp merge of the partial outputs (forward+backward, no
  communication), beside the same rank's share of the pairs as one kernel over the whole sample
  (``H/(u r)`` heads, what a Ulysses rank of ``u r`` runs); ``ring_attention`` records
  (:class:`costmodel.profiling.format.RingAttentionRecord`). The attention is written out
  (scores, log-sum-exp, probabilities) the same way for both, so the ratio is the blocks'.
* :func:`measure_ring_steps_one_gpu`: a ring step's overlap on one CUDA device, where no peer
  exists: the hop is a device-to-device copy of the block's bytes on a second stream, posted
  before a matrix product and waited for after; the copy alone and the product alone are timed in
  the same rounds (``ring_step`` records with ``backend="cuda-copy"``). A copy engine's overlap
  is the best a hop can get: NCCL's p2p also takes SMs from the compute, so this bounds the
  exposed fraction from below (``dcp profile-comm --ops ring_step`` measures the real hop).

Both are fitted by :mod:`costmodel.ring.fit`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from costmodel.profiling.format import CommRecord, RingAttentionRecord
from costmodel.profiling.measure import CpuClock, time_interleaved


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, log-sum-exp)`` of softmax attention of ``q`` ``[H, n, D]`` on ``k``, ``v`` ``[H, m, D]``."""
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 softmax statistics for bf16 inputs
    scores = ((q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))).to(acc)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).to(v.dtype)
    return probs @ v, lse


def ring_steps(q: torch.Tensor, blocks: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The queries ``q`` attended to every key/value block in turn, partial outputs merged by their
    log-sum-exp (what each ring step does after its hop); equals attention on the blocks joined."""
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    for k, v in blocks:
        part, part_lse = _attend(q, k, v)
        if out is None or lse is None:
            out, lse = part.to(part_lse.dtype), part_lse
            continue
        new_lse = torch.logaddexp(lse, part_lse)
        out = out * torch.exp(lse - new_lse)[..., None] + part.to(lse.dtype) * torch.exp(part_lse - new_lse)[..., None]
        lse = new_lse
    assert out is not None
    return out


def measure_ring_attention(*, tokens: Sequence[int], ring_degrees: Sequence[int], num_heads: int, head_dim: int,
                           device: torch.device, dtype: torch.dtype, warmup: int, repeats: int,
                           ulysses_degree: int = 1, clock: CpuClock = "wall", seed: int = 0
                           ) -> list[RingAttentionRecord]:
    """``ring_attention`` records of every sample size x ring degree whose blocks and heads split
    evenly (``tokens % r == 0``, ``num_heads % r == 0``; ``num_heads`` are the rank's, ``H/u``).

    Raises:
        ValueError: when no (size, degree) pair splits evenly.
    """
    gen = torch.Generator().manual_seed(seed)
    cases = [(s, r) for s in tokens for r in ring_degrees if r > 1 and s % r == 0 and num_heads % r == 0 and s >= r]
    if not cases:
        raise ValueError(f"no sample size of {list(tokens)} and ring degree of {list(ring_degrees)} splits "
                         f"evenly (tokens and num_heads={num_heads} divisible by the degree)")

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_(True)

    steps: list[Callable[[], None]] = []
    for s, r in cases:
        q = tensor(num_heads, s // r, head_dim)
        blocks = [(tensor(num_heads, s // r, head_dim), tensor(num_heads, s // r, head_dim)) for _ in range(r)]
        uq, uk, uv = (tensor(num_heads // r, s, head_dim) for _ in range(3))

        def ring_step(q=q, blocks=blocks) -> None:  # type: ignore[no-untyped-def]
            ring_steps(q, blocks).sum().backward()

        def one_kernel(q=uq, k=uk, v=uv) -> None:  # type: ignore[no-untyped-def]
            _attend(q, k, v)[0].float().sum().backward()

        steps += [ring_step, one_kernel]
    timings = time_interleaved(steps, device=device, warmup=warmup, repeats=repeats, clock=clock)
    records = []
    for i, (s, r) in enumerate(cases):
        ring, one = timings[2 * i], timings[2 * i + 1]
        records.append(RingAttentionRecord(
            tokens=s, ulysses_degree=ulysses_degree, ring_degree=r, num_heads=num_heads, head_dim=head_dim,
            causal=False, time_s=ring.time_s, time_s_min=ring.time_s_min, time_s_max=ring.time_s_max,
            num_repeats=ring.num_repeats, ulysses_time_s=one.time_s))
    return records


def measure_ring_steps_one_gpu(*, block_bytes: Sequence[int], compute_dims: Sequence[int], device: torch.device,
                               warmup: int, repeats: int) -> list[CommRecord]:
    """``ring_step`` records on one CUDA device (the module docstring): every block size x product
    size.

    Raises:
        ValueError: on a device that is not CUDA.
    """
    if device.type != "cuda":
        raise ValueError(f"one-device ring steps need a CUDA device (a second stream), got {device}")
    side = torch.cuda.Stream(device=device)
    cases = [(b, n) for b in block_bytes for n in compute_dims]
    steps: list[Callable[[], None]] = []
    for nbytes, n in cases:
        src = torch.ones(max(1, nbytes // 2), dtype=torch.bfloat16, device=device)
        dst = torch.empty_like(src)
        mat = torch.randn(n, n, dtype=torch.bfloat16, device=device)

        def hop(src=src, dst=dst) -> None:  # type: ignore[no-untyped-def]
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
            torch.cuda.current_stream(device).wait_stream(side)

        def compute(mat=mat) -> None:  # type: ignore[no-untyped-def]
            torch.mm(mat, mat)

        def step(src=src, dst=dst, mat=mat) -> None:  # type: ignore[no-untyped-def]
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
            torch.mm(mat, mat)
            torch.cuda.current_stream(device).wait_stream(side)

        steps += [step, hop, compute]
    timings = time_interleaved(steps, device=device, warmup=warmup, repeats=repeats)
    records = []
    for i, (nbytes, _) in enumerate(cases):
        both, hop_t, comp_t = timings[3 * i: 3 * i + 3]
        records.append(CommRecord(op="ring_step", group_size=2, num_nodes=1, bytes_per_rank=float(nbytes),
                                  time_s=both.time_s, time_s_min=both.time_s_min, time_s_max=both.time_s_max,
                                  num_repeats=both.num_repeats, backend="cuda-copy", compute_s=comp_t.time_s,
                                  hop_s=hop_t.time_s))
    return records
