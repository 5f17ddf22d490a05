"""A fetched step stays frozen across ``kill -9`` of the server: repeated fetch, kill, restart.

Run::

    .venv/bin/python bench/freeze_crash.py --rounds 20 --out bench/results/freeze_crash.json

A server plans ``bench/faults.py``'s epoch (80 steps). Then, ``--rounds`` times: a rank fetches
a step not fetched before (a random one above the last), the server gets SIGKILL the moment the
answer has arrived, and the store file is read with SQLite: the epoch's ``frozen_through`` must
be that step; the server is restarted and its ``/v1/epochs/{id}/recalibration`` must say the same.
Prints the count of rounds that held, writes the JSON.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import sqlite3
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _script import loadavg, log_to_console, parser_with_out  # bench/ (the script's folder) is on sys.path
from faults import FAULT_STEPS, Server, _body
from provenance import provenance

logger = logging.getLogger("bench.freeze_crash")


def stored_frozen_through(db: Path, epoch_id: str) -> int:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT frozen_through FROM epoch_recalibration WHERE epoch_id=?", (epoch_id,)).fetchone()
    finally:
        conn.close()
    return -1 if row is None else int(row[0])


def main() -> int:
    """Run the rounds, print the result, write the JSON."""
    parser = parser_with_out(__doc__, "freeze_crash")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seed", type=int, default=34)
    args = parser.parse_args()
    log_to_console()
    rng = random.Random(args.seed)
    load_before = loadavg()
    base = Path(tempfile.mkdtemp(prefix="dcp-freeze-"))
    (base / "s").mkdir()
    db = base / "s" / "plans.sqlite"
    server = Server(base / "s", workers=1).start()
    server.post("/v1/epochs", _body("e"))
    server.wait("e")
    rounds = []
    step = -1
    for number in range(args.rounds):
        step = rng.randint(step + 1, min(step + 4, FAULT_STEPS - 1))
        fetched = server.get(f"/v1/epochs/e/steps/{step}/ranks/0")
        server.stop(signal.SIGKILL)
        on_disk = stored_frozen_through(db, "e")
        server = Server(base / "s", workers=1).start()
        served = server.get("/v1/epochs/e/recalibration").json()["frozen_through"]
        held = fetched.status_code == 200 and on_disk == step and served == step
        rounds.append({"step": step, "fetch": fetched.status_code, "frozen_on_disk": on_disk,
                       "frozen_after_restart": served, "held": held})
        logger.info("round %d: step %d fetched (%d), killed; frozen_through %d on disk, %d after restart",
                    number + 1, step, fetched.status_code, on_disk, served)
    server.stop()
    held = sum(r["held"] for r in rounds)
    print(f"fetched step frozen after kill -9 + restart: {held} of {len(rounds)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**provenance(), "rounds": len(rounds), "held": held,
                                    "loadavg_before": load_before, "loadavg_after": loadavg(),
                                    "details": rounds}, indent=2) + "\n")
    return 0 if held == len(rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
