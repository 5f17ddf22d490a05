"""Suite-wide settings: how the suite splits over pytest-xdist workers (``make test`` runs ``-n 2``).

Each test module runs whole on one worker (its module-scoped servers, spawned worlds and Ray
clusters start once), and modules that share a session-scoped world or must not overlap form one
group that runs on one worker: the files that read the spawned worlds of ``tests/executor`` and
``tests/executor/integrations`` (spawned once per worker that needs them), and the two that start
local Ray clusters. Each worker uses one torch thread. Without xdist nothing here applies.

(xdist's own ``--dist loadgroup`` marks cannot do this under pytest 9, whose node ids xdist can no
longer suffix with the group, so the scheduler below maps modules to groups itself.)
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

if "PYTEST_XDIST_WORKER" in os.environ:
    # One torch/OpenMP thread per worker (and per process it starts): two workers share the two
    # cores, and two threads each would spin against each other.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

MODULE_GROUPS: dict[str, str] = {
    **{f"tests/executor/{name}.py": "world4_results"
       for name in ("test_joint_step", "test_grad_sync", "test_step_equivalence", "test_groups",
                    "test_naive_reference", "test_gqa_step")},
    **{f"tests/executor/integrations/{name}.py": "hf_world4"
       for name in ("test_hf_hunyuan", "test_hf_wan", "test_hf_diffusers", "test_hf_transformers",
                    "test_hf_chunked_loss")},
    "tests/api/test_ray_runner.py": "ray",
    "tests/api/test_ray_cli_interrupt.py": "ray",
}
"""Module path -> the group whose modules run on one worker, one after another."""


def module_scope(nodeid: str) -> str:
    """The scheduling unit of a test: its module's group, or the module itself."""
    module = nodeid.split("::", 1)[0]
    return MODULE_GROUPS.get(module, module)


def pytest_ignore_collect(collection_path: Path, config: Any) -> bool | None:
    """Under ``-m alone`` (``make test``'s second part), import only the test modules that name
    the mark: collecting the whole suite imports torch, transformers, diffusers, Ray and OR-Tools,
    ~20 s of a busy 2-core machine, to run a handful of tests. A module whose tests are ``alone``
    therefore names the mark itself (``pytest.mark.alone``), as every such module does."""
    if config.getoption("markexpr", "") != "alone" or collection_path.suffix != ".py" \
            or not collection_path.name.startswith("test_"):
        return None
    try:
        text = collection_path.read_text(encoding="utf-8")
    except OSError:
        return None
    return None if "mark.alone" in text else True


if importlib.util.find_spec("xdist") is not None:
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroupScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with :func:`module_scope` as the scope."""

        def _split_scope(self, nodeid: str) -> str:
            return module_scope(nodeid)

    def pytest_xdist_make_scheduler(config: Any, log: Any) -> ModuleGroupScheduling | None:
        """Module groups when the suite runs with ``--dist loadscope`` (``make test``)."""
        if config.getvalue("dist") != "loadscope":
            return None
        return ModuleGroupScheduling(config, log)
