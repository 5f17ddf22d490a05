"""The Ray cluster watch: real TCP probes on loopback, a stepped clock."""

from __future__ import annotations

import socket

from api.ray_health import ClusterWatch


class Clock:
    """Monotonic seconds that move only when told."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_a_listening_port_is_never_lost_and_a_closed_one_after_three_due_probes() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    clock = Clock()
    watch = ClusterWatch(("127.0.0.1", port), every_s=1.0, lost_after=3, clock=clock)
    for _ in range(5):
        clock.now_s += 1.0
        assert watch.lost() is None
    server.close()
    clock.now_s += 0.5
    assert watch.lost() is None  # not due: no probe, no count
    verdicts = []
    for _ in range(3):
        clock.now_s += 1.0
        verdicts.append(watch.lost())
    assert verdicts[:2] == [None, None]
    assert verdicts[2] == f"127.0.0.1:{port} has not answered 3 probes 1 s apart"
    clock.now_s += 1.0
    assert watch.lost() is None  # the count restarted after the verdict


def test_one_answer_resets_the_count() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    server.close()
    clock = Clock()
    watch = ClusterWatch(("127.0.0.1", port), every_s=1.0, lost_after=2, clock=clock)
    clock.now_s += 1.0
    assert watch.lost() is None  # first failure
    server = socket.create_server(("127.0.0.1", port))
    clock.now_s += 1.0
    assert watch.lost() is None  # answered: back to zero
    server.close()
    clock.now_s += 1.0
    assert watch.lost() is None  # one failure again, not two
    clock.now_s += 1.0
    assert watch.lost() is not None


def test_nothing_watched_is_never_lost() -> None:
    clock = Clock()
    watch = ClusterWatch(None, every_s=1.0, lost_after=1, clock=clock)
    for _ in range(3):
        clock.now_s += 2.0
        assert watch.lost() is None
