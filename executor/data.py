"""Data loading under a plan: each rank loads exactly the samples of its micro-batches.

:class:`PlanBatchSampler` is a batch sampler for ``torch.utils.data.DataLoader``: for each step
it asks for the rank's plan and yields one list of dataset indices per micro-batch of the
rank's group, so the user's DataLoader (and its workers) does the loading. Every rank of a
group loads the same whole samples and the executor keeps its own shard.
:class:`SyntheticDataset` is a deterministic map-style dataset over a manifest, for examples,
tests and benchmarks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch.utils.data import Dataset

from costmodel.specs import Sample
from planner.plan import RankPlan


class PlanBatchSampler:
    """Yields, step after step, the dataset indices of each of this rank's micro-batches."""

    def __init__(self, *, plan_for_step: Callable[[int], RankPlan], steps: Sequence[int],
                 index_of: Mapping[str, int]) -> None:
        """Bind the sampler to a plan source.

        Args:
            plan_for_step: Returns this rank's plan of a step (e.g. ``PlanClient.get``).
            steps: The steps to iterate, in order.
            index_of: Dataset index of every sample id.
        """
        self.plan_for_step = plan_for_step
        self.steps = list(steps)
        self.index_of = index_of

    def indices(self, rank_plan: RankPlan) -> list[list[int]]:
        """Dataset indices of each micro-batch of a plan.

        Raises:
            ValueError: naming a planned sample id missing from the dataset.
        """
        out = []
        for micro in rank_plan.group.micro_batches:
            batch = []
            for ps in micro.samples:
                if ps.sample.id not in self.index_of:
                    raise ValueError(f"step {rank_plan.step}: planned sample {ps.sample.id!r} "
                                     "is not in the dataset")
                batch.append(self.index_of[ps.sample.id])
            out.append(batch)
        return out

    def __iter__(self) -> Iterator[list[int]]:
        for step in self.steps:
            yield from self.indices(self.plan_for_step(step))


def _seed(sample_id: str, seed: int) -> int:
    digest = hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class SyntheticDataset(Dataset[dict[str, object]]):
    """Deterministic random data for a manifest: token ids (1D) or latent patches (2D)."""

    def __init__(self, samples: Sequence[Sample], *, kind: str, vocab: int = 64,
                 channels: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        """Describe the data.

        Args:
            samples: The manifest.
            kind: ``1d`` (token ids and next-token targets), ``2d`` or ``3d`` (patches and targets).
            vocab: Vocabulary size (1D).
            channels: Channels per patch (2D).
            seed: Data seed.
            dtype: Dtype of 2D tensors.

        Raises:
            ValueError: for an unknown kind or duplicate sample ids.
        """
        if kind not in ("1d", "2d", "3d"):
            raise ValueError(f"kind must be '1d', '2d' or '3d', got {kind!r}")
        self.samples = list(samples)
        self.index_of = {s.id: i for i, s in enumerate(self.samples)}
        if len(self.index_of) != len(self.samples):
            raise ValueError("the manifest has duplicate sample ids")
        self.kind, self.vocab, self.channels, self.seed, self.dtype = kind, vocab, channels, seed, dtype

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, object]:
        sample = self.samples[index]
        gen = torch.Generator().manual_seed(_seed(sample.id, self.seed))
        if self.kind == "1d":
            ids = torch.randint(self.vocab, (sample.tokens + 1,), generator=gen)
            return {"id": sample.id, "inputs": ids[:-1], "targets": ids[1:]}
        shape = (sample.tokens, self.channels)
        return {"id": sample.id,
                "inputs": torch.randn(shape, generator=gen).to(self.dtype),
                "targets": torch.randn(shape, generator=gen).to(self.dtype)}

    def load(self, sample: Sample) -> dict[str, object]:
        """The item of a planned sample."""
        if sample.id not in self.index_of:
            raise ValueError(f"sample {sample.id!r} is not in the dataset")
        return self[self.index_of[sample.id]]


def collate_items(batch: list[dict[str, object]]) -> list[dict[str, object]]:
    """DataLoader ``collate_fn`` that keeps a micro-batch as a list of items (lengths differ)."""
    return batch
