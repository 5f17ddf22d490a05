"""The planner service never imports torch, nor ray unless DCP_RAY_ADDRESS is set (it runs without them)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)


def test_service_and_cli_do_not_import_torch(tmp_path: object) -> None:
    code = (
        "import sys\n"
        "import dcp_cli.main, api.app, api.jobs, api.fitting, costmodel.fit, planner.epoch, planner.planning\n"
        "from api.settings import Settings\n"
        f"api.app.create_app(Settings(db_path=r'{tmp_path}/p.sqlite')).openapi()\n"
        "bad = sorted(m for m in sys.modules if m in ('torch', 'ray') or m.startswith(('torch.', 'ray.')))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50,
                            check=False)
    assert result.returncode == 0, result.stderr
