"""Fault table of the planner service: what a user sees, how long recovery takes, nothing lost.

Run (as root: the full-disk case mounts a small tmpfs, the read-only case an ext4 loop image)::

    .venv/bin/python bench/faults.py            # about 3 minutes on 2 cores

Every case runs the same epoch job (``FAULT_STEPS`` steps of 12 samples on h200x8, quick planner
options) on a fresh ``dcp serve`` and injects one fault in the middle; the job's stored digests
are then compared with an uninterrupted reference run of the same inputs ("nothing lost":
every step present, every plan byte-identical). Cases: kill -9 of the server (restarted), kill
-9 of one solver worker, the store locked by another process for 4 s, the store's disk full
(tmpfs too small, then grown), the store's ext4 file system turned read-only by an error under
the running server (then checked, remounted and the service restarted), and a second server
started on the same store. Writes ``--out`` (default ``bench-out/faults.json``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _script import log_to_console, parser_with_out  # bench/ (the script's folder) is on sys.path
from _service import free_port as _free_port
from provenance import provenance

from dcp_cli.progress import progress_bar

logger = logging.getLogger("bench.faults")

ROOT = Path(__file__).resolve().parent.parent
COST_MODEL = "analytic-llama-7b-h200-sxm"
FAULT_STEPS = 80
SAMPLES_PER_STEP = 12
LENGTHS = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
LOCK_HOLDER = ("import sqlite3, sys, time\nc = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)\n"
               "c.execute('BEGIN EXCLUSIVE')\nprint('locked', flush=True)\ntime.sleep(float(sys.argv[2]))\n"
               "c.execute('COMMIT')\n")


def _manifest() -> str:
    return "".join(json.dumps({"id": f"s{i}", "tokens": LENGTHS[(i * 7 + 3) % len(LENGTHS)]}) + "\n"
                   for i in range(FAULT_STEPS * SAMPLES_PER_STEP))


def _body(epoch_id: str) -> dict[str, Any]:
    return {"epoch_id": epoch_id, "manifest_jsonl": _manifest(), "batch": {"samples_per_step": SAMPLES_PER_STEP},
            "seed": 11, "cluster": "h200x8", "cost_model_id": COST_MODEL,
            "options": {"time_limit_s": 5.0, "use_cpsat": False}}


class Server:
    """``dcp serve`` on a store folder."""

    def __init__(self, store_dir: Path, *, workers: int = 2, env: dict[str, str] | None = None) -> None:
        self.store_dir = store_dir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "DCP_DB_PATH": str(store_dir / "plans.sqlite"),
                    "DCP_DATA_DIR": str(store_dir), "DCP_NUM_WORKERS": str(workers),
                    "DCP_WRITE_BATCH_STEPS": "4", "DCP_JOB_MAX_BACKOFF_S": "2", **(env or {})}
        self.env.pop("DCP_AUTH_TOKEN", None)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        log = (self.store_dir.parent / f"server-{self.port}.log").open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "dcp_cli.main", "serve", "--port", str(self.port),
                                      "--log-level", "warning"], env=self.env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return self
            time.sleep(0.1)
        raise RuntimeError("server not ready")

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=30)

    def post(self, path: str, body: Any = None) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=60)

    def status(self, epoch_id: str) -> dict[str, Any]:
        return dict(self.get(f"/v1/epochs/{epoch_id}").json())

    def wait(self, epoch_id: str, *, until: int | None = None, timeout_s: float = 300) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                status = self.status(epoch_id)
                if until is not None and status["steps_done"] >= until:
                    return status
                if until is None and status["state"] == "done":
                    return status
            time.sleep(0.05)
        raise RuntimeError(f"{epoch_id} did not get there")

    def digests(self, epoch_id: str) -> list[str]:
        out: list[str] = []
        for start in range(0, FAULT_STEPS, 256):
            out += [r["digest"] for r in self.get(f"/v1/epochs/{epoch_id}/steps?start={start}&stop="
                                                  f"{min(start + 256, FAULT_STEPS)}").json()]
        return out

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)


def reference_digests(base: Path, *, epoch_id: str) -> list[str]:
    """The step digests of the fault epoch planned without faults, on a server of its own
    (store ``base / "ref"``)."""
    (base / "ref").mkdir()
    server = Server(base / "ref").start()
    server.post("/v1/epochs", _body(epoch_id))
    server.wait(epoch_id)
    digests = server.digests(epoch_id)
    server.stop()
    return digests


def _probe_write(server: Server) -> str:
    """What a user sees for a small write while the fault lasts."""
    body = dict(_body("probe-" + str(time.monotonic_ns())), manifest_jsonl='{"id": "p", "tokens": 512}\n')
    response = server.post("/v1/epochs", body)
    return f"{response.status_code} {str(response.json().get('detail', ''))[:90]}"


def _finish(server: Server, epoch_id: str, fault_end: float, reference: list[str], seen: set[str],
            user_sees: str) -> dict[str, Any]:
    while True:
        status = server.status(epoch_id)
        seen.add(status["state"])
        if status["state"] == "done":
            break
        time.sleep(0.05)
    recovery_s = time.monotonic() - fault_end
    digests = server.digests(epoch_id)
    return {"user_sees": user_sees, "states_seen": sorted(seen), "recovery_s": round(recovery_s, 2),
            "steps": len(digests), "identical_to_reference": digests == reference}


def case_kill_server(base: Path, reference: list[str]) -> dict[str, Any]:
    (base / "kill-server").mkdir()
    server = Server(base / "kill-server").start()
    server.post("/v1/epochs", _body("e"))
    server.wait("e", until=8)
    server.stop(signal.SIGKILL)
    fault_end = time.monotonic()
    restarted = Server(base / "kill-server").start()
    result = _finish(restarted, "e", fault_end, reference, set(), "connection refused until restart; "
                     "the job resumes at start-up")
    restarted.stop()
    return result


def case_kill_worker(base: Path, reference: list[str]) -> dict[str, Any]:
    (base / "kill-worker").mkdir()
    server = Server(base / "kill-worker").start()
    server.post("/v1/epochs", _body("e"))
    server.wait("e", until=8)
    assert server.proc is not None
    children = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout.split()
    workers = [int(p) for p in children
               if "resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
    os.kill(workers[0], signal.SIGKILL)
    fault_end = time.monotonic()
    result = _finish(server, "e", fault_end, reference, set(), "nothing (the job's steps in flight re-run)")
    server.stop()
    return result


def case_locked(base: Path, reference: list[str]) -> dict[str, Any]:
    (base / "locked").mkdir()
    server = Server(base / "locked", env={"DCP_STORE_BUSY_TIMEOUT_S": "0.5"}).start()
    server.post("/v1/epochs", _body("e"))
    server.wait("e", until=8)
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(base / "locked" / "plans.sqlite"), "4"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    seen = {server.status("e")["state"]}
    start = time.monotonic()
    healthz = []
    while time.monotonic() - start < 1.0:
        t = time.perf_counter()
        server.get("/healthz")
        healthz.append(time.perf_counter() - t)
    sees = _probe_write(server) + f"; /healthz max {max(healthz) * 1e3:.0f} ms"
    holder.wait()
    result = _finish(server, "e", time.monotonic(), reference, seen, sees)
    server.stop()
    return result


def _mount(path: Path, size_mb: int) -> None:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], check=True)


def _remount(path: Path, option: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{option}", str(path)], check=True)


def case_disk_full(base: Path, reference: list[str]) -> dict[str, Any]:
    path = base / "full"
    _mount(path, 1)
    server: Server | None = None
    try:
        server = Server(path).start()
        server.post("/v1/epochs", _body("e"))
        deadline = time.monotonic() + 120
        status = server.status("e")
        while time.monotonic() < deadline and not (status.get("error") or "").count("full"):
            time.sleep(0.1)
            status = server.status("e")
        sees = f"job {status['state']} at {status['steps_done']}/{status['steps_total']}: {status['error']}; " \
               f"write: {_probe_write(server)}"
        seen = {status["state"]}
        _remount(path, "size=64m")
        result = _finish(server, "e", time.monotonic(), reference, seen, sees)
        server.stop()
        return result
    finally:
        if server is not None:
            server.stop()
        subprocess.run(["umount", "-l", str(path)], check=False)


def _mount_ext4(image: Path, path: Path, size_mb: int) -> str:
    """A fresh ext4 file system on a loop device that turns read-only on its first error
    (``errors=remount-ro``); returns the loop device's name (``loop0``)."""
    subprocess.run(["truncate", "-s", f"{size_mb}M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    path.mkdir(exist_ok=True)
    subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(image), str(path)], check=True)
    source = subprocess.run(["findmnt", "-n", "-o", "SOURCE", str(path)], capture_output=True, text=True,
                            check=True).stdout.strip()
    return Path(source).name


def _umount(path: Path) -> None:
    for _ in range(50):
        if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
            return
        time.sleep(0.2)
    subprocess.run(["umount", "-l", str(path)], check=False)


def case_read_only(base: Path, reference: list[str]) -> dict[str, Any]:
    """The store's file system turns read-only under the running server, as ext4 does on an I/O
    error (``errors=remount-ro``; triggered through ext4's ``trigger_fs_error``). An operator
    then stops the service, checks and remounts the file system and starts the service again."""
    path, image = base / "ro", base / "ro.img"
    device = _mount_ext4(image, path, 64)
    server: Server | None = None
    try:
        server = Server(path).start()
        server.post("/v1/epochs", _body("e"))
        server.wait("e", until=8)
        Path(f"/sys/fs/ext4/{device}/trigger_fs_error").write_text("dcp-planner fault bench\n")
        time.sleep(3)
        read = server.get("/v1/epochs/e")
        body = read.json()
        seen: set[str] = set()
        if "state" in body:
            seen.add(body["state"])
            job = f"job {body['state']} at {body['steps_done']}/{body['steps_total']}: {body['error']}"
        else:  # SQLite in WAL mode cannot even read from a read-only file system
            job = f"reading the job: {read.status_code} {str(body.get('detail', ''))[:90]}"
        sees = f"{job}; write: {_probe_write(server)}; /healthz {server.get('/healthz').status_code}"
        server.stop()
        fault_end = time.monotonic()  # the operator's repair starts: stop, fsck, remount, start
        _umount(path)
        subprocess.run(["e2fsck", "-f", "-y", str(image)], capture_output=True, check=False)
        subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(image), str(path)], check=True)
        server = Server(path).start()
        result = _finish(server, "e", fault_end, reference, seen, sees + "; after fsck and restart the "
                         "job resumes at start-up")
        server.stop()
        return result
    finally:
        if server is not None:
            server.stop()
        _umount(path)


def case_two_servers(base: Path, reference: list[str]) -> dict[str, Any]:
    (base / "two").mkdir()
    server = Server(base / "two").start()
    server.post("/v1/epochs", _body("e"))
    second = subprocess.run([sys.executable, "-m", "dcp_cli.main", "serve", "--port", "0"],
                            env=server.env, capture_output=True, text=True, timeout=60)
    sees = f"second server exits {second.returncode}: {second.stderr.strip()[-160:]}"
    result = _finish(server, "e", time.monotonic(), reference, set(), sees)
    server.stop()
    return result


def main() -> int:
    """Run every case, print the table, write the JSON."""
    parser = parser_with_out(__doc__, "faults")
    parser.add_argument("--quiet", "-q", action="store_true", help="No progress bar or log lines: the table only.")
    args = parser.parse_args()
    log_to_console(quiet=args.quiet)
    base = Path(tempfile.mkdtemp(prefix="dcp-faults-"))
    reference = reference_digests(base, epoch_id="e")
    cases = {"kill -9 server": case_kill_server, "kill -9 solver worker": case_kill_worker,
             "store locked 4 s by another process": case_locked, "disk full (1 MB tmpfs, then 64 MB)": case_disk_full,
             "store's file system turns read-only (ext4 error), fsck + restart": case_read_only,
             "second server on the same store": case_two_servers}
    results: dict[str, Any] = {}
    with progress_bar(f"{len(cases)} fault cases", quiet=args.quiet, total=len(cases)) as update:
        for name, case in cases.items():
            logger.info("case: %s", name)
            try:
                results[name] = case(base, reference)
            except Exception as exc:  # a case that cannot run here (e.g. no mount) is reported, not hidden
                results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            logger.info("  %s", results[name])
            update(len(results), len(cases))
    print(f"{'case':<66} {'identical':>9} {'recovery_s':>10}  notes")
    for name, r in results.items():
        notes = str(r.get("error") or r.get("user_sees", ""))[:60]
        print(f"{name:<66} {r.get('identical_to_reference', '-')!s:>9} {r.get('recovery_s', '-')!s:>10}  {notes}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**provenance(), "steps": FAULT_STEPS, "reference_steps": len(reference),
                                    "cases": results}, indent=2) + "\n")
    return 0 if all(r.get("identical_to_reference") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
