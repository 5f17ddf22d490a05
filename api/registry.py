"""The cost-model registry: the embedded analytic defaults plus the models uploaded to the store."""

from __future__ import annotations

from api.cost_model_store import CostModelConflictError, CostModelStore
from api.store import ACTIVE_STATES, PlanStore
from costmodel.evaluate import CostModel
from costmodel.presets import builtin_cost_model_files, load_cluster
from costmodel.schema import CostModelFile
from costmodel.specs import ClusterSpec


class CostModelRegistry:
    """Resolves cost-model ids; the embedded files are always present and cannot be replaced."""

    def __init__(self, store: PlanStore) -> None:
        self.store = store
        self.uploaded = CostModelStore(store)
        self._builtin = {f.id: f for f in builtin_cost_model_files()}

    def is_builtin(self, cost_model_id: str) -> bool:
        """True for an embedded (shipped) cost model."""
        return cost_model_id in self._builtin

    def get(self, cost_model_id: str) -> CostModelFile:
        """The cost model with this id.

        Raises:
            KeyError: naming the unknown id.
        """
        if "@" in cost_model_id:  # id@rev: an immutable recalibrated revision (api.recalibration)
            return self._revision(cost_model_id)
        found = self._builtin.get(cost_model_id) or self.uploaded.get(cost_model_id)
        if found is None:
            raise KeyError(f"unknown cost model {cost_model_id!r}; GET /v1/cost-models lists them")
        return found

    def _revision(self, ref: str) -> CostModelFile:
        base, _, rev = ref.partition("@")
        row = None
        if rev.isdigit():
            row = self.store._conn().execute(
                "SELECT body FROM cost_model_revisions WHERE cost_model_id=? AND rev=?", (base, int(rev))).fetchone()
        if row is None:
            raise KeyError(f"unknown cost model revision {ref!r}; GET /v1/cost-models/{base}/revisions lists them")
        return CostModelFile.model_validate_json(row["body"])

    def list(self) -> list[tuple[CostModelFile, str]]:
        """Every cost model with where it came from (``builtin`` or ``uploaded``)."""
        items = [(f, "builtin") for f in self._builtin.values()]
        items += [(f, "uploaded") for f in self.uploaded.list_all()]
        return items

    def add(self, file: CostModelFile) -> bool:
        """Store an uploaded cost model; False when the identical file is already stored.

        Raises:
            CostModelConflictError: when the id belongs to an embedded or a different model, or
                names a revision (``id@N``).
        """
        if "@" in file.id:
            raise CostModelConflictError(f"cost model id {file.id!r}: ids ending in @N name recalibrated "
                                         "revisions (GET /v1/cost-models/{id}/revisions/{N}); upload "
                                         "under an id without '@'")
        if file.id in self._builtin:
            if self._builtin[file.id].digest() == file.digest():
                return False
            raise CostModelConflictError(f"cost model id {file.id!r} is an embedded default and "
                                         "cannot be replaced; upload under a new id")
        return self.uploaded.put(file)

    def add_derived(self, file: CostModelFile) -> CostModelFile:
        """Register the analytic cost model of a named model (a preset or a ``config.json``) so that
        jobs, resumes and reports find it by id; the file as registered.

        Its id is ``analytic-<model>-<hardware>``; when that id already names other coefficients
        (another model of the same name), it is stored as ``<id>-<first 8 hex of its digest>``
        (the same id for the same model every time).

        Raises:
            CostModelConflictError: when even that id is taken (not expected).
        """
        try:
            self.add(file)
            return file
        except CostModelConflictError:
            renamed = file.model_copy(update={"id": f"{file.id}-{file.digest()[:8]}"})
            self.add(renamed)
            return renamed

    def delete(self, cost_model_id: str) -> bool:
        """Delete an uploaded cost model; False when none has this id.

        Raises:
            CostModelConflictError: for an embedded default (it cannot be deleted).
            CostModelInUseError: when a queued or running epoch job uses it.
        """
        if cost_model_id in self._builtin:
            raise CostModelConflictError(f"cost model {cost_model_id!r} is an embedded default and "
                                         "cannot be deleted")
        users = [r.id for r in self.store.list_epochs()
                 if r.state in ACTIVE_STATES and r.spec.get("cost_model_id") == cost_model_id]
        if users:
            raise CostModelInUseError(f"cost model {cost_model_id!r} is used by active epoch job(s) "
                                      f"{users[:5]}; cancel them first")
        return self.uploaded.delete(cost_model_id)


class CostModelInUseError(ValueError):
    """A cost model that a queued or running epoch job still needs."""


def resolve_cluster(cluster: str | ClusterSpec) -> ClusterSpec:
    """A cluster preset name or a full spec.

    Raises:
        ValueError: for an unknown preset (naming the known ones).
    """
    return load_cluster(cluster) if isinstance(cluster, str) else cluster


def check_compatible(cost_model: CostModelFile, cluster: ClusterSpec) -> None:
    """Raise when the cost model cannot describe the cluster: another accelerator, or a state
    sharding the executor does not run (``costmodel.evaluate.CostModel`` makes both checks).

    Raises:
        ValueError: naming both and the way out.
    """
    CostModel(file=cost_model, cluster=cluster)
