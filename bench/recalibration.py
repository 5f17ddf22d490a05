"""Online recalibration on gloo CPU ranks: prediction error over steps before and after.

Starts a real ``dcp serve``, uploads a deliberately wrong cost model of the reference LLaMA-style
model on a CPU 'cluster' whose memory forces SP groups on long samples, precomputes an epoch and
turns recalibration on (every
``--every-steps`` measured steps, following revisions). ``--world`` gloo ranks train the model,
time their micro-batches and post them (``executor.measure``). After ``--steps-a`` steps the
ranks wait for the first revision (so the next steps are re-planned with it), then run
``--steps-b`` more. Prints the error per step and per revision and writes ``--out`` (default
``bench-out/recalibration.json``; with every measured micro-batch's terms, for analysis).

The wrong model (``--start``): ``analytic``, the analytic H200 model with compute x``--compute-factor``
(a model of other hardware altogether); or ``fitted``, a model fitted offline on this machine
(``dcp check-model``'s profiles of the same reference model: layers, collectives, the all-to-all
inside the layers; wall clock, as the ranks measure) with compute x``--compute-factor`` and the
all-to-all x``--alltoall-factor`` (a model profiled on another day or driver). With ``fitted``
every step after the first revision is followed by the same step planned by the offline-fitted
model itself (a second epoch, same manifest and seed, no recalibration), so that both run under
the same load, and the measured step times of the re-planned steps are compared with them.

Run::

    .venv/bin/python bench/recalibration.py --steps-a 6 --steps-b 18
    .venv/bin/python bench/recalibration.py --start fitted --compute-factor 0.5 --alltoall-factor 2 \
        --out bench/results/recalibration_fitted.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _service import free_port, start_service, stop_service
from provenance import default_out, provenance  # bench/ (the script's folder) is on sys.path

from costmodel.analytic import analytic_cost_model
from costmodel.evaluate import CostModel
from costmodel.fit import FitConfig, fit_profiles
from costmodel.presets import cpu_cluster, load_cluster
from costmodel.recalibrate import TermScales, scale_file
from costmodel.schema import CostModelFile
from costmodel.specs import ModelSpec, Sample
from executor.client import PlannerClient, RetryPolicy
from executor.data import SyntheticDataset
from executor.groups import GroupRegistry
from executor.measured_steps import MeasuredSteps
from executor.models import Llama1D, ModelConfig, init_weights
from executor.runtime import MicroBatchWork
from executor.step_gc import StepGC

ROOT = Path(__file__).resolve().parents[1]
EPOCH = "recalibration"
OFFLINE_EPOCH = "offline"
CONFIG = ModelConfig(num_layers=4, hidden=64, num_heads=4, ffn_hidden=128, vocab=256)
logger = logging.getLogger("bench.recalibration")


def setup(world: int, *, num_samples: int, tight_tokens: int, compute_factor: float
          ) -> tuple[dict[str, Any], list[Sample], dict[str, Any]]:
    """The cluster, the manifest and the wrong cost model (JSON-ready)."""
    spec = ModelSpec(name="ref-llama-bench", kind="1d", num_layers=CONFIG.num_layers, hidden=CONFIG.hidden,
                     num_heads=CONFIG.num_heads, ffn_hidden=CONFIG.ffn_hidden, vocab=CONFIG.vocab)
    cluster = load_cluster("h200x8").model_copy(update={"name": f"cpu{world}", "num_gpus": world,
                                                        "gpus_per_node": world})
    analytic = analytic_cost_model(spec, cluster.hardware)
    model = CostModel(file=analytic, cluster=cluster)
    need = model.fixed_bytes() + float(model.activation_bytes(tight_tokens, group_size=1))
    hardware = cluster.hardware.model_copy(update={"name": "h200-tight",
                                                   "hbm_bytes": need / cluster.memory_cap_fraction})
    cluster = cluster.model_copy(update={"hardware": hardware})
    wrong = scale_file(analytic.model_copy(update={"hardware": "h200-tight"}),
                       TermScales(compute=compute_factor), new_id="ref-llama-bench-wrong")
    samples = [Sample(id=f"b{i}", tokens=16 + (i * 977) % 600) for i in range(num_samples)]
    return cluster.model_dump(mode="json"), samples, wrong.model_dump(mode="json")


def fit_offline(world: int) -> CostModelFile:
    """The reference model fitted on this machine as ``dcp check-model`` fits it (wall clock)."""
    from dcp_cli.check_comm import profile_alltoall_in_layer, profile_comm
    from dcp_cli.check_config import CheckConfig
    from dcp_cli.check_profile import profile_reference

    config = CheckConfig(kind="1d", world_size=world, num_layers=CONFIG.num_layers, hidden=CONFIG.hidden,
                         num_heads=CONFIG.num_heads, ffn_hidden=CONFIG.ffn_hidden, vocab=CONFIG.vocab,
                         tokens_min=16, tokens_max=1024, clock="wall")
    logger.info("fitting the offline model: profiling the reference layers and the collectives")
    profiles = [profile_reference(config), profile_comm(world, clock="wall"), profile_alltoall_in_layer(config)]
    fit = fit_profiles(profiles, FitConfig(force=True, time_statistic="min", comm_fallback_hardware="h200-sxm"))
    return fit.file.model_copy(update={"id": "ref-llama-bench-offline"})


def setup_fitted(world: int, offline: CostModelFile, *, num_samples: int, tight_tokens: int,
                 compute_factor: float, alltoall_factor: float
                 ) -> tuple[dict[str, Any], list[Sample], dict[str, Any]]:
    """The CPU cluster, the manifest and the offline model made wrong (JSON-ready)."""
    probe = CostModel(file=offline, cluster=cpu_cluster(world))
    need = probe.fixed_bytes() + float(probe.activation_bytes(tight_tokens, group_size=1))
    cluster = cpu_cluster(world, memory_bytes=need / probe.cluster.memory_cap_fraction)
    wrong = scale_file(offline, TermScales(compute=compute_factor, alltoall=alltoall_factor),
                       new_id="ref-llama-bench-wrong")
    samples = [Sample(id=f"b{i}", tokens=16 + (i * 977) % 600) for i in range(num_samples)]
    return cluster.model_dump(mode="json"), samples, wrong.model_dump(mode="json")


def _rank(rank: int, world: int, port: int, url: str, samples_json: str, steps_a: int, steps_b: int,
          offline: bool, gc_every_steps: int, pin_ranks: bool) -> None:
    torch.set_num_threads(1)
    if pin_ranks:  # one core per rank: no migrations between the two timed processes
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    samples = [Sample.model_validate(s) for s in json.loads(samples_json)]
    dataset = SyntheticDataset(samples, kind="1d", vocab=CONFIG.vocab, seed=1)
    model = Llama1D(CONFIG)
    init_weights(model, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    client = PlannerClient(url, retry=RetryPolicy(deadline_s=120))
    step_gc = StepGC(every_steps=gc_every_steps) if gc_every_steps > 0 else None
    loop = MeasuredSteps(client, rank=rank,
                         registry=GroupRegistry(world_size=world, rank=rank, group_sizes=[1, 2, 4][:world]),
                         step_gc=step_gc)

    def loss(work: MicroBatchWork) -> torch.Tensor:
        logits = model(work.inputs, work.ctx, recompute_layers=work.recompute_layers)
        return work.loss(Llama1D.token_losses(logits, work.targets))

    def run(steps: range, epoch: str = EPOCH) -> None:
        loop.run(epoch, steps, model=model, optimizer=optimizer, load_sample=dataset.load, loss=loss)

    run(range(steps_a))
    dist.barrier()
    if rank == 0 and not client.wait_for_revision(EPOCH, timeout_s=120):
        logger.warning("no revision after 120 s: the next steps run with the plans they had")
    dist.barrier()
    if offline:  # each step, then the same step planned by the offline-fitted model (same load)
        for step in range(steps_a, steps_a + steps_b):
            run(range(step, step + 1))
            run(range(step, step + 1), OFFLINE_EPOCH)
    else:
        run(range(steps_a, steps_a + steps_b))
    if loop.num_dropped_steps:
        logger.warning("rank %d: %d steps' measurements dropped", rank, loop.num_dropped_steps)
    client.close()
    if step_gc is not None:
        step_gc.close()
    dist.destroy_process_group()


def _micro_batches(db: Path, cluster: dict[str, Any], wrong: dict[str, Any], epoch: str = EPOCH
                   ) -> list[dict[str, Any]]:
    """Every measured micro-batch with its plan's prediction and the wrong model's terms."""
    from api.measurements_store import MeasurementStore
    from api.recalibration import observations
    from api.revisions_store import RevisionStore
    from api.store import PlanStore
    from costmodel.evaluate import nodes_spanned
    from costmodel.recalibrate import TermSplitter
    from costmodel.schema import CostModelFile
    from costmodel.specs import ClusterSpec
    from planner.plan import Plan

    store = PlanStore.open(db)
    groups = MeasurementStore(store).groups(epoch)
    plans = {}
    for g in groups:
        row = store.get_plan(epoch, g.step)
        if row is not None:
            plans[g.step] = Plan.model_validate_json(row[1])
    revs = RevisionStore(store).step_revisions(epoch)
    spec = ClusterSpec.model_validate(cluster)
    split = TermSplitter(CostModel(file=CostModelFile.model_validate(wrong), cluster=spec))
    records = observations(groups, plans)
    for r in records:
        r["rev"] = revs.get(r["step"], 0)
        r["terms_s"] = split([Sample.model_validate(s) for s in r["samples"]], group_size=r["group_size"],
                             recompute_layers=r["policies"],
                             num_nodes=nodes_spanned(first_rank=r["first_rank"], group_size=r["group_size"],
                                                     gpus_per_node=spec.gpus_per_node)).tolist()
        r["tokens"] = sum(s["tokens"] for s in r["samples"])
    store.close()
    return records


def step_times_s(records: list[dict[str, Any]]) -> dict[int, float]:
    """Measured time of each step: its slowest group (micro-batch times summed per group)."""
    per_group: dict[tuple[int, int], float] = {}
    for r in records:
        key = (r["step"], r["first_rank"])
        per_group[key] = per_group.get(key, 0.0) + r["measured_s"]
    steps: dict[int, float] = {}
    for (step, _), t in per_group.items():
        steps[step] = max(steps.get(step, 0.0), t)
    return steps


def group_errors(records: list[dict[str, Any]], *, from_step: int = 0) -> dict[str, float | int | None]:
    """Prediction error of whole groups (a group's micro-batches summed per step) and of micro-batches,
    over the steps from ``from_step``."""
    sel = [r for r in records if r["step"] >= from_step]
    groups: dict[tuple[int, int], list[float]] = {}
    for r in sel:
        acc = groups.setdefault((r["step"], r["first_rank"]), [0.0, 0.0])
        acc[0] += r["predicted_s"]
        acc[1] += r["measured_s"]
    if not sel:
        return {"groups": 0, "micro_batches": 0, "group_mape": None, "group_median_ape": None,
                "micro_batch_mape": None}
    group_ape = [abs(p / m - 1) for p, m in groups.values()]
    return {"groups": len(groups), "micro_batches": len(sel),
            "group_mape": sum(group_ape) / len(group_ape),
            # the typical group: a stalled step (a rank descheduled, the reporter's post holding the
            # GIL) moves the mean by tens of percent and the median not at all
            "group_median_ape": float(statistics.median(group_ape)),
            "micro_batch_mape": sum(abs(r["predicted_s"] / r["measured_s"] - 1) for r in sel) / len(sel)}


def _pct(value: float | int | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _create_epoch(url: str, epoch: str, samples: list[Sample], samples_per_step: int, cluster: dict[str, Any],
                  cost_model_id: str) -> None:
    httpx.post(f"{url}/v1/epochs", timeout=60, json={
        "epoch_id": epoch, "manifest_jsonl": "\n".join(json.dumps(s.model_dump(exclude_none=True))
                                                       for s in samples),
        "batch": {"samples_per_step": samples_per_step}, "seed": 0, "cluster": cluster,
        "cost_model_id": cost_model_id, "options": {"time_limit_s": 5.0, "use_cpsat": False}},
    ).raise_for_status()
    while httpx.get(f"{url}/v1/epochs/{epoch}", timeout=10).json()["state"] != "done":
        time.sleep(0.2)


def main() -> None:
    """Run the benchmark, print the tables and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, choices=(2, 4))
    parser.add_argument("--steps-a", type=int, default=6, help="Steps before the first revision.")
    parser.add_argument("--steps-b", type=int, default=18, help="Steps after it.")
    parser.add_argument("--samples-per-step", type=int, default=8)
    parser.add_argument("--every-steps", type=int, default=4, help="Recalibrate every N measured steps.")
    parser.add_argument("--start", choices=("analytic", "fitted"), default="analytic",
                        help="Base of the wrong model: the analytic H200 model, or one fitted here offline.")
    parser.add_argument("--compute-factor", type=float, default=0.5, help="Error put into the model.")
    parser.add_argument("--alltoall-factor", type=float, default=1.0,
                        help="Error put into the all-to-all (--start fitted only).")
    parser.add_argument("--tight-tokens", type=int, default=300, help="Tokens that fill one rank.")
    parser.add_argument("--service-nice", type=int, default=0,
                        help="DCP_WORKER_NICE of the service: its solver pool (recalibration, re-planning) "
                             "shares this machine's cores with the ranks (0: same priority).")
    parser.add_argument("--service-idle", action="store_true",
                        help="Run the service under SCHED_IDLE: it gets a core only when no rank wants "
                             "it, as on a host of its own (this machine has no core to spare).")
    parser.add_argument("--gc-every-steps", type=int, default=1,
                        help="Ranks collect Python's garbage every N steps at the step boundary "
                             "(executor.step_gc; 0: Python's automatic collector, whose pauses land in "
                             "measured micro-batches).")
    parser.add_argument("--pin-ranks", action="store_true",
                        help="Pin rank r to core r (mod the cores); the service stays unpinned.")
    parser.add_argument("--out", type=Path, default=default_out("recalibration"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    num_steps = args.steps_a + args.steps_b
    load_before = os.getloadavg()
    start = time.perf_counter()
    offline: CostModelFile | None = None
    if args.start == "fitted":
        offline = fit_offline(args.world)
        cluster, samples, wrong = setup_fitted(args.world, offline, num_samples=num_steps * args.samples_per_step,
                                               tight_tokens=args.tight_tokens, compute_factor=args.compute_factor,
                                               alltoall_factor=args.alltoall_factor)
    else:
        if args.alltoall_factor != 1.0:
            parser.error("--alltoall-factor needs --start fitted")
        cluster, samples, wrong = setup(args.world, num_samples=num_steps * args.samples_per_step,
                                        tight_tokens=args.tight_tokens, compute_factor=args.compute_factor)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        proc, url = start_service(tmp, log=tmp / "serve.log", env={"DCP_WORKER_NICE": str(args.service_nice)},
                                  sched_idle=args.service_idle)
        try:
            httpx.post(f"{url}/v1/cost-models", json=wrong, timeout=30).raise_for_status()
            _create_epoch(url, EPOCH, samples, args.samples_per_step, cluster, wrong["id"])
            if offline is not None:
                httpx.post(f"{url}/v1/cost-models", json=offline.model_dump(mode="json"),
                           timeout=30).raise_for_status()
                _create_epoch(url, OFFLINE_EPOCH, samples, args.samples_per_step, cluster, offline.id)
            httpx.post(f"{url}/v1/epochs/{EPOCH}/recalibration", timeout=30,
                       json={"follow": True, "every_steps": args.every_steps}).raise_for_status()
            mp.spawn(_rank, nprocs=args.world, join=True,
                     args=(args.world, free_port(), url, json.dumps([s.model_dump(exclude_none=True)
                                                                      for s in samples]),
                           args.steps_a, args.steps_b, offline is not None, args.gc_every_steps,
                           args.pin_ranks))
            time.sleep(1.0)
            while httpx.get(f"{url}/v1/epochs/{EPOCH}/recalibration", timeout=10).json()["busy"]:
                time.sleep(0.2)
            report = httpx.get(f"{url}/v1/epochs/{EPOCH}/recalibration", timeout=30).json()
        finally:
            stop_service(proc)
        records = _micro_batches(tmp / "plans.sqlite", cluster, wrong)
        offline_records = ([] if offline is None else
                           _micro_batches(tmp / "plans.sqlite", cluster, wrong, OFFLINE_EPOCH))
    elapsed_s = time.perf_counter() - start
    print(f"recalibration, {args.world} gloo ranks, {num_steps} steps of {args.samples_per_step} samples, "
          f"{args.start} model, compute x{args.compute_factor}, all-to-all x{args.alltoall_factor}, "
          f"recalibrate every {args.every_steps} measured steps, solver pool at nice {args.service_nice}"
          f"{', service under SCHED_IDLE' if args.service_idle else ''}, ranks collect garbage "
          f"{f'every {args.gc_every_steps} steps' if args.gc_every_steps else 'automatically'}"
          f"{', ranks pinned to cores' if args.pin_ranks else ''}; "
          f"load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'step':>5}{'rev':>5}{'micro-batches':>15}{'MAPE':>9}{'pred/meas':>11}")
    for e in report["steps"]:
        print(f"{e['step']:>5}{e['rev']:>5}{e['num_micro_batches']:>15}{e['mape']:>9.1%}{e['mean_ratio']:>11.3f}")
    print(f"{'revision':<34}{'steps':>6}{'MAPE':>9}")
    for e in report["by_revision"]:
        ref = wrong["id"] if e["rev"] == 0 else f"{wrong['id']}@{e['rev']}"
        print(f"{ref:<34}{e['num_steps']:>6}{e['mape']:>9.1%}")
    print(f"{'revision':<28}{'compute':>9}{'attn':>9}{'a2a':>9}{'ovh':>9}{'held-out before':>17}{'after':>8}")
    for r in report["revisions"]:
        fit, sc = r["fit"], r["scales"]
        before, after = fit["heldout_mape_before"], fit["heldout_mape_after"]
        print(f"{r['ref']:<28}{sc['compute']:>9.3g}{sc['attention']:>9.3g}{sc['alltoall']:>9.3g}"
              f"{sc['overhead']:>9.3g}{'-' if before is None else f'{before:.1%}':>17}"
              f"{'-' if after is None else f'{after:.1%}':>8}")
    by_rev = {rev: group_errors([r for r in records if r["rev"] == rev])
              for rev in sorted({r["rev"] for r in records})}
    late = group_errors(records, from_step=20)
    print(f"{'plans of revision':<20}{'groups':>8}{'group MAPE':>12}{'median':>8}{'micro-batch MAPE':>18}")
    for rev, e in by_rev.items():
        print(f"{rev:<20}{e['groups']:>8}{_pct(e['group_mape']):>12}{_pct(e['group_median_ape']):>8}"
              f"{_pct(e['micro_batch_mape']):>18}")
    print(f"{'steps >= 20':<20}{late['groups']:>8}{_pct(late['group_mape']):>12}{_pct(late['group_median_ape']):>8}"
          f"{_pct(late['micro_batch_mape']):>18}")
    comparison = None
    if offline is not None:
        replanned, offline_steps = step_times_s(records), step_times_s(offline_records)
        first_rev = args.steps_a  # steps from here were planned by a revision (or frozen before it)
        common = sorted(s for s in replanned if s >= first_rev and s in offline_steps
                        and any(r["step"] == s and r["rev"] > 0 for r in records))
        ratio = sum(replanned[s] for s in common) / sum(offline_steps[s] for s in common) if common else None
        by_rev_err: dict[int, list[float]] = {}
        for r in records:
            by_rev_err.setdefault(r["rev"], []).append(abs(r["predicted_s"] / r["measured_s"] - 1))
        offline_err = [abs(r["predicted_s"] / r["measured_s"] - 1) for r in offline_records]
        offline_groups = group_errors(offline_records)
        print(f"{'offline model':<20}{offline_groups['groups']:>8}{_pct(offline_groups['group_mape']):>12}"
              f"{_pct(offline_groups['group_median_ape']):>8}{_pct(offline_groups['micro_batch_mape']):>18}")
        replanned_s, offline_s = [replanned[s] for s in common], [offline_steps[s] for s in common]
        comparison = {"steps": common, "replanned_step_s": replanned_s,
                      "offline_step_s": offline_s, "replanned_over_offline": ratio,
                      "offline_micro_batch_mape": sum(offline_err) / len(offline_err) if offline_err else None,
                      "offline_errors": offline_groups,
                      "offline_errors_from_step_20": group_errors(offline_records, from_step=20),
                      "micro_batch_mape_by_revision": {str(k): sum(v) / len(v) for k, v in sorted(by_rev_err.items())}}
        print(f"re-planned steps {common[0] if common else '-'}..{common[-1] if common else '-'}: measured "
              f"{sum(replanned_s):.3f} s, the offline model's plans of the same steps "
              f"{sum(offline_s):.3f} s (ratio {ratio if ratio is None else f'{ratio:.3f}'}); "
              f"the offline model's own micro-batch MAPE {sum(offline_err) / max(1, len(offline_err)):.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        **provenance(), "benchmark": "recalibration", "world_size": args.world, "steps_a": args.steps_a,
        "steps_b": args.steps_b, "samples_per_step": args.samples_per_step, "every_steps": args.every_steps,
        "start": args.start, "compute_factor": args.compute_factor, "alltoall_factor": args.alltoall_factor,
        "tight_tokens": args.tight_tokens, "service_nice": args.service_nice,
        "service_idle": args.service_idle, "gc_every_steps": args.gc_every_steps, "pin_ranks": args.pin_ranks,
        "elapsed_s": elapsed_s,
        "comparison": comparison,
        "errors_by_revision": {str(k): v for k, v in by_rev.items()}, "errors_from_step_20": late,
        "offline_micro_batches": offline_records,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "report": report, "micro_batches": records}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
