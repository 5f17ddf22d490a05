"""Bodies schemathesis does not send: slow, chunked, huge, deeply nested, truncated (raw sockets).

Each probe writes its bytes to ``dcp serve`` over a plain TCP socket on loopback and reads the
status line of the answer. A probe fails when the server answers 5xx, when its status is not
one of the probe's expected codes, or when the connection closes without an answer where one
is due. ``run_raw_phase`` repeats the probe list ``rounds`` times and sums the outcomes.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlparse

logger = logging.getLogger("bench.fuzz_raw")

PLAN_BODY = {"samples": [{"id": "a", "tokens": 812}, {"id": "b", "tokens": 3000}], "cluster": "h200x8",
             "model": "llama-7b", "options": {"time_limit_s": 0.05}}


@dataclass(frozen=True, kw_only=True)
class Probe:
    """One raw exchange."""

    name: str
    head: bytes
    """Request line and headers (ending with the blank line)."""
    body_parts: tuple[bytes, ...] = ()
    """Written one after another, ``pause_s`` apart."""
    pause_s: float = 0.0
    expected: tuple[int, ...] = ()
    """Acceptable status codes; 0 stands for "the server closed the connection without an answer"."""


def _head(method: str, path: str, host: str, *, token: str | None, extra: str = "") -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\n"
            f"Connection: close\r\n{extra}\r\n").encode()


def _chunked(data: bytes, size: int) -> tuple[bytes, ...]:
    parts = [f"{len(data[i:i + size]):x}\r\n".encode() + data[i:i + size] + b"\r\n" for i in range(0, len(data), size)]
    return (*parts, b"0\r\n\r\n")


def probes(host: str, *, token: str | None, max_body_bytes: int, body_timeout_s: float) -> list[Probe]:
    """The probe list for a server with the given body limits."""
    plan = json.dumps(PLAN_BODY).encode()
    many = [{"id": f"s{i}", "tokens": 100} for i in range(200_000)]
    huge_samples = json.dumps({**PLAN_BODY, "samples": many}).encode()
    nested = b"[" * 100_000 + b"]" * 100_000
    ok_plan = (200,)
    rejected_write = (401,) if token else ()

    def head(method: str, path: str, extra: str = "", *, auth: bool = True) -> bytes:
        return _head(method, path, host, token=token if auth else None, extra=extra)

    out = [
        Probe(name="plan, whole body", head=head("POST", "/v1/plans", f"Content-Length: {len(plan)}\r\n"),
              body_parts=(plan,), expected=ok_plan),
        Probe(name="plan, chunked in 7-byte pieces", head=head("POST", "/v1/plans", "Transfer-Encoding: chunked\r\n"),
              body_parts=_chunked(plan, 7), expected=ok_plan),
        Probe(name="plan, slow chunks (0.05 s apart)",
              head=head("POST", "/v1/plans", "Transfer-Encoding: chunked\r\n"),
              body_parts=_chunked(plan, 64), pause_s=0.05, expected=ok_plan),
        Probe(name="plan, slow body under the read deadline",
              head=head("POST", "/v1/plans", f"Content-Length: {len(plan)}\r\n"),
              body_parts=(plan[:10], plan[10:]), pause_s=min(1.0, body_timeout_s / 4), expected=ok_plan),
        Probe(name="body stalls past the read deadline",
              head=head("POST", "/v1/plans", f"Content-Length: {len(plan)}\r\n"),
              body_parts=(plan[:10], b""), pause_s=body_timeout_s + 2.0, expected=(408, 0)),
        Probe(name="Content-Length past the limit, no body sent",
              head=head("POST", "/v1/plans", f"Content-Length: {200 * 1024 * 1024}\r\n"), expected=(413,)),
        Probe(name="huge body (200,000 samples), Content-Length",
              head=head("POST", "/v1/plans", f"Content-Length: {len(huge_samples)}\r\n"),
              body_parts=(huge_samples,), expected=(413, 0)),
        Probe(name="huge body, chunked (no Content-Length)",
              head=head("POST", "/v1/plans", "Transfer-Encoding: chunked\r\n"),
              body_parts=_chunked(huge_samples, 65536), expected=(413, 0)),
        Probe(name="nested arrays 100,000 deep",
              head=head("POST", "/v1/epochs", f"Content-Length: {len(nested)}\r\n"),
              body_parts=(nested,), expected=(400, 413, 422)),
        Probe(name="truncated JSON, Content-Length honest",
              head=head("POST", "/v1/epochs", f"Content-Length: {len(plan) // 2}\r\n"),
              body_parts=(plan[:len(plan) // 2],), expected=(400, 422)),
        Probe(name="malformed chunk size", head=head("POST", "/v1/plans", "Transfer-Encoding: chunked\r\n"),
              body_parts=(b"zz\r\nabc\r\n0\r\n\r\n",), expected=(400, 0)),
        Probe(name="body shorter than Content-Length, then close",
              head=head("POST", "/v1/plans", f"Content-Length: {len(plan) + 100}\r\n"),
              body_parts=(plan,), expected=(400, 408, 0)),
        Probe(name="invalid UTF-8 body", head=head("POST", "/v1/plans", "Content-Length: 7\r\n"),
              body_parts=(b'{"\xff":1}',), expected=(400, 422)),
        Probe(name="rank view, no token", head=head("GET", "/v1/epochs/fz-text/steps/0/ranks/0", auth=False),
              expected=(401,) if token else (200,)),
        Probe(name="rank view, wrong token",
              head=_head("GET", "/v1/epochs/fz-text/steps/0/ranks/0", host, token="wrong-token"),
              expected=(401,) if token else (200,)),
        Probe(name="write, no token", head=head("POST", "/v1/epochs/fz-text/cancel", "Content-Length: 0\r\n",
                                                 auth=False), expected=rejected_write or (200, 409)),
    ]
    if max_body_bytes < len(huge_samples):
        return out
    raise ValueError(f"max_body_bytes {max_body_bytes} admits the huge probe ({len(huge_samples)} bytes)")


def _status(data: bytes) -> int:
    if not data.startswith(b"HTTP/1."):
        return 0
    return int(data.split(b" ", 2)[1])


def send(probe: Probe, host: str, port: int, *, timeout_s: float) -> int:
    """The status the server answered ``probe`` with (0: closed without answering)."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        try:
            sock.sendall(probe.head)
            for i, part in enumerate(probe.body_parts):
                if i and probe.pause_s:
                    time.sleep(probe.pause_s)
                if part:
                    sock.sendall(part)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early (413) and closed: read what it said
        data = b""
        try:
            while b"\r\n" not in data:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return _status(data)


def run_raw_phase(url: str, *, token: str | None, max_body_bytes: int, body_timeout_s: float,
                  rounds: int) -> dict[str, object]:
    """Send every probe ``rounds`` times; counts by probe and the failures (unexpected statuses)."""
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    probe_list = probes(f"{host}:{port}", token=token, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    outcomes: dict[str, dict[str, int]] = {}
    failures: list[str] = []
    for _ in range(rounds):
        for probe in probe_list:
            status = send(probe, host, port, timeout_s=body_timeout_s + 60.0)
            by_status = outcomes.setdefault(probe.name, {})
            by_status[str(status)] = by_status.get(str(status), 0) + 1
            if status >= 500 or status not in probe.expected:
                failures.append(f"{probe.name}: {status} (expected {probe.expected})")
    logger.info("raw phase: %d probes x %d rounds, %d failures", len(probe_list), rounds, len(failures))
    return {"probes": len(probe_list), "rounds": rounds, "requests": len(probe_list) * rounds,
            "outcomes": outcomes, "failures": failures[:50], "num_failures": len(failures)}
