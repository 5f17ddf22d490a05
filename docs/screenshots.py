"""Regenerate the pictures under ``docs/images/``: the dashboard (a finished, a running, a
cancelled and a failed job) in headless Chromium, and a plan's memory chart and Gantt chart.

The failed job fails as a user's would: its cost model was replaced under the same id while the
job was cancelled, so resuming it fails with the reason (plans already stored were made under the
old model).

Starts a real ``dcp serve`` on a free loopback port in a temporary directory, posts the epochs
through the API, and takes the screenshots with Debian's ``/usr/bin/chromium``. Run from the
repository root::

    .venv/bin/python docs/screenshots.py
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

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dcp_cli.net import free_port  # noqa: E402

logger = logging.getLogger("screenshots")

OUT = ROOT / "docs" / "images"
CHROMIUM = Path("/usr/bin/chromium")
COST_MODEL = "analytic-llama-7b-h200-sxm"


def _manifest(num_samples: int) -> str:
    lengths = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
    return "".join(json.dumps({"id": f"s{i}", "tokens": lengths[(i * 7) % len(lengths)]}) + "\n"
                   for i in range(num_samples))


def _wait(client: httpx.Client, epoch_id: str, states: tuple[str, ...], *, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while client.get(f"/v1/epochs/{epoch_id}").json()["state"] not in states:
        if time.monotonic() > deadline:
            raise TimeoutError(f"epoch {epoch_id} not {states}")
        time.sleep(0.2)


def _shot(url: str, path: Path, *, tmp: Path, height: int = 1500) -> None:
    profile = tmp / "chromium-profile"
    profile.mkdir(exist_ok=True)
    subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                    "--disable-extensions", "--hide-scrollbars", "--disable-background-networking",
                    f"--user-data-dir={profile}", "--virtual-time-budget=20000", f"--window-size=1280,{height}",
                    f"--screenshot={path}", url], check=True, capture_output=True, timeout=120,
                   env={**os.environ, "HOME": str(tmp)})
    logger.info("wrote %s", path.relative_to(ROOT))


def _failed_job(client: httpx.Client, base: dict[str, object]) -> None:
    """A job that fails: cancelled, its uploaded cost model deleted and re-uploaded changed under
    the same id, then resumed (the job refuses plans under a different model than it started)."""
    file = client.get(f"/v1/cost-models/{COST_MODEL}").json()
    file["id"] = "team-fit"
    client.post("/v1/cost-models", json=file).raise_for_status()
    client.post("/v1/epochs", json={**base, "epoch_id": "failed-e3", "cost_model_id": "team-fit",
                                    "manifest_jsonl": _manifest(2048), "batch": {"samples_per_step": 128}}
                ).raise_for_status()
    client.post("/v1/epochs/failed-e3/cancel").raise_for_status()
    _wait(client, "failed-e3", ("cancelled",))
    client.delete("/v1/cost-models/team-fit").raise_for_status()
    file["notes"] = "refitted"
    client.post("/v1/cost-models", json=file).raise_for_status()
    client.post("/v1/epochs/failed-e3/resume").raise_for_status()
    _wait(client, "failed-e3", ("failed",))


def main() -> None:
    """Start a service, make the jobs, take the pictures."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not CHROMIUM.exists():
        raise SystemExit("needs Debian's chromium (apt-get install chromium)")
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("DCP_")}
        server = subprocess.Popen([str(Path(sys.executable).parent / "dcp"), "serve", "--port", str(port),
                                   "--db", str(tmp / "plans.sqlite"), "--workers", "1"], cwd=tmp, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            with httpx.Client(base_url=url, timeout=60) as client:
                deadline = time.monotonic() + 60
                while True:
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get("/readyz").status_code == 200:
                            break
                    if time.monotonic() > deadline:
                        raise TimeoutError("service not ready")
                    time.sleep(0.2)
                base = {"seed": 0, "cluster": "h200x64", "cost_model_id": COST_MODEL,
                        "options": {"time_limit_s": 0.5}}
                client.post("/v1/epochs", json={**base, "epoch_id": "done-e0", "manifest_jsonl": _manifest(512),
                                                "batch": {"samples_per_step": 128}}).raise_for_status()
                _wait(client, "done-e0", ("done",))
                client.post("/v1/epochs", json={**base, "epoch_id": "cancelled-e1", "manifest_jsonl": _manifest(2048),
                                                "batch": {"samples_per_step": 128}}).raise_for_status()
                client.post("/v1/epochs/cancelled-e1/cancel").raise_for_status()
                _failed_job(client, base)
                client.post("/v1/epochs", json={**base, "epoch_id": "running-e2", "manifest_jsonl": _manifest(20000),
                                                "batch": {"samples_per_step": 4}}).raise_for_status()
                _wait(client, "running-e2", ("running",))
                _shot(f"{url}/dashboard#epoch=done-e0&step=2", OUT / "dashboard.png", tmp=tmp)
                (OUT / "memory.svg").write_bytes(client.get("/v1/epochs/done-e0/steps/2/memory.svg").content)
                (OUT / "gantt.svg").write_bytes(client.get("/v1/epochs/done-e0/steps/2/gantt.svg").content)
                logger.info("wrote docs/images/memory.svg, docs/images/gantt.svg")
                client.post("/v1/epochs/running-e2/cancel")
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
