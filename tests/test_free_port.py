"""The loopback port helper hands out ports the kernel never picks on its own."""

from __future__ import annotations

import socket

import pytest

from dcp_cli import net


def test_free_ports_lie_below_the_ephemeral_range_and_bind() -> None:
    """Ports drawn below the kernel's ephemeral range are bindable and never one the kernel
    itself assigns to a ``bind(0)`` or an outgoing connection (the source of the EADDRINUSE race
    with gloo's and torchrun's own listeners)."""
    low = net._ephemeral_low()
    if low - 1 <= net.LOWEST_PORT:
        pytest.skip(f"this host's ephemeral range starts at {low}: no room below it")
    ports = [net.free_port() for _ in range(20)]
    assert all(net.LOWEST_PORT <= port < low for port in ports), ports
    assert len(set(ports)) > 1, "the ports are drawn, not one fixed number"
    for port in ports[:3]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
            sock.listen()


def test_a_taken_port_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """With one port the only draw and that port held, the helper falls back to the kernel's pick
    rather than returning the held port."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(net.random.SystemRandom, "randint", lambda self, a, b: taken)
        assert net.free_port() != taken
