"""Uploaded cost models in the plan store's SQLite file (table ``cost_models``).

Stored once per id, immutable: uploading the identical file again is a no-op, another file
under the same id is refused. Rows are parsed on the way out, so a row written by an older,
laxer version is reported (``InvalidStoredCostModelError``) rather than served. The embedded
defaults and the id rules of the service are in ``api.registry``; recalibrated revisions
(``id@N``) in ``api.revisions_store``.
"""

from __future__ import annotations

import logging
import time

from pydantic import ValidationError

from api.store import PlanStore
from api.store_schema import transaction
from costmodel.schema import CostModelFile

logger = logging.getLogger(__name__)


class CostModelConflictError(ValueError):
    """A different cost model with this id is already stored."""


class InvalidStoredCostModelError(ValueError):
    """A stored cost-model row no longer validates (written by an older, laxer version)."""


def _parse_cost_model(cost_model_id: str, body: str) -> CostModelFile:
    try:
        return CostModelFile.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise InvalidStoredCostModelError(
            f"stored cost model {cost_model_id!r} is invalid ({where}: {first.get('msg')}); "
            "DELETE /v1/cost-models/{id} and upload it again") from None


class CostModelStore:
    """The uploaded cost models of a plan store (thread-safe as the store is)."""

    def __init__(self, store: PlanStore) -> None:
        self.store = store

    def put(self, file: CostModelFile) -> bool:
        """Store an uploaded cost model; return False when the identical file is already there.

        Raises:
            CostModelConflictError: when another file with the same id is stored.
        """
        digest = file.digest()
        body = file.model_dump_json()
        with transaction(self.store._conn()) as conn:
            row = conn.execute("SELECT digest FROM cost_models WHERE id=?", (file.id,)).fetchone()
            if row is not None:
                if row["digest"] != digest:
                    raise CostModelConflictError(f"cost model {file.id!r} already exists with other "
                                                 "coefficients; upload it under a new id")
                return False
            conn.execute("INSERT INTO cost_models(id, provenance, digest, body, created_at) "
                         "VALUES (?, ?, ?, ?, ?)", (file.id, file.provenance, digest, body, time.time()))
        return True

    def get(self, cost_model_id: str) -> CostModelFile | None:
        """An uploaded cost model, or None.

        Raises:
            InvalidStoredCostModelError: when the stored row does not validate any more.
        """
        row = self.store._conn().execute("SELECT body FROM cost_models WHERE id=?", (cost_model_id,)).fetchone()
        return None if row is None else _parse_cost_model(cost_model_id, row["body"])

    def list_all(self) -> list[CostModelFile]:
        """Every uploaded cost model that validates, by id (a broken row is logged and skipped)."""
        files = []
        for row in self.store._conn().execute("SELECT id, body FROM cost_models ORDER BY id").fetchall():
            try:
                files.append(_parse_cost_model(row["id"], row["body"]))
            except InvalidStoredCostModelError as exc:
                logger.warning("skipping %s", exc)
        return files

    def delete(self, cost_model_id: str) -> bool:
        """Delete an uploaded cost model; False when there was none with this id."""
        with transaction(self.store._conn()) as conn:
            cur = conn.execute("DELETE FROM cost_models WHERE id=?", (cost_model_id,))
        return bool(cur.rowcount)
