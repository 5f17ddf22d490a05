"""``dcp manifest`` on real files: Parquet, JSON Lines, a saved HF dataset, encoded videos."""

from __future__ import annotations

import json
from pathlib import Path

import av
import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from dcp_cli.main import app
from planner.workload import read_manifest

runner = CliRunner(env={"COLUMNS": "250"})  # long tmp paths stay on one line
datasets.disable_progress_bars()


def _run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["manifest", *args])
    text = result.output.translate({ord(c): " " for c in "│╭╮╰╯─"})  # rich boxes wrap long messages
    return result.exit_code, " ".join(text.split())


def _encode(path: Path, *, num_frames: int, width: int, height: int, codec: str = "mpeg4") -> None:
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=24)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 8 * i, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_parquet_reads_only_the_named_columns(tmp_path: Path) -> None:
    table = pa.table({"doc": ["a", "b", "c"], "text": ["x" * 100] * 3, "n": [812, 70000, 5]})
    pq.write_table(table, tmp_path / "train.parquet")
    out = tmp_path / "m.jsonl"
    code, output = _run(str(tmp_path / "train.parquet"), "--id-column", "doc", "--tokens-column", "n",
                        "-o", str(out))
    assert code == 0, output
    assert [(s.id, s.tokens) for s in read_manifest(out)] == [("a", 812), ("b", 70000), ("c", 5)]
    assert "3 1D samples" in output and "max 70,000" in output
    # Existing output is kept unless --force.
    code, output = _run(str(tmp_path / "train.parquet"), "--tokens-column", "n", "-o", str(out))
    assert code == 2 and "--out" in output and "--force" in output
    code, output = _run(str(tmp_path / "train.parquet"), "--tokens-column", "n", "-o", str(out),
                        "--force", "--id-prefix", "p-", "-q")
    assert code == 0 and output == ""
    assert [s.id for s in read_manifest(out)] == ["p-0", "p-1", "p-2"]  # no id column: row numbers


def test_jsonl_2d_scaled_and_payload_never_parsed(tmp_path: Path) -> None:
    rows = [{"id": 7, "caption": "a cat", "num_frames": 51, "height": 720, "width": 1280},
            # The payload changes type between rows: a reader that built it would fail.
            {"id": 8, "caption": {"nested": [1, 2]}, "num_frames": 17, "height": 256, "width": 256}]
    source = tmp_path / "clips.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "m.jsonl"
    code, output = _run(str(source), "--frames-column", "num_frames", "--temporal-compression", "4",
                        "--spatial-compression", "16", "-o", str(out))
    assert code == 0, output
    samples = read_manifest(out)
    # ceil(51/4)=13 latent frames, 720/16=45, 1280/16=80; ceil(17/4)=5, 256/16=16.
    assert [(s.id, s.frames, s.height, s.width, s.tokens) for s in samples] == [
        ("7", 13, 45, 80, 13 * 45 * 80), ("8", 5, 16, 16, 5 * 16 * 16)]
    code, output = _run(str(source), "--frames-column", "num_frames", "--frame-stride", "2",
                        "--max-frames", "16", "--temporal-compression", "4", "--spatial-compression", "16",
                        "-o", str(out), "--force")
    assert code == 0, output
    assert [s.frames for s in read_manifest(out)] == [4, 3]  # min(ceil(51/2), 16)/4, ceil(ceil(17/2)/4)


def test_bad_input_names_the_option_and_writes_nothing(tmp_path: Path) -> None:
    source = tmp_path / "t.jsonl"
    source.write_text('{"id": "a", "len": 10}\n{"id": "b", "len": 0}\n{"id": "c", "len": 5}\n')
    out = tmp_path / "m.jsonl"
    code, output = _run(str(source), "--tokens-column", "length", "-o", str(out))
    assert code == 2 and "--tokens-column 'length': no such column" in output and "id, len" in output
    code, output = _run(str(source), "-o", str(out))
    assert code == 2 and "--tokens-column" in output
    code, output = _run(str(source), "--tokens-column", "len", "-o", str(out))
    assert code == 2 and "row 1: column 'len' is 0" in output
    assert list(tmp_path.iterdir()) == [source]  # no manifest, no temporary file left
    code, output = _run(str(source), "--tokens-column", "len", "-o", str(out), "--skip-invalid")
    assert code == 0 and "skipped 1" in output
    assert [s.id for s in read_manifest(out)] == ["a", "c"]
    code, output = _run("-o", str(out))
    assert code == 2 and "--workload" in output
    code, output = _run(str(tmp_path / "nope.parquet"), "-o", str(tmp_path / "x.jsonl"))
    assert code == 2 and "nope.parquet: no such file" in output


def test_hf_dataset_on_disk(tmp_path: Path) -> None:
    split = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], list(range(50))], "text": ["a", "b"]})
    datasets.DatasetDict({"train": split, "test": split.select([1])}).save_to_disk(tmp_path / "hf")
    out = tmp_path / "m.jsonl"
    code, output = _run(str(tmp_path / "hf"), "--tokens-column", "input_ids", "-o", str(out))
    assert code == 2 and "test, train" in output and "--split" in output
    code, output = _run(str(tmp_path / "hf"), "--tokens-column", "input_ids", "--split", "train", "-o", str(out))
    assert code == 0, output
    assert [(s.id, s.tokens) for s in read_manifest(out)] == [("0", 3), ("1", 50)]
    code, output = _run(str(tmp_path / "hf"), "--split", "val", "-o", str(tmp_path / "x.jsonl"))
    assert code == 2 and "--split 'val'" in output


def test_video_directory_from_metadata(tmp_path: Path) -> None:
    videos = tmp_path / "videos"
    (videos / "sub").mkdir(parents=True)
    _encode(videos / "a.mp4", num_frames=17, width=64, height=48)
    _encode(videos / "sub" / "b.mkv", num_frames=9, width=32, height=32)  # no frame count stored
    out = tmp_path / "m.jsonl"
    code, output = _run(str(videos), "-o", str(out))
    assert code == 2 and "--temporal-compression" in output and "--spatial-compression" in output
    code, output = _run(str(videos), "--temporal-compression", "4", "--spatial-compression", "16", "-o", str(out))
    assert code == 0, output
    assert [(s.id, s.frames, s.height, s.width) for s in read_manifest(out)] == [
        ("a.mp4", 5, 3, 4), ("sub/b.mkv", 3, 2, 2)]
    (videos / "broken.mp4").write_bytes(b"not a video")
    code, output = _run(str(videos), "--temporal-compression", "1", "--spatial-compression", "1",
                        "-o", str(out), "--force")
    assert code == 2 and "broken.mp4" in output
    assert len(read_manifest(out)) == 2  # the earlier manifest is untouched
    code, output = _run(str(videos), "--temporal-compression", "1", "--spatial-compression", "1",
                        "-o", str(out), "--force", "--skip-invalid")
    assert code == 0 and "skipped 1" in output
    assert [(s.frames, s.height, s.width) for s in read_manifest(out)] == [(17, 48, 64), (9, 32, 32)]


@pytest.mark.parametrize("workload", ["text-longtail", "video-short"])
def test_workload_preset_is_reproducible(tmp_path: Path, workload: str) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for out in (first, second):
        code, output = _run("--workload", workload, "--num-samples", "64", "--seed", "3", "-o", str(out))
        assert code == 0, output
    assert first.read_text() == second.read_text()
    assert len(read_manifest(first)) == 64
    code, output = _run("--workload", "nosuch", "-o", str(tmp_path / "c.jsonl"))
    assert code == 2 and "nosuch" in output and not (tmp_path / "c.jsonl").exists()
