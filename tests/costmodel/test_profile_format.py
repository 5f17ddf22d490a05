"""The dcp-profile/4 format: round trips and refusals with reasons; older versions still load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from costmodel.presets import load_model
from costmodel.profiling.format import (
    ComputeRecord,
    ProfileHeader,
    dump_line,
    narrowed,
    parse_profile_lines,
    read_profile,
    write_profile,
)
from dcp_cli.main import app

MODEL = load_model("llama-7b")
PROFILED = narrowed(MODEL, num_layers=2, hidden=128, num_heads=4, ffn_hidden=344, vocab=1000)


def _header(**update: object) -> dict[str, object]:
    h = ProfileHeader(hardware="cpu", device="cpu", dtype="float32", model=MODEL, profiled=PROFILED)
    return {**h.model_dump(mode="json"), **update}


def _compute(**update: object) -> dict[str, object]:
    rec = {"record": "compute", "num_layers": 2, "recompute_layers": 1, "samples": [[1, 256]],
           "time_s": 0.01, "time_s_min": 0.009, "time_s_max": 0.012, "num_repeats": 5,
           "activation_bytes": 1e6, "group_size": 1, "tokens_per_rank": 256}
    return {**rec, **update}


def _comm(**update: object) -> dict[str, object]:
    rec = {"record": "comm", "op": "alltoall", "group_size": 2, "num_nodes": 1, "bytes_per_rank": 65536.0,
           "time_s": 1e-4, "time_s_min": 9e-5, "time_s_max": 2e-4, "num_repeats": 10}
    return {**rec, **update}


def _lines(*records: dict[str, object]) -> list[str]:
    return [json.dumps(r) for r in records]


def test_round_trip(tmp_path: Path) -> None:
    header = ProfileHeader.model_validate(_header())
    rec = ComputeRecord.model_validate(_compute())
    path = tmp_path / "p.jsonl"
    write_profile(path, header, [rec, rec])
    profile = read_profile(path)
    assert profile.header == header
    assert profile.compute == [rec, rec]
    assert json.loads(dump_line(rec)) == json.loads(json.dumps(rec.model_dump(mode="json")))
    assert profile.compute[0].num_tokens == 256
    assert header.dtype_bytes == 4


@pytest.mark.parametrize(
    ("lines", "reason"),
    [
        ([], "empty profile"),
        (_lines(_compute()), "first record must be a header"),
        (["not json"], "not JSON"),
        (_lines(_header(format="dcp-profile/9")), "format 'dcp-profile/9'"),
        (_lines(_header(), {k: v for k, v in _compute().items() if k != "time_s"}), "time_s: Field required"),
        (_lines(_header(), _compute(time_s=-1.0, time_s_min=-2.0)), "time_s: Input should be greater than 0"),
        (_lines(_header(), _compute(activation_bytes=-5)), "activation_bytes"),
        (_lines(_header(), _compute(recompute_layers=3)), "recompute_layers=3 exceeds num_layers=2"),
        (_lines(_header(), _compute(time_s=0.5)), "must lie between"),
        (_lines(_header(), _compute(num_layers=3, recompute_layers=0)), "exceeds profiled.num_layers=2"),
        (_lines(_header(), _compute(samples=[[2, 128]])), "frames != 1"),
        (_lines(_header(), _compute(samples=[[1, 0]])), "must be positive"),
        (_lines(_header(), _compute(record="flops")), "record"),
        (_lines(_header(), _compute(extra_field=1)), "extra_field"),
        (_lines(_header(model=None)), "give both model and profiled"),
        (_lines(_header(hardware="")), "hardware"),
        (_lines(_header(), _comm(context="overlapped")), "context"),
    ],
)
def test_bad_profile_is_refused_with_reason(lines: list[str], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_profile_lines(lines, source="bad.jsonl")


def test_error_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(_lines(_header(), _compute(), _compute(time_s_min=-1))) + "\n")
    reason = r"bad.jsonl:3: invalid record \(dcp-profile/4\): compute.time_s_min: Input should be greater than 0"
    with pytest.raises(ValueError, match=reason):
        read_profile(path)
    with pytest.raises(ValueError, match="does not exist"):
        read_profile(tmp_path / "missing.jsonl")


def test_narrowed_keeps_the_gqa_ratio_and_validates() -> None:
    model = MODEL.model_copy(update={"num_kv_heads": 8})
    small = narrowed(model, num_layers=1, hidden=256, num_heads=8)
    assert small.kv_heads == 2 and small.num_layers == 1 and small.ffn_hidden == model.ffn_hidden
    with pytest.raises(ValueError, match="exceeds"):
        narrowed(MODEL, num_layers=MODEL.num_layers + 1)
    with pytest.raises(ValueError, match="not divisible"):
        narrowed(MODEL, num_layers=1, hidden=100, num_heads=3)


def test_cli_fit_refuses_a_bad_profile_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(_lines(_header(), _compute(time_s=-1.0))) + "\n")
    result = CliRunner(env={"COLUMNS": "250"}).invoke(  # long tmp paths stay on one line
        app, ["fit", str(path), "--out", str(tmp_path / "cm.json")])
    assert result.exit_code != 0
    assert "bad.jsonl:2" in result.output and "time_s" in result.output
    assert not (tmp_path / "cm.json").exists()


def test_collectives_say_how_they_were_measured() -> None:
    """Version 2 collectives were all back to back (``isolated``); version 3 may carry
    ``in_layer`` ones, which survive a round trip."""
    old = parse_profile_lines(_lines(_header(format="dcp-profile/2"), _comm()), source="v2.jsonl")
    assert [r.context for r in old.comm] == ["isolated"]
    new = parse_profile_lines(_lines(_header(), _comm(), _comm(context="in_layer", time_s=3e-4, time_s_min=3e-4,
                                                               time_s_max=3e-4)), source="v3.jsonl")
    assert [r.context for r in new.comm] == ["isolated", "in_layer"]
    assert new.header.format == "dcp-profile/4"
    again = parse_profile_lines([json.dumps(new.header.model_dump(mode="json")),
                                 *(dump_line(r) for r in new.comm)], source="again.jsonl")
    assert again.comm == new.comm


def _ring_step(**update: object) -> dict[str, object]:
    return {**_comm(op="p2p"), "op": "ring_step", "time_s": 3e-3, "time_s_min": 2.9e-3, "time_s_max": 3.2e-3,
            "compute_s": 2.5e-3, "hop_s": 1e-3, **update}


def _ring_attention(**update: object) -> dict[str, object]:
    return {"record": "ring_attention", "tokens": 4096, "ulysses_degree": 1, "ring_degree": 4, "num_heads": 4,
            "head_dim": 64, "causal": False, "time_s": 2e-2, "time_s_min": 1.9e-2, "time_s_max": 2.2e-2,
            "num_repeats": 5, "ulysses_time_s": 1.5e-2, **update}


def test_ring_records_round_trip_in_version_4() -> None:
    profile = parse_profile_lines(_lines(_header(), _comm(), _ring_step(), _ring_attention()), source="v4.jsonl")
    assert [r.op for r in profile.comm] == ["alltoall", "ring_step"]
    assert profile.comm[1].compute_s == 2.5e-3 and profile.comm[1].hop_s == 1e-3
    assert profile.ring_attention[0].ring_degree == 4 and profile.ring_attention[0].ulysses_time_s == 1.5e-2
    again = parse_profile_lines([json.dumps(profile.header.model_dump(mode="json")),
                                 *(dump_line(r) for r in (*profile.comm, *profile.ring_attention))], source="again")
    assert again == profile


def test_version_3_profiles_still_load_and_cannot_carry_ring_records() -> None:
    old = parse_profile_lines(_lines(_header(format="dcp-profile/3"), _compute(), _comm()), source="v3.jsonl")
    assert old.header.format == "dcp-profile/3" and len(old.compute) == 1 and old.ring_attention == []
    with pytest.raises(ValueError, match=r"v3.jsonl:2: ring_attention records are format dcp-profile/4"):
        parse_profile_lines(_lines(_header(format="dcp-profile/3"), _ring_attention()), source="v3.jsonl")
    with pytest.raises(ValueError, match=r"v3.jsonl:2: comm records \(ring_step\)"):
        parse_profile_lines(_lines(_header(format="dcp-profile/3"), _ring_step()), source="v3.jsonl")


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (_ring_step(compute_s=None), "compute_s and hop_s are given with ring_step records"),
        ({**_comm(), "compute_s": 1e-3, "hop_s": 1e-3}, "compute_s and hop_s are given with ring_step records"),
        (_ring_attention(ring_degree=1), "ring_degree"),
        (_ring_attention(tokens=3), "fewer tokens than ring_degree"),
        (_ring_attention(ulysses_time_s=0), "ulysses_time_s"),
    ],
)
def test_bad_ring_records_are_refused_with_reason(record: dict[str, object], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_profile_lines(_lines(_header(), record), source="bad.jsonl")
