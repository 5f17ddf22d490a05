"""Shape classes (``SampleClasses.of``, which inlines ``Sample.shape_key`` for speed) and the batch
arrays gathered through them (``BatchArrays.of_classes``) agree with the samples' own fields."""

from __future__ import annotations

import numpy as np

from costmodel.specs import Sample
from planner.assemble import BatchArrays
from planner.costs import SampleClasses
from planner.workload import WorkloadSpec, sample_batch


def _mixed() -> list[Sample]:
    samples = [s for name in ("text-longtail", "video-short")
               for s in sample_batch(WorkloadSpec.preset(name), num_samples=256, seed=3, step=0)]
    samples = [s.model_copy(update={"id": f"{i}"}) for i, s in enumerate(samples)]
    # A one-frame clip and a text sample of the same token count: keys (1, 12) and (1, 12).
    samples += [Sample(id="clip1", frames=1, height=3, width=4), Sample(id="text12", tokens=12),
                Sample(id="clip2", frames=2, height=3, width=2), Sample(id="text12b", tokens=12)]
    return samples


def test_classes_are_the_samples_shape_keys() -> None:
    samples = _mixed()
    classes = SampleClasses.of(samples)
    keys = [s.shape_key for s in samples]
    assert len(set(classes.class_of)) == len(set(keys))
    for i, s in enumerate(samples):
        c = classes.class_of[i]
        assert i in classes.members[c]
        assert (classes.tokens[c], classes.frames[c], classes.spatial[c]) == (
            s.tokens, s.num_frames, s.spatial_tokens), s
        first = classes.members[c][0]
        assert keys[first] == keys[i]
    assert classes.class_of[-4] == classes.class_of[-3] == classes.class_of[-1]  # (1, 12) all three


def test_arrays_through_classes_equal_the_samples() -> None:
    samples = _mixed()
    direct, through = BatchArrays.of(samples), BatchArrays.of_classes(SampleClasses.of(samples))
    for name in ("tokens", "frames", "spatial"):
        a, b = getattr(direct, name), getattr(through, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
