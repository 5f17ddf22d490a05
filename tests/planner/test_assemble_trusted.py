"""``assemble.trusted_model`` builds the same instances as pydantic's ``model_construct`` (the
assembly's ``PlannedSample`` and ``MicroBatch``): equal, the same ``__dict__`` (field order
included), fields set, extra and private values, dump and plan digest. It sets pydantic's own
instance attributes, so a pydantic release that changes them fails here first."""

from __future__ import annotations

from pydantic import BaseModel

from costmodel.specs import Sample
from planner.assemble import trusted_model
from planner.plan import MicroBatch, PlannedSample


def _same(built: BaseModel, reference: BaseModel) -> None:
    assert type(built) is type(reference)
    assert built == reference
    assert list(vars(built).items()) == list(vars(reference).items())
    for name in ("__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__"):
        assert getattr(built, name) == getattr(reference, name), name
    assert built.model_dump() == reference.model_dump()
    assert built.model_dump_json() == reference.model_dump_json()


def test_trusted_model_equals_model_construct() -> None:
    samples = [Sample(id="text-0", tokens=4096), Sample(id="video-1", tokens=256, frames=4, height=8, width=8)]
    planned = [trusted_model(PlannedSample, {"sample": s, "recompute_layers": k, "predicted_time_s": 0.25 * (k + 1),
                                             "predicted_activation_bytes": 1.5e9})
               for k, s in enumerate(samples)]
    reference = [PlannedSample.model_construct(sample=s, recompute_layers=k, predicted_time_s=0.25 * (k + 1),
                                               predicted_activation_bytes=1.5e9)
                 for k, s in enumerate(samples)]
    for built, ref in zip(planned, reference, strict=True):
        _same(built, ref)
    mb = trusted_model(MicroBatch, {"samples": planned, "predicted_time_s": 0.6, "predicted_peak_mem_bytes": 3e9})
    ref_mb = MicroBatch.model_construct(samples=reference, predicted_time_s=0.6, predicted_peak_mem_bytes=3e9)
    _same(mb, ref_mb)
    # Each instance has its own fields set (pydantic's is per instance too).
    assert planned[0].__pydantic_fields_set__ is not planned[1].__pydantic_fields_set__
    # Frozen as constructed instances are.
    try:
        mb.predicted_time_s = 1.0  # type: ignore[misc]
    except Exception as exc:  # pydantic's ValidationError for a frozen instance
        assert "frozen" in str(exc)
    else:
        raise AssertionError("a trusted MicroBatch took an assignment")
