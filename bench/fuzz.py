"""Fuzz the planner service with schemathesis against a live ``dcp serve`` on loopback.

Run::

    .venv/bin/python bench/fuzz.py                          # 2 x 15 min (open, then with a token)
    .venv/bin/python bench/fuzz.py --max-examples 10 --out /tmp/fuzz.json   # what the test suite runs

For each mode (``open``: no token configured; ``token``: ``DCP_AUTH_TOKEN`` set and every
request sending it) a fresh server is started on its own SQLite file and a populated data
directory (``bench/fuzz_state.py``: manifests, two uploaded cost models, three planned epochs
and a cancelled one). ``schemathesis run`` is pointed at its ``/openapi.json`` with a
``schemathesis.toml`` whose dictionaries make path parameters and body fields name those
resources part of the time, all phases (examples, coverage, fuzzing, stateful with the links
schemathesis infers from responses), and the checks ``not_a_server_error``,
``status_code_conformance``, ``content_type_conformance``, ``response_headers_conformance``,
``response_schema_conformance``, ``use_after_free`` and ``ensure_resource_availability``; in
token mode also ``ignored_auth`` (each operation is re-sent without and with a wrong token and
must be refused). Then a raw-socket phase (``bench/fuzz_raw.py``) sends slow, chunked, huge,
nested and truncated bodies. The server's own Prometheus counters give the requests it answered
by status code. A mode passes when schemathesis reports no failure, the raw phase none, the
server answered no 5xx and its log holds no traceback. Writes a JSON summary (``--out``) and
prints a table; the exit code is 1 when a mode fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from _service import free_port, wait_ready  # bench/ (the script's folder) is on sys.path
from fuzz_raw import run_raw_phase  # bench/ (the script's folder) is on sys.path
from fuzz_state import populate, schemathesis_config, write_data_dir  # bench/ is on sys.path
from prometheus_client.parser import text_string_to_metric_families
from provenance import default_out, provenance  # bench/ (the script's folder) is on sys.path

from dcp_cli.progress import progress_bar

logger = logging.getLogger("bench.fuzz")

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_headers_conformance,response_schema_conformance,use_after_free,"
          "ensure_resource_availability")
TOKEN_CHECKS = CHECKS + ",ignored_auth"
"""In open mode the schema still declares the bearer scheme (it is the service's rule whenever a
token is set), so ``ignored_auth`` would flag every 2xx: it runs in token mode only."""
TOKEN = "fuzz-token"
MAX_BODY_BYTES = 1_000_000
BODY_READ_TIMEOUT_S = 3.0


def _start_server(workdir: Path, *, token: str | None, workers: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "DCP_DB_PATH": str(workdir / "plans.sqlite"), "DCP_DATA_DIR": str(workdir / "data"),
           "DCP_NUM_WORKERS": str(workers), "DCP_MAX_BODY_BYTES": str(MAX_BODY_BYTES),
           "DCP_PLAN_TIME_LIMIT_S": "0.5", "DCP_BODY_READ_TIMEOUT_S": str(BODY_READ_TIMEOUT_S)}
    env.pop("DCP_AUTH_TOKEN", None)
    if token:
        env["DCP_AUTH_TOKEN"] = token
    log = (workdir / "server.log").open("ab")
    proc = subprocess.Popen([sys.executable, "-m", "dcp_cli.main", "serve", "--port", str(port),
                             "--log-level", "warning"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            cwd=workdir, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url, timeout_s=60.0, log=workdir / "server.log")
    return proc, url


def status_counts(metrics_text: str) -> dict[str, int]:
    """Requests the server answered, by status, from its ``/metrics`` text (every route template,
    ``{param}`` ones included)."""
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "dcp_http_request_duration_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_count"):
                status = sample.labels["status"]
                counts[status] = counts.get(status, 0) + int(sample.value)
    return dict(sorted(counts.items()))


def route_status_counts(metrics_text: str) -> dict[str, dict[str, int]]:
    """Requests the server answered by ``METHOD route`` and status, from its ``/metrics`` text."""
    counts: dict[str, dict[str, int]] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "dcp_http_request_duration_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_count") and sample.value:
                route = counts.setdefault(f"{sample.labels['method']} {sample.labels['route']}", {})
                route[sample.labels["status"]] = int(sample.value)
    return dict(sorted(counts.items()))


def _metrics_text(url: str, token: str | None) -> str:
    """The server's ``/metrics`` text (it needs the token when one is set)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    response.raise_for_status()
    return response.text


def _status_counts(url: str, token: str | None) -> dict[str, int]:
    return status_counts(_metrics_text(url, token))


def _parse_summary(text: str) -> dict[str, int]:
    """``N generated, N passed, M failed, K errored`` from schemathesis' summary."""
    found: dict[str, int] = {}
    block = text[text.rfind("Test cases:"):] if "Test cases:" in text else ""
    for number, word in re.findall(r"(\d+) (generated|passed|failed|errored|skipped)", block):
        found[word] = int(number)
    return found


def _failures_excerpt(text: str) -> str:
    """The FAILURES section of schemathesis' report, cut (empty when none)."""
    start = text.find("FAILURES")
    return text[start:start + 6000] if start >= 0 else ""


def run_mode(mode: str, *, max_time_s: int, workers: int, seed: int, threads: int,
             workdir: Path, raw_rounds: int, max_examples: int | None = None) -> dict[str, Any]:
    """Fuzz one fresh server; the summary of the run. ``max_examples``: a work budget (test cases
    per API operation and phase) instead of the time budget ``max_time_s``, so every operation is
    reached however slow the machine."""
    token = TOKEN if mode == "token" else None
    manifest_paths = write_data_dir(workdir / "data")
    proc, url = _start_server(workdir, token=token, workers=workers)
    try:
        state = populate(url, token=token, manifest_paths=manifest_paths)
        config = schemathesis_config(state, workdir / "schemathesis.toml")
        # The start-up polls of /readyz (503 until the pool is warm) and the set-up requests are
        # not part of the run.
        before = _status_counts(url, token)
        load_before = os.getloadavg()
        start = time.monotonic()
        cmd = [str(Path(sys.executable).with_name("schemathesis")), "--config-file", str(config), "run",
               f"{url}/openapi.json", *(["--max-time", str(max_time_s)] if max_examples is None
                                        else ["--max-examples", str(max_examples)]),
               "--checks", TOKEN_CHECKS if token else CHECKS,
               "--seed", str(seed), "-w", str(threads), "--no-color", "--request-timeout", "120",
               "--suppress-health-check", "all"]
        if token:
            cmd += ["-H", f"Authorization: Bearer {token}"]
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir,  # (a hang guard only)
                                timeout=max_time_s * 3 + 300 if max_examples is None else 3600)
        raw = run_raw_phase(url, token=token, max_body_bytes=MAX_BODY_BYTES, body_timeout_s=BODY_READ_TIMEOUT_S,
                            rounds=raw_rounds)
        elapsed_s = time.monotonic() - start
        after = _status_counts(url, token)
        after["200"] -= 1  # the /metrics read of `before`
        counts = {code: n - before.get(code, 0) for code, n in after.items() if n - before.get(code, 0)}
        # by route, set-up requests included (the run's share is `counts`)
        by_route = route_status_counts(_metrics_text(url, token))
        method_probes = {k: v for k, v in by_route.items() if set(v) == {"405"}}  # one per route and verb
        by_route = {k: v for k, v in by_route.items() if k not in method_probes}
        by_route["(routes answering only 405, summed)"] = {"405": sum(v["405"] for v in method_probes.values())}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    (workdir / "schemathesis.txt").write_text(result.stdout + result.stderr)
    server_log = (workdir / "server.log").read_text(errors="replace")
    summary = _parse_summary(result.stdout)
    num_5xx = sum(n for code, n in counts.items() if code.startswith("5"))
    tracebacks = server_log.count("Traceback")
    runtime = re.search(r"Runtime Error: (\d+)", result.stdout)
    return {
        "mode": mode, "max_time_s": None if max_examples is not None else max_time_s,
        "max_examples": max_examples, "elapsed_s": round(elapsed_s, 1), "seed": seed,
        "schemathesis_exit_code": result.returncode, "test_cases": summary,
        "checks": (TOKEN_CHECKS if token else CHECKS).split(","), "state": asdict(state),
        "raw_phase": raw, "requests_by_route_and_status": by_route,
        "routes_answered_2xx": sum(any(c.startswith("2") for c in v) for v in by_route.values()),
        "failures_excerpt": _failures_excerpt(result.stdout),
        "client_runtime_errors": int(runtime.group(1)) if runtime else 0,
        "requests_by_status": counts, "requests": sum(counts.values()), "server_5xx": num_5xx,
        "server_tracebacks": tracebacks, "load_avg_1m_before_after": [round(load_before[0], 2),
                                                                       round(os.getloadavg()[0], 2)],
        "cpu_count": os.cpu_count(), "workdir": str(workdir),
        # Client-side runtime errors (schemathesis itself) are reported, not counted against the server.
        "passed": num_5xx == 0 and tracebacks == 0 and summary.get("failed", 0) == 0
        and "Failures" not in result.stdout and raw["num_failures"] == 0,
    }


def main() -> int:
    """Run the modes, print a table, write the JSON summary."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-time-s", type=int, default=900, help="schemathesis time budget per mode")
    parser.add_argument("--max-examples", type=int, default=None,
                        help="test cases per API operation instead of the time budget (a work budget: the "
                             "same operations reached on a loaded machine)")
    parser.add_argument("--modes", default="open,token", help="comma-separated: open, token")
    parser.add_argument("--workers", type=int, default=1, help="solver processes of the server")
    parser.add_argument("--threads", type=int, default=1,
                        help="schemathesis concurrent workers (2 can hit a CPython 3.11 ast.parse race in "
                             "hypothesis, a client-side 'Runtime Error')")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--parallel", action="store_true",
                        help="fuzz the modes at the same time (each its own server and client)")
    parser.add_argument("--raw-rounds", type=int, default=3, help="times the raw-socket probe list is sent")
    parser.add_argument("--out", type=Path, default=default_out("fuzz"))
    parser.add_argument("--workdir", type=Path, default=None, help="where servers keep their files")
    parser.add_argument("--quiet", "-q", action="store_true", help="No progress bar or log lines: the table only.")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    base = args.workdir or Path(tempfile.mkdtemp(prefix="dcp-fuzz-"))
    runs = []
    modes = args.modes.split(",")
    load_start = os.getloadavg()
    def one(mode: str) -> dict[str, Any]:
        logger.info("fuzzing mode %s (%s) ...", mode, budget)
        return run_mode(mode, max_time_s=args.max_time_s, workers=args.workers, seed=args.seed,
                        threads=args.threads, workdir=base / mode, raw_rounds=args.raw_rounds,
                        max_examples=args.max_examples)

    budget = (f"{args.max_time_s} s each" if args.max_examples is None
              else f"{args.max_examples} cases per operation each")
    with progress_bar(f"fuzzing {len(modes)} mode(s), {budget}", quiet=args.quiet,
                      total=len(modes)) as update:
        if args.parallel:
            with ThreadPoolExecutor(max_workers=len(modes)) as pool:
                futures = [pool.submit(one, mode) for mode in modes]
                for done, future in enumerate(futures, start=1):
                    runs.append(future.result())
                    update(done, len(modes))
        else:
            for mode in modes:
                runs.append(one(mode))
                update(len(runs), len(modes))
    print(f"{'mode':<6} {'requests':>9} {'cases':>9} {'failed':>7} {'raw_f':>6} {'5xx':>7} {'tb':>6} {'time_s':>8}"
          "  status codes")
    for r in runs:
        print(f"{r['mode']:<6} {r['requests']:>9d} {r['test_cases'].get('generated', 0):>9d} "
              f"{r['test_cases'].get('failed', 0):>7d} {r['raw_phase']['num_failures']:>6d} "
              f"{r['server_5xx']:>7d} {r['server_tracebacks']:>6d} "
              f"{r['elapsed_s']:>8.0f}  {r['requests_by_status']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    load = {"parallel_modes": args.parallel, "host_load_avg_start": [round(x, 2) for x in load_start],
            "host_load_avg_end": [round(x, 2) for x in os.getloadavg()], "host_cpus": os.cpu_count()}
    totals = {"total_requests": sum(r["requests"] for r in runs), "total_5xx": sum(r["server_5xx"] for r in runs),
              "total_failed_checks": sum(r["test_cases"].get("failed", 0) + r["raw_phase"]["num_failures"]
                                         for r in runs),
              "all_passed": all(r["passed"] for r in runs)}
    args.out.write_text(json.dumps({**provenance(), **load, **totals, "runs": runs}, indent=2) + "\n")
    return 0 if all(r["passed"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
