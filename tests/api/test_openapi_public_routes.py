"""The OpenAPI document says which routes need the token, as the service enforces it (found by
bench/fuzz.py's ``ignored_auth`` check: health, readiness, metrics and the dashboard's static
page were documented with the bearer scheme yet answer without a token, by design)."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from api.auth import PUBLIC_PATHS
from api.settings import Settings


def _operations(schema: dict[str, Any]) -> list[tuple[str, str, Any]]:
    return [(path, method, op.get("security")) for path, ops in schema["paths"].items()
            for method, op in ops.items()]


def test_public_routes_declare_no_security_and_answer_without_token(settings: Settings) -> None:
    from api.app import create_app

    with TestClient(create_app(settings)) as client:
        auth = {"Authorization": f"Bearer {settings.auth_token}"}
        schema = client.get("/openapi.json", headers=auth).json()
        operations = _operations(schema)
        public = [(path, method, security) for path, method, security in operations if path in PUBLIC_PATHS]
        assert {path for path, _, _ in public} == set(PUBLIC_PATHS)
        assert all(security == [] for _, _, security in public), public
        for path, method, security in operations:
            if path not in PUBLIC_PATHS:
                assert security == [{"HTTPBearer": []}], (method, path, security)
        for path in PUBLIC_PATHS:  # what the document says holds: no token, no 401
            assert client.get(path).status_code in (200, 503), path
        assert client.get("/v1/epochs").status_code == 401  # and a documented one does need it
