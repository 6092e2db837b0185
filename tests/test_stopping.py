"""Ctrl-C and SIGTERM (`impala/stopping.py`): the first one is recorded and the ones after it change nothing;
one that comes while a run is being built stops it before anything starts, leaving its directory as it was.
(Signals to a running trainer and its process group: test_shutdown.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import pytest
from process_helpers import REPO_ROOT, checkpoint_step

from impala import actor_pool, stopping, training
from impala.config import Config
from impala.stopping import Stopped, stop_requests


def test_the_first_signal_is_recorded_and_the_ones_after_it_change_nothing() -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with stop_requests() as stop:
        assert stop.reason is None
        stop.check()  # nothing asked for: no exception
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):  # the handler runs after each kill
            os.kill(os.getpid(), signum)
        assert (stop.signum, stop.reason, stop.log_line) == (signal.SIGTERM, "terminated", "SIGTERM: stopping")
        with pytest.raises(Stopped) as stopped:
            stop.check()
        assert stopped.value.exit_code == 143
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_in_a_program_that_exits_after_its_run_the_signals_after_it_are_ignored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """run.py: between the run's orderly end and the process's exit, a late SIGTERM of the process group
    (`timeout`'s second, or a third) must not kill the process with the default handler put back."""
    previous = {signum: signal.getsignal(signum) for signum in stopping.STOP_SIGNALS}
    monkeypatch.setattr(stopping, "_exit_after_runs", False)
    try:
        stopping.exit_after_runs()
        with stop_requests() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
        assert stop.reason == "terminated"
        assert all(signal.getsignal(signum) == signal.SIG_IGN for signum in stopping.STOP_SIGNALS)
        os.kill(os.getpid(), signal.SIGTERM)  # ignored: the test goes on
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_a_hangup_is_a_stop_unless_the_process_started_with_it_ignored() -> None:
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with stop_requests() as stop:
            os.kill(os.getpid(), signal.SIGHUP)
            assert (stop.reason, stop.log_line) == ("hangup", "SIGHUP (the terminal closed): stopping")
            with pytest.raises(Stopped) as stopped:
                stop.check()
            assert stopped.value.exit_code == 129
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL  # put back
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as `nohup` starts a process
        with stop_requests() as stop:
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN  # left to nohup
            os.kill(os.getpid(), signal.SIGHUP)
            assert stop.reason is None
            stop.check()  # no exception: the run goes on
    finally:
        signal.signal(signal.SIGHUP, previous)


def _config(savedir: Path, total_steps: int) -> Config:
    return Config(env="CartPole-v1", num_actors=1, envs_per_actor=2, unroll_length=5, batch_size=4,
                  num_learner_threads=1, hidden_size=16, total_steps=total_steps, log_interval_s=0.2,
                  disable_cuda=True, savedir=str(savedir), xpid="built")


@pytest.fixture(scope="module")
def savedir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of 200 steps, the run that the tests here try to resume."""
    savedir = tmp_path_factory.mktemp("runs")
    training.train(_config(savedir, 200))
    return savedir


def _files(savedir: Path) -> dict[str, bytes]:
    return {str(path.relative_to(savedir)): path.read_bytes() for path in sorted(savedir.rglob("*")) if path.is_file()}


def _signalling(function: Callable[..., Any], signum: int) -> Callable[..., Any]:
    def wrapper(*args: Any) -> Any:
        os.kill(os.getpid(), signum)  # the handler has run when kill returns
        return function(*args)
    return wrapper


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_building_stops_before_anything_is_written(savedir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  signum: int) -> None:
    before = _files(savedir)
    monkeypatch.setattr(training, "probe_env", _signalling(training.probe_env, signum))
    servers: list[int] = []

    def start_fork_server() -> None:
        actor_pool.start_fork_server()
        servers.append(forkserver._forkserver._forkserver_pid)  # type: ignore[attr-defined]

    monkeypatch.setattr(training, "start_fork_server", start_fork_server)
    with pytest.raises(Stopped) as stopped:
        training.train(_config(savedir, 400))
    assert stopped.value.exit_code == 128 + signum
    assert _files(savedir) == before  # not a byte changed in the run directory, nor `latest` beside it
    assert len(servers) == 1 and servers[0] is not None  # the build started the fork server ...
    with pytest.raises(ProcessLookupError):  # ... and the refused build stopped it again: killed and reaped
        os.kill(servers[0], 0)
    assert forkserver._forkserver._forkserver_pid is None  # type: ignore[attr-defined]


def test_a_signal_after_the_run_files_are_written_starts_nothing_and_saves_nothing(
        savedir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = (savedir / "built" / "model.tar").read_bytes()
    monkeypatch.setattr(training, "write_run_files", _signalling(training.write_run_files, signal.SIGTERM))
    with pytest.raises(Stopped) as stopped:
        training.train(_config(savedir, 400))
    assert stopped.value.exit_code == 143
    log_text = (savedir / "built" / "out.log").read_text().split("Resuming from step 200")[1]
    assert "SIGTERM: stopping" in log_text and "started" not in log_text  # no actor, no learner
    assert (savedir / "built" / "model.tar").read_bytes() == saved and checkpoint_step(savedir / "built") == 200
    meta = json.loads((savedir / "built" / "meta.json").read_text())
    assert (meta["end_reason"], meta["final_step"], len(meta["starts"])) == ("terminated", 200, 2)



_RANK = """
import signal, sys, time
from impala.stopping import stop_with_launcher
stop_with_launcher()
signal.signal(signal.SIGTERM, lambda *_: (print("SIGTERM", flush=True), sys.exit(0)))
print("ready", flush=True)
time.sleep(30)
print("no signal", flush=True)
"""

_LAUNCHER = """
import os, subprocess, sys, time
env = {**os.environ, **dict(v.split("=", 1) for v in sys.argv[2:])}
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, start_new_session=True,
                         stdout=open(os.environ["RANK_OUT"], "w"))
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("torchrun", [True, False])
def test_a_torchrun_rank_is_sent_sigterm_when_torchrun_is_killed(tmp_path: Path, torchrun: bool) -> None:
    """torchrun starts each rank in a session of its own: a kill -9 of torchrun's process group leaves them running
    on without it. Under torchrun the kernel sends a rank SIGTERM when torchrun ends (an orderly stop, a final
    checkpoint); outside torchrun nothing is asked of it."""
    out = tmp_path / "rank.out"
    variables = ["TORCHELASTIC_RUN_ID=none", "LOCAL_RANK=0"] if torchrun else []
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _RANK, *variables], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "RANK_OUT": str(out),
                                                "PYTHONPATH": str(REPO_ROOT)})
    assert launcher.stdout is not None
    rank_pid = int(launcher.stdout.readline())
    try:
        deadline = time.monotonic() + 30
        while "ready" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + (10 if torchrun else 2)
        while "SIGTERM" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.read_text().split() == (["ready", "SIGTERM"] if torchrun else ["ready"])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank_pid, signal.SIGKILL)


def test_a_background_jobs_ctrl_c_before_the_runs_handler_is_in_ends_it_with_130(tmp_path: Path) -> None:
    """A shell starts a background job (`python run.py ... &`) with Ctrl-C ignored. The run's handler takes it all
    the same, but that is in only once torch is imported: a Ctrl-C before then (here, while the flags file is
    read: a FIFO, so the run waits there) was dropped, and the run trained to its end."""
    flags = tmp_path / "flags"
    os.mkfifo(flags)
    child = subprocess.Popen(["bash", "-c", 'trap "" INT; exec "$0" run.py "$1"', sys.executable, f"@{flags}"],
                             cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while _waits_on(child.pid) != "wait_for_partner" and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.05)  # until it opens the flags file: run.py's first lines ran, torch is not imported
        assert _waits_on(child.pid) == "wait_for_partner", "the run never opened its flags file"
        assert not _ignores_sigint(child.pid), "the run still ignores Ctrl-C"
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
        assert child.returncode == 130 and "Traceback" not in err, err
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def _waits_on(pid: int) -> str:
    """Where in the kernel process `pid` sleeps (wait_for_partner: opening a FIFO that no writer has open)."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/wchan").read_text()
    return ""


def _ignores_sigint(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    raise AssertionError(f"no SigIgn in /proc/{pid}/status")
