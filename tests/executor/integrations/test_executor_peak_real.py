"""The executor's measured peak on real-class Llama and Wan against the cost model (CPU).

One micro-batch of three samples under three checkpoint policies (none, selective-2, full of 4
layers) runs through the executor's ``hf_transformers`` / ``hf_wan`` integrations on one rank
(``bench/executor_peak_real.py``, which also writes the figure); the peak of live bytes over
forward+backward must be within 5% of ``CostModel.activation_bytes`` from the analytic default
(the family's counted kept bytes) with the layer's backward transient profiled on this CPU.
Without the counted bytes (the formula of the model's kind) the prediction misses by more.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import executor_peak_real as bench

TOLERANCE = 0.05


@pytest.mark.parametrize("case", ["llama", "wan"])
def test_executor_peak_within_5_percent_of_the_prediction(case: str) -> None:
    spec, measured, tokens = (bench.llama_case if case == "llama" else bench.wan_case)()
    assert len(set(bench.POLICIES)) == 3 and max(bench.POLICIES) == spec.num_layers
    row = bench.compare(spec, measured, tokens)
    assert abs(row["ratio"] - 1) <= TOLERANCE, row
    generic = bench.compare(spec, measured, tokens, transient=row["transient_bytes_per_token_cpu"], generic=True)
    assert abs(generic["ratio"] - 1) > TOLERANCE, generic
