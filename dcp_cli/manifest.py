"""``dcp manifest``: a manifest (sample ids and shapes) from a dataset, or from a workload preset."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import typer
from rich.console import Console

from dcp_cli.progress import progress_bar
from dcp_cli.style import fail, fmt_count, require_parent

_COLUMNS = "Columns (tables, Hugging Face datasets)"
_VIDEO = "2D shapes: pixels to latent patches"
_SYNTH = "Synthetic (instead of SOURCE)"


class SourceType(StrEnum):
    """What SOURCE is (detected when not given)."""

    table = "table"
    videos = "videos"
    hf = "hf"


class SampleKind(StrEnum):
    """1D (tokens) or 2D (frames x height x width) samples."""

    one_d = "1d"
    two_d = "2d"


def register(app: typer.Typer) -> None:
    """Add ``dcp manifest`` to the app."""

    @app.command("manifest", short_help="A manifest (sample ids and shapes) from a dataset or a workload.")
    def manifest(
        source: Path | None = typer.Argument(
            None, metavar="SOURCE", show_default=False,
            help="A table file or directory of shards (.parquet .jsonl .json .arrow .feather .csv), "
                 "a directory of videos, or a directory saved by datasets' save_to_disk."),
        out: Path = typer.Option(..., "--out", "-o", help="Manifest to write (JSON Lines)."),
        force: bool = typer.Option(False, "--force", help="Replace --out if it exists."),
        source_type: SourceType | None = typer.Option(None, help="What SOURCE is (default: detected)."),
        kind: SampleKind | None = typer.Option(
            None, help="1d or 2d (default: 2d when frames, height and width columns exist)."),
        id_column: str | None = typer.Option(None, help="Id column (default: id, else the row number).",
                                             rich_help_panel=_COLUMNS),
        tokens_column: str | None = typer.Option(
            None, help="1D length: integers, or a list column (e.g. input_ids) whose length is taken "
                       "(default: tokens).", rich_help_panel=_COLUMNS),
        frames_column: str | None = typer.Option(None, help="2D frames (default: frames).",
                                                 rich_help_panel=_COLUMNS),
        height_column: str | None = typer.Option(None, help="2D height (default: height).",
                                                 rich_help_panel=_COLUMNS),
        width_column: str | None = typer.Option(None, help="2D width (default: width).",
                                                rich_help_panel=_COLUMNS),
        split: str | None = typer.Option(None, help="Split of a saved DatasetDict.",
                                         rich_help_panel=_COLUMNS),
        id_prefix: str = typer.Option("", help="Prepended to every id.", rich_help_panel=_COLUMNS),
        frame_stride: int = typer.Option(1, min=1, help="Use every n-th frame.", rich_help_panel=_VIDEO),
        max_frames: int | None = typer.Option(None, min=1, help="Frames used at most (after the stride).",
                                              rich_help_panel=_VIDEO),
        temporal_compression: int | None = typer.Option(
            None, min=1, help="Frames per latent frame (VAE) (default: 1; required for videos).",
            rich_help_panel=_VIDEO),
        spatial_compression: int | None = typer.Option(
            None, min=1, help="Pixels per latent patch side, VAE factor x patch size (8x2 = 16) "
                              "(default: 1; required for videos).", rich_help_panel=_VIDEO),
        workload: str | None = typer.Option(None, help="Workload preset to sample (see dcp presets).",
                                            rich_help_panel=_SYNTH),
        num_samples: int = typer.Option(4096, min=1, help="Samples to draw from --workload.",
                                        rich_help_panel=_SYNTH),
        seed: int = typer.Option(0, help="Seed of --workload sampling.", rich_help_panel=_SYNTH),
        skip_invalid: bool = typer.Option(False, help="Skip bad rows and unreadable videos (counted) "
                                                      "instead of stopping at the first."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or summary."),
    ) -> None:
        """Write a manifest from SOURCE or --workload: one JSON line per sample.

        1D: {"id", "tokens"}; 2D: {"id", "frames", "height", "width", "tokens"}. Only the id
        and shape columns of SOURCE are read (videos: container metadata only). Nothing is
        written unless every sample is good (or --skip-invalid).
        """
        require_parent(out, option="--out")
        from ingest import Columns, LatentScale, iter_samples, write_manifest_file

        if (source is None) == (workload is None):
            fail("give a SOURCE dataset or --workload NAME (exactly one)")
        skipped: list[str] = []
        err = Console(stderr=True)
        try:
            if workload is not None:
                from planner.limits import check_manifest_size
                from planner.workload import WorkloadSpec, synthesize_manifest

                check_manifest_size(num_samples, name="--num-samples")
                samples = iter(synthesize_manifest(WorkloadSpec.preset(workload), num_samples=num_samples,
                                                   seed=seed))
                what = f"workload {workload}"
                stats = write_manifest_file(samples, out, overwrite=force)
            else:
                assert source is not None
                scale = None
                if temporal_compression or spatial_compression or frame_stride > 1 or max_frames:
                    scale = LatentScale(frame_stride=frame_stride, max_frames=max_frames,
                                        temporal_compression=temporal_compression or 1,
                                        spatial_compression=spatial_compression or 1)
                columns = Columns(id=id_column, tokens=tokens_column, frames=frames_column,
                                  height=height_column, width=width_column)
                what = str(source)
                with progress_bar(f"reading {source.name}", quiet=quiet) as update:
                    samples = iter_samples(
                        source, source=source_type.value if source_type else None, columns=columns,
                        kind=kind.value if kind else None, scale=scale,  # type: ignore[arg-type]
                        split=split, id_prefix=id_prefix, on_skip=skipped.append if skip_invalid else None,
                        progress=update)
                    stats = write_manifest_file(samples, out, overwrite=force,
                                                on_skip=skipped.append if skip_invalid else None)
        except ValueError as exc:
            fail(str(exc))
        if quiet:
            return
        counts = sorted(stats.token_counts)
        shape = "2D" if stats.num_2d == stats.num_samples else "1D" if not stats.num_2d else "1D+2D"
        err.print(f"wrote {out}: {fmt_count(stats.num_samples)} {shape} samples from {what}; tokens "
                  f"min {fmt_count(stats.min_tokens)}, median {fmt_count(counts[len(counts) // 2])}, "
                  f"max {fmt_count(stats.max_tokens)}, total {fmt_count(stats.total_tokens)}")
        if skipped:
            err.print(f"skipped {len(skipped)} bad row(s) or file(s); first: {skipped[0]}")
