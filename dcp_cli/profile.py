"""``dcp profile``, ``dcp profile-comm`` and ``dcp fit``: measure, then fit a cost model.

Examples::

    dcp profile --model llama-7b --device cpu --hidden 256 --heads 4 --ffn 688 --vocab 4096 \\
        --out prof.jsonl
    torchrun --standalone --nproc-per-node 4 -m dcp_cli.main profile-comm --out comm.jsonl
    dcp fit prof.jsonl comm.jsonl --out costmodel.json

torch is imported inside the profiling commands only; ``dcp fit`` needs numpy and scipy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dcp_cli.model_option import model_config_option, model_option, resolve_model
from dcp_cli.progress import progress_bar
from dcp_cli.style import fail, require_parent


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise typer.BadParameter(f"{name}={text!r} is not a comma-separated list of integers") from None
    return values


def _progress(quiet: bool = False) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), transient=False, disable=quiet)


def _torch(command: str) -> Any:
    """torch, or a usage error that says how to install it."""
    try:
        import torch
    except ImportError:
        fail(f"dcp {command} measures torch blocks and needs torch: pip install 'dcp-planner[torch]'")
    return torch


def fit_table(result: Any, console: Console) -> None:
    """Print the held-out error of every term."""
    table = Table(title=f"{result.file.id}: held-out MAPE per term")
    for col in ("term", "MAPE", "fit points", "held-out points"):
        table.add_column(col, justify="right")
    for name, term in result.terms.items():
        table.add_row(name, f"{term.mape:.2%}", str(term.num_points), str(term.num_heldout))
    console.print(table)


def register(app: typer.Typer) -> None:
    """Add ``dcp profile``, ``dcp profile-comm`` and ``dcp fit`` to the app."""

    @app.command("profile")
    def profile(
        out: Path = typer.Option(..., help="Profile file to write (JSON Lines, dcp-profile/4)."),
        model: str | None = model_option(help_text="Model preset the cost model is for (default llama-7b)."),
        model_config: Path | None = model_config_option(),
        device: str = typer.Option("cpu", help="cpu or cuda."),
        hardware: str = typer.Option("", help="Hardware name in the profile (default: cpu / cuda)."),
        dtype: str = typer.Option("", help="float32, bfloat16, float16 (default: fp32 cpu, bf16 cuda)."),
        layers: int = typer.Option(2, help="Layers to build (the largest stack run)."),
        layer_counts: str = typer.Option("1,2", help="Stack depths to run."),
        policies: str = typer.Option("all", help="all: every k in 0..n checkpointed; ends: 0 and n."),
        hidden: int = typer.Option(0, help="Narrower hidden size to profile (0 = the model's)."),
        heads: int = typer.Option(0, help="Heads of the narrower shape (0 = the model's)."),
        ffn: int = typer.Option(0, help="MLP size of the narrower shape (0 = the model's)."),
        vocab: int = typer.Option(-1, help="Vocabulary to profile (-1 = the model's)."),
        text_tokens: int = typer.Option(-1, help="2D and 3D: cross-attention text tokens (-1 = the model's)."),
        tokens_min: int = typer.Option(128, help="Smallest micro-batch in tokens."),
        tokens_max: int = typer.Option(2048, help="Largest micro-batch in tokens."),
        num_sizes: int = typer.Option(8, help="Log-spaced single-sample sizes."),
        packings: str = typer.Option("2,4", help="Samples per packed micro-batch."),
        num_packed: int = typer.Option(3, help="Packed micro-batches per packing."),
        frames: str = typer.Option("1,2,4,8,16", help="2D and 3D: frame counts of the sample shapes."),
        group_sizes: str = typer.Option(
            "", help="SP group sizes whose one rank's share is measured (must include 1; "
                     "sizes above 1 identify the attention efficiency curve; default 1,2,4 for the "
                     "look-alike blocks, 1 for a model's own class, which runs whole samples)."),
        look_alike: bool = typer.Option(
            False, "--look-alike", help="With --model-config: profile the look-alike blocks instead "
                                        "of the model's own transformers / diffusers class."),
        head_sizes: int = typer.Option(6, help="Head measurements."),
        warmup: int = typer.Option(2, help="Untimed runs per point."),
        repeats: int = typer.Option(7, help="Timed runs per point (median recorded)."),
        threads: int = typer.Option(0, help="CPU threads for torch (0 = leave as is)."),
        cpu_clock: str = typer.Option(
            "wall", help="CPU timer: wall (perf_counter) or thread (CPU time of the one torch "
                         "thread; robust on a shared machine, needs --threads 1)."),
        seed: int = typer.Option(0, help="Seed of weights, inputs and packings."),
        ring_degrees: str = typer.Option(
            "", help="Also time a ring step's attention on its blocks for these ring degrees (e.g. 2,4): "
                     "ring_attention records, which dcp fit turns into the ring's block efficiency and merges."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    ) -> None:
        """Profile transformer blocks: time and activation bytes per micro-batch and policy.

        With --model-config the model's own decoder layer / transformer block class from
        transformers or diffusers runs (random weights, nothing downloaded); a config whose class
        cannot be imported falls back to the look-alike blocks, and says so.
        """
        require_parent(out, option="--out")
        torch = _torch("profile")

        from costmodel.model_config import read_config
        from costmodel.profiling.format import dump_line, narrowed
        from costmodel.profiling.real_layers import layer_factory
        from costmodel.profiling.sweep import SweepConfig, make_header, run_sweep

        if device not in ("cpu", "cuda"):
            raise typer.BadParameter(f"device={device!r} is not cpu or cuda")
        if device == "cuda" and not torch.cuda.is_available():
            raise typer.BadParameter("device=cuda but no CUDA device is available")
        if threads > 0:
            torch.set_num_threads(threads)
        full = resolve_model(model, model_config, default="llama-7b")
        assert full is not None
        named = f"--model-config {model_config}" if model_config is not None else f"--model {full.name}"
        try:
            shape = narrowed(full, num_layers=layers, hidden=hidden or None, num_heads=heads or None,
                             ffn_hidden=ffn or None, vocab=None if vocab < 0 else vocab,
                             cross_attention_tokens=None if text_tokens < 0 else text_tokens)
            config_data = read_config(model_config) if model_config is not None and not look_alike else None
            factory, blocks_note = layer_factory(config_data, profiled=shape)
            typer.echo(f"dcp profile: {blocks_note}", err=True)
            if factory is not None:
                typer.echo("dcp profile: the model's own class runs whole samples (group size 1): fit the profile "
                           "with dcp fit --attention-half-tokens, or profile --look-alike for groups above 1",
                           err=True)
            config = SweepConfig(
                tokens_min=tokens_min, tokens_max=tokens_max, num_sizes=num_sizes,
                packings=_ints(packings, "packings"), num_packed=num_packed,
                frames=_ints(frames, "frames"), layer_counts=_ints(layer_counts, "layer_counts"),
                group_sizes=_ints(group_sizes or ("1" if factory is not None else "1,2,4"), "group_sizes"),
                policies=policies,  # type: ignore[arg-type]
                num_head_sizes=head_sizes, warmup=warmup, repeats=repeats, seed=seed,
                cpu_clock=cpu_clock,  # type: ignore[arg-type]
            )
            if factory is not None and config.group_sizes != (1,):
                raise ValueError(f"group_sizes={config.group_sizes}: the model's own class runs whole samples; "
                                 "use --group-sizes 1, or --look-alike to emulate a rank's share")
            if cpu_clock == "thread" and torch.get_num_threads() != 1:
                raise ValueError("--cpu-clock thread needs --threads 1")
            if max(config.layer_counts) > shape.num_layers:
                raise ValueError(f"layer_counts={config.layer_counts} exceed profiled.num_layers="
                                 f"{shape.num_layers} (raise --layers)")
            torch_device = torch.device(device)
            dtype_name = dtype or ("float32" if device == "cpu" else "bfloat16")
            degrees = _ints(ring_degrees, "ring_degrees") if ring_degrees else ()
            if any(r < 2 or shape.num_heads % r for r in degrees):
                raise ValueError(f"ring_degrees={list(degrees)}: each must be >= 2 and divide the profiled "
                                 f"shape's num_heads={shape.num_heads}")
            header = make_header(model=full, profiled=shape, hardware=hardware or device,
                                 device=torch_device, dtype=dtype_name,
                                 notes=f"dcp profile {named} --device {device}; {blocks_note}",
                                 cpu_clock=config.cpu_clock)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        with out.open("w") as fh, _progress(quiet) as bar:
            fh.write(dump_line(header) + "\n")
            task = bar.add_task(f"profile {shape.name}", total=None)

            def step(done: int, total: int, desc: str) -> None:
                bar.update(task, completed=done, total=total, description=desc)

            for record in run_sweep(shape, config, device=torch_device, dtype=dtype_name, progress=step,
                                    layer_factory=factory):
                fh.write(dump_line(record) + "\n")
                fh.flush()
            if degrees:
                for ring_record in _ring_attention(shape, config, degrees, device=torch_device, dtype=dtype_name):
                    fh.write(dump_line(ring_record) + "\n")
        typer.echo(f"wrote {out}")

    def _ring_attention(shape: Any, config: Any, degrees: tuple[int, ...], *, device: Any, dtype: str) -> list[Any]:
        from costmodel.profiling.ring_probe import measure_ring_attention
        from costmodel.profiling.sweep import DTYPES, log_sizes

        return measure_ring_attention(
            tokens=log_sizes(config.tokens_min, config.tokens_max, config.num_sizes), ring_degrees=degrees,
            num_heads=shape.num_heads, head_dim=shape.head_size, device=device, dtype=DTYPES[dtype],
            warmup=config.warmup, repeats=config.repeats, clock=config.cpu_clock, seed=config.seed)

    @app.command("profile-comm")
    def profile_comm(
        out: Path = typer.Option(..., help="Profile file rank 0 writes (JSON Lines)."),
        hardware: str = typer.Option("", help="Hardware name in the profile (default: cpu / cuda)."),
        backend: str = typer.Option("auto", help="auto (nccl with CUDA, else gloo), gloo or nccl."),
        bytes_min: int = typer.Option(64 * 1024, help="Smallest message per rank in bytes."),
        bytes_max: int = typer.Option(8 * 1024 * 1024, help="Largest message per rank in bytes."),
        num_sizes: int = typer.Option(6, help="Log-spaced message sizes."),
        group_sizes: str = typer.Option("", help="Group sizes (default: every size 2..world)."),
        gpus_per_node: int = typer.Option(0, help="Ranks per node (0 = detect from host names)."),
        ops: str = typer.Option("alltoall,allreduce", help="Operations to measure: alltoall, allreduce, p2p "
                                "(a ring-attention hop; its links are fitted and printed), ring_step (the hop "
                                "beside a computation: the ring's exposed fraction and per-step cost are "
                                "fitted and printed)."),
        warmup: int = typer.Option(3, help="Untimed operations per point."),
        repeats: int = typer.Option(10, help="Timed operations per point."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    ) -> None:
        """Measure all-to-all, all-reduce and ring hops per group size and message size (run under torchrun)."""
        require_parent(out, option="--out")
        import platform

        torch = _torch("profile-comm")
        import torch.distributed as dist

        from costmodel.profiling.comm import CommSweepConfig, run_comm_sweep
        from costmodel.profiling.format import ProfileHeader, dump_line

        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend not in ("gloo", "nccl"):
            raise typer.BadParameter(f"backend={backend!r} is not auto, gloo or nccl")
        try:
            config = CommSweepConfig(
                bytes_min=bytes_min, bytes_max=bytes_max, num_sizes=num_sizes,
                group_sizes=_ints(group_sizes, "group_sizes"), gpus_per_node=gpus_per_node,
                ops=tuple(o.strip() for o in ops.split(",") if o.strip()), warmup=warmup,
                repeats=repeats,
            )
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        torch.set_num_threads(1)
        dist.init_process_group(backend=backend)
        try:
            rank = dist.get_rank()
            if backend == "nccl":
                device = torch.device("cuda", rank % torch.cuda.device_count())
                torch.cuda.set_device(device)
            else:
                device = torch.device("cpu")
            if rank == 0:
                with _progress(quiet) as bar:
                    task = bar.add_task("profile-comm", total=None)
                    records = run_comm_sweep(config, device=device, progress=lambda d, t, s: bar.update(
                        task, completed=d, total=t, description=s))
            else:
                records = run_comm_sweep(config, device=device)
            if rank == 0:
                name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
                header = ProfileHeader(
                    hardware=hardware or device.type, device=device.type,  # type: ignore[arg-type]
                    device_name=name or "", dtype="float32", world_size=dist.get_world_size(),
                    versions={"python": platform.python_version(), "torch": torch.__version__},
                    notes=f"dcp profile-comm backend={backend}",
                )
                out.write_text("\n".join([dump_line(header), *(dump_line(r) for r in records)]) + "\n")
                typer.echo(f"wrote {out} ({len(records)} records)")
                if any(r.op == "p2p" for r in records):
                    _echo_p2p_fit(records)
                if sum(r.op == "ring_step" for r in records) >= 3:
                    _echo_ring_step_fit(records)
            dist.barrier()
        finally:
            dist.destroy_process_group()

    def _echo_p2p_fit(records: list[Any]) -> None:
        from costmodel.ring import fit_p2p

        links, errors = fit_p2p(records)
        for name, link in (("intra", links.intra), ("inter", links.inter)):
            if link is not None:
                typer.echo(f"p2p {name}: alpha {link.alpha_s * 1e6:.1f} us, {link.bytes_per_s / 1e9:.3f} GB/s, "
                           f"MAPE on its {sum(r.op == 'p2p' and r.placement == name for r in records)} records "
                           f"{errors[name]:.1%}")

    def _echo_ring_step_fit(records: list[Any]) -> None:
        from costmodel.fit_terms import SplitConfig
        from costmodel.ring.fit import fit_ring_steps

        steps = [r for r in records if r.op == "ring_step"]
        phi, overhead, result = fit_ring_steps(steps, SplitConfig(holdout_fraction=0.25, seed=0,
                                                                  time_statistic="median"))
        typer.echo(f"ring step: exposed fraction {phi:.3f}, {overhead * 1e6:.1f} us per step, held-out MAPE "
                   f"{result.mape:.1%} on {result.num_heldout} of {len(steps)} ring_step records")

    @app.command("fit")
    def fit(
        profiles: list[Path] = typer.Argument(..., help="Profile files (compute, and comm if any)."),
        out: Path = typer.Option(..., help="Cost-model file to write."),
        holdout: float = typer.Option(0.25, help="Share of points held out for MAPE."),
        max_mape: float = typer.Option(0.10, help="Refuse a fit above this held-out MAPE."),
        force: bool = typer.Option(False, "--force", help="Write the fit even above --max-mape."),
        time_statistic: str = typer.Option(
            "median", help="median or min (the fastest repeat: steadier on a shared CPU)."),
        seed: int = typer.Option(0, help="Seed of the hold-out split."),
        model_id: str = typer.Option("", "--id", help="Id of the cost model (default fitted-M-HW)."),
        comm_from: str = typer.Option(
            "", help="Hardware preset whose analytic links fill in unmeasured collectives."),
        hardware: str = typer.Option(
            "", help="Hardware the fitted model describes (default: the profile's); plans use it "
                     "only on clusters of this hardware (cpu:N for CPU ranks)."),
        attention_half_tokens: float = typer.Option(
            -1.0, help="Fix the attention half-performance length in tokens per rank instead of "
                       "fitting it (needed for profiles without group sizes above 1; -1 = fit)."),
        price_on: str = typer.Option(
            "auto", "--price-on", help="WORKLOAD@CLUSTER presets on which to price the memory the plans keep "
                                       "free (the fit's margin, the safety fraction) in step time; auto: "
                                       "a workload of the fitted model's shape on a cluster of its hardware; "
                                       "none: do not plan."),
        safety_fraction: float = typer.Option(
            0.05, "--safety-fraction", min=0.0, max=0.49,
            help="The planner's memory_safety_fraction the reserve is priced with (its default)."),
        as_json: bool = typer.Option(False, "--json", help="Print the fit quality as JSON."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or table."),
    ) -> None:
        """Fit a cost-model file to profiles; refuse it when a term's held-out MAPE is too high.
        Prints the memory margin of a forced fit beside the planner's safety fraction (plans keep
        the larger free, never both) and what each costs in step time on a preset."""
        from costmodel.fit import FitConfig, FitRefusedError, fit_profiles
        from costmodel.profiling.format import read_profile
        from dcp_cli.fit_reserve import reserve_summary, reserve_table

        require_parent(out, option="--out")
        if time_statistic not in ("median", "min"):
            raise typer.BadParameter(f"time_statistic={time_statistic!r} is not median or min")
        try:
            config = FitConfig(holdout_fraction=holdout, max_mape=max_mape, force=force,
                               time_statistic=time_statistic,  # type: ignore[arg-type]
                               seed=seed, model_id=model_id or None,
                               comm_fallback_hardware=comm_from or None, hardware=hardware or None,
                               attention_half_tokens=None if attention_half_tokens < 0
                               else attention_half_tokens)
            with progress_bar("fitting", quiet=quiet) as update:
                parsed = []
                for i, path in enumerate(profiles):
                    update(i, len(profiles) + 1)
                    parsed.append(read_profile(path))
                update(len(profiles), len(profiles) + 1)
                result = fit_profiles(parsed, config)
        except FitRefusedError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(1) from None
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        result.file.save(out)
        reserve = reserve_summary(result.file, price_on=price_on, safety_fraction=safety_fraction)
        if as_json:
            typer.echo(json.dumps({n: t.model_dump() for n, t in result.file.fit_quality.items()}
                                  | {"memory_reserve": reserve}))
        elif not quiet:
            fit_table(result, Console())
            reserve_table(reserve, Console())
        typer.echo(f"wrote {out}")
