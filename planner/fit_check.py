"""Every sample of a manifest fits somewhere, checked before an epoch is stored or accepted.

The planner refuses a batch holding a sample that fits on no allowed group even with full
checkpointing (``planner.planning.prepare``). An epoch job would meet that sample only at its
step, after the store was written (the CLI) or the job was accepted (the API); this check meets
it first, with the same message. A sample's activation memory grows with its tokens, so of the
1D samples only the longest is planned; each distinct 2D shape is, in chunks of at most
``MAX_SAMPLES_PER_REQUEST``.
"""

from __future__ import annotations

from collections.abc import Sequence

from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec, Sample
from planner.config import PlannerConfig
from planner.limits import MAX_SAMPLES_PER_REQUEST


def representatives(samples: Sequence[Sample]) -> list[Sample]:
    """The longest 1D sample and the first sample of each distinct 2D shape, in manifest order."""
    longest: Sample | None = None
    shapes: dict[tuple[int, int, int], Sample] = {}
    for sample in samples:
        if sample.is_2d:
            shape = (sample.frames, sample.height, sample.width)
            shapes.setdefault(shape, sample)  # type: ignore[arg-type]
        elif longest is None or sample.tokens > longest.tokens:
            longest = sample
    chosen = {id(s) for s in shapes.values()} | ({id(longest)} if longest is not None else set())
    return [s for s in samples if id(s) in chosen]


def check_samples_fit(samples: Sequence[Sample], *, cluster: ClusterSpec, cost_model: CostModelFile,
                      config: PlannerConfig) -> None:
    """Raise when a sample fits nowhere on ``cluster`` under ``cost_model`` and ``config``.

    Raises:
        ValueError: the planner's own message naming the sample (its tokens, the activation
            memory it needs on the largest allowed group, the limit), or any other reason the
            planner refuses the batch before planning (a world the sizes cannot partition,
            model states over the memory cap, samples of the other kind than the model).
    """
    from planner.planning import prepare

    chosen = representatives(samples)
    for start in range(0, len(chosen), MAX_SAMPLES_PER_REQUEST):
        prepare(chosen[start:start + MAX_SAMPLES_PER_REQUEST], cluster=cluster, cost_model=cost_model,
                config=config)
