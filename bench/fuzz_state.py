"""The state a fuzz run starts from, so that generated requests reach real resources.

``write_data_dir`` fills the served data directory with manifests (text, video, a small one, one
in a sub-folder, a malformed one, an empty one) so ``manifest_path`` requests can succeed;
``populate`` uploads cost models and plans small epochs through the API (one left done, one
cancelled) before schemathesis starts; ``schemathesis_config`` writes a ``schemathesis.toml``
whose dictionaries make generated path parameters and body fields name those resources part of
the time (the rest stays random, so unknown ids are still sent).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

logger = logging.getLogger("bench.fuzz_state")

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "examples" / "manifests"
DICTIONARY_PROBABILITY = 0.6
"""Share of generated values taken from a dictionary of real resources (the rest random)."""


@dataclass(frozen=True, kw_only=True)
class FuzzState:
    """What ``populate`` created."""

    manifest_paths: list[str]
    """Paths relative to the data directory (valid and invalid manifests)."""
    epoch_ids: list[str]
    """Epochs created before the run (done or cancelled)."""
    cost_model_ids: list[str]
    """Built-in and uploaded cost models."""
    num_steps: int
    """Steps of the largest pre-created epoch."""
    num_ranks: int
    """Ranks of the pre-created epochs' cluster."""
    setup_requests: int = 0
    """Requests ``populate`` sent (not counted in the run)."""
    notes: list[str] = field(default_factory=list)


def write_data_dir(data_dir: Path) -> list[str]:
    """Write the manifests a fuzzed ``manifest_path`` can name; their relative paths.

    Valid ones come first (text 2,048 samples, video 512, a 64-sample text one, the small one again
    in a sub-folder); then a malformed one and an empty one (each must give a 422, not a 500).
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    text = (MANIFESTS / "train.jsonl").read_text()
    (data_dir / "train.jsonl").write_text(text)
    (data_dir / "videos.jsonl").write_text((MANIFESTS / "videos.jsonl").read_text())
    small = "".join(line + "\n" for line in text.splitlines()[:64])
    (data_dir / "small.jsonl").write_text(small)
    (data_dir / "sub").mkdir(exist_ok=True)
    (data_dir / "sub" / "nested.jsonl").write_text(small)
    (data_dir / "bad.jsonl").write_text('{"id": "a", "tokens": 5}\n{"id": "a", "tokens": -1}\nnot json\n')
    (data_dir / "empty.jsonl").write_text("")
    return ["train.jsonl", "videos.jsonl", "small.jsonl", "sub/nested.jsonl", "bad.jsonl", "empty.jsonl"]


def _check(response: httpx.Response, *expected: int) -> httpx.Response:
    if response.status_code not in expected:
        raise RuntimeError(f"setup request {response.request.method} {response.request.url} gave "
                           f"{response.status_code}: {response.text[:500]}")
    return response


def _wait_epoch(client: httpx.Client, epoch_id: str, *, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    state = "queued"
    while time.monotonic() < deadline:
        state = _check(client.get(f"/v1/epochs/{epoch_id}"), 200).json()["state"]
        if state in ("done", "failed", "cancelled"):
            return state
        time.sleep(0.5)
    return state


def populate(url: str, *, token: str | None, manifest_paths: list[str], cluster: str = "h200x8",
             num_ranks: int = 8, timeout_s: float = 300.0) -> FuzzState:
    """Upload two cost models (one to be deleted by the fuzzer if it likes) and plan three epochs.

    Raises:
        RuntimeError: when a setup request is refused or an epoch does not finish in time.
    """
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    notes: list[str] = []
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        builtin = [m["id"] for m in _check(client.get("/v1/cost-models"), 200).json()]
        llama = next(i for i in builtin if "llama-7b" in i and "h200" in i)
        base = _check(client.get(f"/v1/cost-models/{llama}"), 200).json()
        uploaded = []
        for new_id in ("fuzz-fitted-a", "fuzz-fitted-b"):
            body = {**base, "id": new_id, "provenance": "fitted"}
            _check(client.post("/v1/cost-models", json=body), 200, 201)
            uploaded.append(new_id)
        epochs = {
            # small text epoch: 64 samples, 8 steps of 8
            "fz-text": {"manifest_path": "small.jsonl", "batch": {"samples_per_step": 8},
                        "cost_model_id": "fuzz-fitted-a"},
            # the video manifest under a video model preset, 4 steps of 128
            "fz-video": {"manifest_path": "videos.jsonl", "batch": {"samples_per_step": 128},
                         "model": "wan2.1-1.3b"},
            # inline manifest, by token budget
            "fz-inline": {"manifest_jsonl": "".join(json.dumps({"id": f"s{i}", "tokens": 500 + 97 * i}) + "\n"
                                                    for i in range(48)),
                          "batch": {"tokens_per_step": 8192}, "model": "llama-7b"},
        }
        for epoch_id, spec in epochs.items():
            _check(client.post("/v1/epochs", json={"epoch_id": epoch_id, "seed": 1, "cluster": cluster,
                                                   "options": {"time_limit_s": 0.2}, **spec}), 202)
        states = {epoch_id: _wait_epoch(client, epoch_id, timeout_s=timeout_s) for epoch_id in epochs}
        for epoch_id, state in states.items():
            if state != "done":
                raise RuntimeError(f"setup epoch {epoch_id} ended {state}")
        # one cancelled job: the whole train manifest, cancelled at once
        _check(client.post("/v1/epochs", json={"epoch_id": "fz-cancelled", "seed": 2, "cluster": cluster,
                                               "manifest_path": "train.jsonl", "model": "llama-7b",
                                               "batch": {"samples_per_step": 16}}), 202)
        cancel = client.post("/v1/epochs/fz-cancelled/cancel")
        notes.append(f"fz-cancelled: cancel answered {cancel.status_code}")
        final = _wait_epoch(client, "fz-cancelled", timeout_s=timeout_s)
        notes.append(f"fz-cancelled ended {final}")
        steps = [len(_check(client.get(f"/v1/epochs/{e}/steps"), 200).json()) for e in epochs]
        notes.append(f"steps per epoch: {dict(zip(epochs, steps, strict=False))}")
    logger.info("fuzz state: %s", "; ".join(notes))
    return FuzzState(manifest_paths=manifest_paths, epoch_ids=[*epochs, "fz-cancelled"],
                     cost_model_ids=[*uploaded, llama], num_steps=max(steps), num_ranks=num_ranks, notes=notes)


def _toml_list(values: list[str] | list[int]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def schemathesis_config(state: FuzzState, path: Path) -> Path:
    """Write a ``schemathesis.toml`` binding parameters to dictionaries of the created resources.

    Path parameters (``epoch_id``, ``cost_model_id``, ``step``, ``rank``, ``rev``) and body fields
    (``manifest_path``, ``cost_model_id``) take a dictionary value with probability
    ``DICTIONARY_PROBABILITY``; otherwise schemathesis generates them as usual.
    """
    bad_paths = ["../outside.jsonl", "/etc/passwd", "missing.jsonl", "sub", "sub/../small.jsonl",
                 "a" * 300 + ".jsonl", "%2e%2e/x"]
    dictionaries = {
        "epochs": [*state.epoch_ids, "no-such-epoch"],
        "cost_models": [*state.cost_model_ids, "no-such-model"],
        "manifests": state.manifest_paths + bad_paths,
        "steps": list(range(state.num_steps + 1)),
        "ranks": list(range(state.num_ranks + 1)),
        "revs": [0, 1, 2],
    }
    bindings = {"path.epoch_id": "epochs", "path.cost_model_id": "cost_models", "body.cost_model_id": "cost_models",
                "body.manifest_path": "manifests", "path.step": "steps", "path.rank": "ranks", "path.rev": "revs"}
    lines = ["[dictionaries]"]
    lines += [f"{name} = {{ values = {_toml_list(values)} }}" for name, values in dictionaries.items()]
    lines += ["", "[parameters]"]
    lines += [f'"{key}" = {{ dictionary = "{name}", probability = {DICTIONARY_PROBABILITY} }}'
              for key, name in bindings.items()]
    path.write_text("\n".join(lines) + "\n")
    return path
