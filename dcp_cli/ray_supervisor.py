"""``dcp epoch --ray-address``: a parent process that outlives the Ray driver.

Ray's core worker ends its process from C++ when the local raylet dies ("Exiting because the
Raylet IPC connection failed"): no Python handler, ``finally`` or ``atexit`` runs, so ``dcp
epoch`` exited 1 with no message and left its epoch ``running`` in the store (issue 24).
:func:`supervise` forks before Ray is reached: the child runs the command as before; the parent
waits, and when the child ends without passing its normal exit (where ``atexit`` runs), it marks
the epoch interrupted in the store (``queued`` with the cause: the next run resumes it from the
stored steps) and says how to resume.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
from pathlib import Path

import typer

_CLEAN_EXIT = b"x"


def interrupted_message(*, exit_code: int, steps_done: int | None, steps_total: int | None) -> str:
    """What the store's ``error`` and the user's message say about an interrupted driver."""
    progress = "" if steps_done is None else f" after {steps_done}/{steps_total} steps"
    return (f"interrupted: the Ray driver ended abruptly (exit code {exit_code}){progress}; its local "
            "Ray node (raylet) was probably lost. The stored steps are kept; run the same command again "
            "to resume (with --ray-address once the cluster is back, or without it to plan the rest "
            "on this machine)")


def supervise(*, out: Path, epoch_id: str) -> None:
    """Fork; return in the child (which goes on to run the epoch); in the parent, wait for the
    child and end the command with its exit code, recording an abrupt end first. Returns at once,
    unsupervised, where the standard streams are not real files (an in-process runner).

    Args:
        out: The command's store.
        epoch_id: The epoch the command plans.
    """
    try:
        sys.stdout.fileno()
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return  # run in-process (typer's CliRunner): forking would fork the caller; not supervised
    read_fd, write_fd = os.pipe()
    parent_pid = os.getpid()
    pid = os.fork()
    if pid == 0:  # the driver
        os.close(read_fd)
        _die_with(parent_pid)
        atexit.register(os.write, write_fd, _CLEAN_EXIT)
        return
    os.close(write_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the child too; it stops the job
    signal.signal(signal.SIGTERM, lambda signum, frame: os.kill(pid, signal.SIGTERM))
    _, status = os.waitpid(pid, 0)
    clean = os.read(read_fd, 1) == _CLEAN_EXIT
    os.close(read_fd)
    code = os.waitstatus_to_exitcode(status)
    if clean:
        raise typer.Exit(code)
    _record_interrupted(out, epoch_id, exit_code=code)
    raise typer.Exit(1)


def _die_with(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``), so a
    killed ``dcp epoch`` takes its driver along, as before it was split in two."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before the call took effect
        os._exit(1)


def _record_interrupted(out: Path, epoch_id: str, *, exit_code: int) -> None:
    from api.jobs import record_state
    from api.store import ACTIVE_STATES, PlanStore

    record = None
    if out.exists():
        with contextlib.suppress(Exception):
            store = PlanStore.open(out)
            try:
                record = store.get_epoch(epoch_id)
                # Active, or failed for a passing reason the driver recorded before it was ended.
                if record is not None and (record.state in ACTIVE_STATES
                                           or (record.state == "failed" and record.transient)):
                    message = interrupted_message(exit_code=exit_code, steps_done=record.steps_done,
                                                  steps_total=record.steps_total)
                    record_state(store, epoch_id, "queued", error=message, transient=True)
            finally:
                store.close()
    typer.echo("error: " + interrupted_message(
        exit_code=exit_code, steps_done=None if record is None else record.steps_done,
        steps_total=None if record is None else record.steps_total), err=True)
