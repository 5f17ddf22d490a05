"""The dashboard in a real headless browser (Debian's chromium), served by a real ``dcp serve`` on
loopback: the script runs and loads both pictures, every request it makes is answered 200 by the
service itself, and the screenshot shows the page's style and the charts' colours (not blank).

Skipped where /usr/bin/chromium is not installed (``apt-get install chromium``)."""

from __future__ import annotations

import io
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from .conftest import COST_MODEL, FAST, manifest_lines
from .test_server import _wait

CHROMIUM = Path("/usr/bin/chromium")

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (/usr/bin/chromium)")]

_COUNT = re.compile(r'^dcp_http_request_duration_seconds_count\{method="(\w+)",route="([^"]+)",'
                    r'status="(\d+)"\} ([0-9.e+]+)$')

# What the page must fetch from the service (route templates as /metrics names them).
ASSETS = ("/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css", "/v1/epochs",
          "/v1/epochs/{epoch_id}/figures", "/v1/epochs/{epoch_id}/report.svg",
          "/v1/epochs/{epoch_id}/steps/{step}/gantt.svg", "/v1/epochs/{epoch_id}/steps/{step}/memory.svg")


def _requests(server: Any) -> dict[tuple[str, str], float]:
    counts: dict[tuple[str, str], float] = {}
    for line in server.request("GET", "/metrics").text.splitlines():
        m = _COUNT.match(line)
        if m and m.group(1) == "GET":
            counts[(m.group(2), m.group(3))] = counts.get((m.group(2), m.group(3)), 0.0) + float(m.group(4))
    return counts


def _chromium(tmp_path: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / "chromium-profile"
    profile.mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(tmp_path)}
    return subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-extensions", "--hide-scrollbars", f"--user-data-dir={profile}",
                           "--virtual-time-budget=30000", "--window-size=1280,1600", *args, url],
                          capture_output=True, text=True, timeout=120, env=env)


def _near(image: Image.Image, rgb: tuple[int, int, int], tol: int = 12) -> int:
    """Pixels within ``tol`` of a colour in every channel."""
    total = 0
    for count, color in image.getcolors(maxcolors=1 << 22) or []:
        assert isinstance(color, tuple)
        if all(abs(int(a) - b) <= tol for a, b in zip(color, rgb, strict=True)):
            total += count
    return total


def test_dashboard_loads_every_asset_and_renders(server_factory: Any, tmp_path: Path) -> None:
    server = server_factory(token=None).start()
    body = {"epoch_id": "browser", "manifest_jsonl": manifest_lines(36), "batch": {"samples_per_step": 12},
            "seed": 0, "cluster": "h200x8", "cost_model_id": COST_MODEL, "options": FAST}
    assert server.request("POST", "/v1/epochs", json=body).status_code == 202
    assert _wait(server, "browser")["state"] == "done"
    before = _requests(server)

    dom = _chromium(tmp_path, f"{server.url}/dashboard", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-status="ready"' in dom.stdout, dom.stdout[:3000]
    assert 'data-images="3"' in dom.stdout  # the epoch chart, the step's Gantt and memory charts loaded
    assert 'data-epoch="browser"' in dom.stdout and dom.stdout.count("data-step=") == 3

    shot = tmp_path / "dashboard.png"
    run = _chromium(tmp_path, f"{server.url}/dashboard", f"--screenshot={shot}")
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    image = Image.open(io.BytesIO(shot.read_bytes())).convert("RGB")
    assert image.size == (1280, 1600)
    colors = image.getcolors(maxcolors=1 << 22) or []
    assert len(colors) > 200 and max(c for c, _ in colors) < 0.9 * image.width * image.height  # not blank
    assert _near(image, (0x24, 0x36, 0x4B)) > 1280 * 20  # the style sheet's header band
    assert _near(image, (0x4C, 0x78, 0xA8)) > 2000  # the charts' compute bars and gap bars

    after = _requests(server)
    new = {key: after[key] - before.get(key, 0.0) for key in after if after[key] > before.get(key, 0.0)}
    for route in ASSETS:
        assert new.get((route, "200"), 0) >= 2, (route, new)  # once per browser run
    assert all(status == "200" for (route, status) in new if route != "/metrics"), new


def test_dashboard_deep_link_and_job_actions(server_factory: Any, tmp_path: Path) -> None:
    server = server_factory(token=None).start()
    done = {"epoch_id": "small", "manifest_jsonl": manifest_lines(36), "batch": {"samples_per_step": 12},
            "seed": 0, "cluster": "h200x8", "cost_model_id": COST_MODEL, "options": FAST}
    assert server.request("POST", "/v1/epochs", json=done).status_code == 202
    assert _wait(server, "small")["state"] == "done"
    big = {**done, "epoch_id": "big", "manifest_jsonl": manifest_lines(600), "batch": {"samples_per_step": 4}}
    assert server.request("POST", "/v1/epochs", json=big).status_code == 202
    assert server.request("POST", "/v1/epochs/big/cancel").json()["state"] == "cancelled"
    # a job that fails as a user's would: its uploaded cost model replaced (same id) while it was
    # cancelled, then resumed
    file = server.request("GET", f"/v1/cost-models/{COST_MODEL}").json()
    file["id"] = "team-fit"
    assert server.request("POST", "/v1/cost-models", json=file).status_code == 201
    fails = {**big, "epoch_id": "fails", "cost_model_id": "team-fit"}
    assert server.request("POST", "/v1/epochs", json=fails).status_code == 202
    assert server.request("POST", "/v1/epochs/fails/cancel").json()["state"] == "cancelled"
    assert server.request("DELETE", "/v1/cost-models/team-fit").status_code == 204
    assert server.request("POST", "/v1/cost-models", json={**file, "notes": "refitted"}).status_code == 201
    assert server.request("POST", "/v1/epochs/fails/resume").status_code == 200
    assert _wait(server, "fails")["state"] == "failed"

    dom = _chromium(tmp_path, f"{server.url}/dashboard#epoch=small&step=2", "--dump-dom").stdout
    assert 'data-status="ready"' in dom, dom[:3000]
    assert re.search(r'<tr data-step="2" class="selected">', dom), dom[:3000]  # the linked step
    assert re.search(r'<tr data-epoch="small" data-state="done" class="selected">', dom)  # the linked epoch
    rows = {m.group(1): m.group(0) for m in re.finditer(r'<tr data-epoch="(\w+)".*?</tr>', dom, flags=re.S)}
    assert 'data-action="resume"' in rows["big"] and "<button" not in rows["small"]
    # the failed job's row, then its error under it
    failed = re.search(r'<tr data-epoch="fails" data-state="failed".*?</tr>\s*<tr[^>]*>(.*?)</tr>', dom, flags=re.S)
    assert failed and "team-fit" in failed.group(1), dom[:5000]
    assert "changed since the job was created" in failed.group(1), failed.group(1)
    assert "/v1/epochs/small/steps/2/trace.json" in dom  # the step's trace link
