"""Ctrl-C, SIGTERM and SIGHUP during a run: the first one asks for an orderly stop, the ones after it change nothing.

Signals come in pairs: GNU `timeout`, `docker stop` and job schedulers signal the main process and then its
whole group, and a user presses Ctrl-C twice. So the handler never raises: an exception raised from a
handler lands wherever the main thread happens to be (inside a log call, inside the shutdown) and cuts that
short. It records the first signal only; `train` checks it between the stages of a build, the monitor
reads it on every pass, and each stops in order from where it stands:

    with stop_requests() as stop:    the handler installed: Ctrl-C, SIGTERM and SIGHUP are recorded in `stop`
        stop.check()                 raises Stopped once one came (before anything is written or started)
        stop.signum                  what the monitor reads (None: no stop asked for)

The run's children (actors, the evaluator, the fork server) ignore all three: the main process stops
them (`actor_pool.start_process`). This module creates no process, thread or lock.

The programs that start runs (the bench, scripts/results.py) take SIGTERM as Ctrl-C instead
(`sigterm_as_ctrl_c`): it stops what they started, each run then stopping in order.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

# SIGHUP too: the terminal a run was started from closed (an ssh connection that dropped, a closed window), which
# by default kills the whole process group at once and loses everything since the last periodic checkpoint.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_REASONS: dict[int, str] = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated", signal.SIGHUP: "hangup"}
_LOG_LINES: dict[int, str] = {signal.SIGINT: "Interrupted: stopping", signal.SIGTERM: "SIGTERM: stopping",
                              signal.SIGHUP: "SIGHUP (the terminal closed): stopping"}


class Stopped(Exception):
    """Raised by `train` after an orderly stop on Ctrl-C, SIGTERM or SIGHUP; `exit_code` is the shell convention."""

    def __init__(self, reason: str, signum: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.exit_code = 128 + signum


class StopRequests:
    """The first Ctrl-C, SIGTERM or SIGHUP that reached this process while `stop_requests` was active."""

    def __init__(self) -> None:
        self.signum: int | None = None  # written by the handler, in the main thread, once
        # When its handler ran (time.monotonic()): when it came, or where the main thread was inside a long call (a
        # checkpoint's write), when that returned
        self.at: float | None = None

    def record(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: remember the first signal; never raise, never log (the main thread may be
        inside a log call that holds the handler's lock)."""
        if self.signum is None:
            self.at = time.monotonic()
            self.signum = signum

    @property
    def reason(self) -> str | None:
        """Why the run stops, as meta.json records it: interrupted, terminated or hangup; None while none came."""
        return None if self.signum is None else _REASONS.get(self.signum, "terminated")

    @property
    def log_line(self) -> str:
        assert self.signum is not None, "a stop was asked for"
        return _LOG_LINES.get(self.signum, f"Signal {self.signum}: stopping")

    def check(self) -> None:
        """Raise Stopped if a stop was asked for."""
        if self.signum is not None:
            raise Stopped(self.reason or "terminated", self.signum)


def ignore_stop_signals() -> None:
    """Ignore Ctrl-C, SIGTERM and SIGHUP from now on: in a child of the run (the main process stops it), or in a
    process whose run has ended and that exits next (a late signal of its group must not turn an orderly
    exit into a kill)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent ends


def stop_with_launcher() -> None:
    """Under torchrun, have the kernel send this process SIGTERM once torchrun, its parent, has ended.

    torchrun starts each rank in a session of its own, so a kill -9 of torchrun (of its process group too) or the
    OOM killer's leaves the ranks training on without it until --total_steps, holding the run directory: the same
    command run again is refused meanwhile. With this they stop in order, with a final checkpoint, as after a
    SIGTERM to torchrun. A no-op outside torchrun (TORCHELASTIC_RUN_ID unset) and where prctl is missing. Call it
    first thing: a torchrun that ended before its first line read the parent goes unnoticed."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "LOCAL_RANK" not in os.environ:
        return
    launcher = os.getppid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return
    if prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0 and os.getppid() != launcher:
        os.kill(os.getpid(), signal.SIGTERM)  # it ended between the two lines above: no signal will come


_exit_after_runs = False  # set by `exit_after_runs`


def exit_after_runs() -> None:
    """For a program that exits when its run has ended (run.py): from now on, leaving `stop_requests` ignores
    Ctrl-C, SIGTERM and SIGHUP instead of putting back the handlers that were there. Put back, the default
    handler would let a late signal of the process group (`timeout`'s second, a third after a pause) kill the
    process between the run's orderly end and its exit, its exit code lost."""
    global _exit_after_runs
    _exit_after_runs = True


@contextlib.contextmanager
def stop_requests() -> Iterator[StopRequests]:
    """Record Ctrl-C, SIGTERM and SIGHUP inside, then put back the handlers that were there (ignore the three,
    in a program that exits next: `exit_after_runs`). Main thread only.

    Installed even where this process started with SIGINT ignored (a shell's background job), so that
    Ctrl-C stops a run in order however it was started. Not for a SIGHUP that this process started ignoring:
    that is `nohup` (or a process manager) asking for the run to outlive its terminal.
    """
    requests = StopRequests()
    signums = [s for s in STOP_SIGNALS if s != signal.SIGHUP or signal.getsignal(s) != signal.SIG_IGN]
    previous = {signum: signal.signal(signum, requests.record) for signum in signums}
    try:
        yield requests
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_IGN if _exit_after_runs else handler)


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, `docker stop`) to a program that starts runs (the bench, scripts/results.py),
    raised where Ctrl-C raises KeyboardInterrupt, so that the code that stops its runs and children on Ctrl-C
    stops them on SIGTERM too. Not for a run itself, whose handler never raises (above)."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """Raise Terminated on SIGTERM inside, then put back the handler that was there. Outside the main thread,
    where no handler can be installed, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
