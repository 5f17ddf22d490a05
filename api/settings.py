"""Service settings: the only module that reads environment variables.

Every field can be set with an environment variable ``DCP_<FIELD>`` (e.g. ``DCP_DB_PATH``,
``DCP_AUTH_TOKEN``) or a ``.env`` file in the working directory; ``dcp serve`` options
override both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from api.auth import Tokens
from api.limits import body_bytes_in_flight_cap
from planner.limits import DEFAULT_MAX_SAMPLES_PER_BATCH, MAX_MANIFEST_SAMPLES, MAX_SAMPLES_PER_REQUEST


def _default_workers() -> int:
    return max(1, (os.cpu_count() or 1))


class Settings(BaseSettings):
    """Configuration of the planner service."""

    model_config = SettingsConfigDict(env_prefix="DCP_", env_file=".env", extra="ignore",
                                      frozen=True)

    host: str = Field(default="127.0.0.1", description="Interface to bind (loopback by default).")
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port (0 = any free port).")
    db_path: Path = Field(default=Path("plans.sqlite"),
                          description="SQLite file of the plan store (created when absent).")
    data_dir: Path = Field(default=Path("data"),
                           description="Server-side manifests must lie under this directory.")
    num_workers: int = Field(default_factory=_default_workers, ge=1,
                             description="Solver processes in the pool (epoch jobs use all of them).")
    worker_nice: int = Field(
        default=0, ge=0, le=19,
        description="Niceness added to every solver process (Unix). On a host shared with "
                    "training ranks (the service next to the job), 10 lets the ranks take the CPU "
                    "first: epoch precompute, recalibration and re-planning then run in their gaps "
                    "instead of stalling steps. 0 leaves them at the server's priority.")
    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0,
                                description="Largest accepted request body; larger gets 413.")
    max_samples_per_batch: int = Field(default=DEFAULT_MAX_SAMPLES_PER_BATCH, gt=0, le=MAX_SAMPLES_PER_REQUEST,
                                       description="Most samples in one synchronous plan request "
                                                   "(at most planner.limits.MAX_SAMPLES_PER_REQUEST).")
    max_manifest_samples: int = Field(default=MAX_MANIFEST_SAMPLES, gt=0,
                                      description="Most samples in one epoch manifest.")
    auth_token: str | None = Field(
        default=None,
        description="The write token. When set, every route but /healthz, /readyz and the "
                    "dashboard's static page needs 'Authorization: Bearer <token>' (this one, or "
                    "read_token for reads); /docs also takes it as a Basic password (api/auth.py).")
    read_token: str | None = Field(
        default=None,
        description="A read-only token (ranks, dashboards): GET and HEAD routes only. Needs auth_token.")
    cors_origins: list[str] = Field(default_factory=list,
                                    description="Origins allowed by CORS; empty = CORS off.")
    plan_time_limit_s: float = Field(
        default=2.0, gt=0,
        description="Default wall-clock safety cap of one plan (sync and epoch). The planner's "
                    "search budget is deterministic (PlannerConfig.cpsat_deterministic_time), so "
                    "a cap that is not hit keeps plans reproducible.")
    plan_layout: Literal["ulysses", "auto", "ring"] = Field(
        default="auto",
        description="Default attention layouts of a plan or epoch request that names none (options.layout, "
                    "planner/layouts.py): auto (Ulysses x ring per group, never predicted slower than "
                    "ulysses), ulysses or ring. An epoch "
                    "declares the layouts its plans use (EpochStatus.layouts) for the executors' groups.")
    write_batch_steps: int = Field(default=16, gt=0,
                                   description="Epoch steps written per store transaction (at most).")
    resume_jobs: bool = Field(default=True,
                              description="Restart queued/running epoch jobs (and jobs that failed "
                                          "for a transient reason) found at start-up.")
    max_bodies_per_client: int = Field(
        default=8, ge=1,
        description="Without auth_token: most requests with a body one client address has in the "
                    "service at once (429 with Retry-After, which the rank client retries; 8: a "
                    "node's ranks on one address); bounds the memory an anonymous client takes.")
    body_read_timeout_s: float = Field(default=30.0, gt=0,
                                       description="Longest time to receive a request body (408 after).")
    request_head_timeout_s: float = Field(
        default=5.0, gt=0,
        description="Longest time for a request head (request line and headers) to arrive, from the "
                    "connection's start or its previous response; the connection is closed after "
                    "(api/http_guard.py).")
    max_connections: int = Field(
        default=2048, ge=1,
        description="Open connections at most. At the cap a new connection closes the oldest one "
                    "that has sent no request yet, or is answered 503 with Retry-After "
                    "(api/http_guard.py).")
    max_connections_per_client: int = Field(
        default=1024, ge=1,
        description="Open connections of one client address at most, service-wide (token or not). "
                    "At the cap a new connection from it closes its oldest one that has sent no "
                    "request yet, or is answered 429 with Retry-After: idle connections from one "
                    "address cannot lock the ranks out.")
    max_body_bytes_in_flight: int | None = Field(
        default=None, gt=0,
        description="Request bodies the service receives and holds at once, all clients together "
                    "(token or not), each counted at 3x its size (what it takes while read, joined "
                    "and parsed; api/limits.py), from Content-Length up front or as a chunked body "
                    "arrives, until its request ends. Past it: 503 with Retry-After. Bounds the "
                    "memory that many large bodies from many addresses take. Unset: 128 MiB, or "
                    "3 x max_body_bytes when larger; at least 3 x max_body_bytes.")
    store_busy_timeout_s: float = Field(
        default=5.0, gt=0,
        description="Longest wait for a store locked by another process; then 503 (requests) "
                    "or a retry with backoff (epoch jobs). Never blocks the event loop.")
    plan_deadline_margin_s: float = Field(
        default=1.0, gt=0,
        description="A plan is stopped at its time_limit_s plus this margin (sync: 422 naming "
                    "time_limit_s; epoch step: the job fails naming the deadline).")
    job_max_transient_retries: int = Field(
        default=20, ge=0,
        description="Retries (exponential backoff) of an epoch job after transient failures "
                    "(killed worker, full disk, locked store) before it is left failed.")
    job_max_backoff_s: float = Field(default=60.0, gt=0,
                                     description="Longest wait between two retries of a job.")
    ray_address: str | None = Field(
        default=None,
        description="Plan epoch steps as Ray tasks on this cluster (auto, host:port, ray://host:port "
                    "or local; needs dcp-planner[ray]); unset = the solver process pool. Ray is "
                    "imported only when set. Sync plan requests always use the local pool.")
    ray_steps_per_task: int = Field(default=4, ge=1, description="Epoch steps planned by one Ray task.")
    store_lease: bool = Field(default=True,
                              description="Take the store's writer lease (<db>.lock): a second "
                                          "server on the same file refuses to start.")

    @field_validator("auth_token", "read_token")
    @classmethod
    def _non_empty_token(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            return None
        return value

    @model_validator(mode="after")
    def _body_caps_agree(self) -> Settings:
        body_bytes_in_flight_cap(max_body_bytes=self.max_body_bytes, configured=self.max_body_bytes_in_flight)
        return self

    @model_validator(mode="after")
    def _read_token_needs_a_write_token(self) -> Settings:
        if self.read_token is not None and self.auth_token is None:
            raise ValueError("read_token is set but auth_token is not: set DCP_AUTH_TOKEN (the write "
                             "token) too, or every write would be open")
        if self.read_token is not None and self.read_token == self.auth_token:
            raise ValueError("read_token equals auth_token: a read token must not be able to write")
        return self

    @property
    def tokens(self) -> Tokens:
        """The write and read tokens (``api.auth``)."""
        return Tokens(write=self.auth_token, read=self.read_token)
