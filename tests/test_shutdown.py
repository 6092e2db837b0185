"""Every way a run ends leaves nothing behind: no process of its group, no /dev/shm file it had mapped,
and a final checkpoint. (SIGTERM and resume: test_resume.py; actor failures: test_faults.py.)"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pty
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from process_helpers import (
    REPO_ROOT,
    SMALL_RUN,
    Training,
    checkpoint_step,
    children,
    group_processes,
    hangups_not_ignored,
    shm_left,
    wait_until_gone,
)

from impala import actor_pool, distributed, training
from impala.config import Config, UserError
from impala.metrics import RunLog


@pytest.mark.parametrize("signum, said, reason", [(signal.SIGINT, "Interrupted: stopping", "interrupted"),
                                                  (signal.SIGHUP, "SIGHUP (the terminal closed)", "hangup")],
                         ids=["ctrl-c", "hangup"])
def test_ctrl_c_or_a_hangup_to_the_process_group_stops_in_order(tmp_path: Path, signum: int, said: str,
                                                                reason: str) -> None:
    """What a terminal's Ctrl-C does, or its closing: the whole group gets the signal, the run's resource tracker
    too, which must outlive it (it once died of the hangup, and wrote tracebacks to stderr)."""
    with hangups_not_ignored():
        run = Training(tmp_path, reason)
    try:
        run.wait_for_steps(200)
        shm = run.shm_inodes()
        assert shm, "the run maps its semaphores and shared tensors from /dev/shm"
        run.signal(signum, group=True)
        assert run.wait(timeout=30) == 128 + signum
        assert wait_until_gone(run.pgid, timeout=30) == []
        assert shm_left(shm) == []
        text = run.text()
        assert said in text and "Traceback" not in text and "resource_tracker" not in text, text[-3000:]
        assert checkpoint_step(run.run_dir) >= 200
        assert json.loads((run.run_dir / "meta.json").read_text())["end_reason"] == reason
    finally:
        run.close()


def test_a_finished_run_leaves_nothing(tmp_path: Path) -> None:
    run = Training(tmp_path, "done", total_steps=2_000)
    try:
        run.wait_for(r"Actor 1 started")
        shm = run.shm_inodes()
        assert run.wait(timeout=90) == 0
        assert wait_until_gone(run.pgid, timeout=30) == []
        assert shm_left(shm) == []
        assert checkpoint_step(run.run_dir) == 2_000
        assert json.loads((run.run_dir / "meta.json").read_text())["end_reason"] == "finished"
        assert "had not exited" not in run.text()  # the exit's own bound (run.exit_within) never came into it
    finally:
        run.close()


def test_the_process_exits_even_when_the_interpreter_exit_hangs(tmp_path: Path) -> None:
    """The last step of a run is the interpreter's exit, which waits for every non-daemon thread and runs the
    atexit handlers: one that never ends (here a thread started before the run) would keep the process for
    good after its run ended. `run.exit_within` ends it EXIT_GRACE_S later with the run's exit code and
    prints the stuck thread's stack. Without it this test hits its 120 s timeout."""
    driver = ("import sys, threading, run\n"
              "run.EXIT_GRACE_S = 2\n"
              "threading.Thread(target=threading.Event().wait, name='never-ends').start()\n"
              "run.exit_within(run.main(sys.argv[1:]))\n")
    result = subprocess.run([sys.executable, "-c", driver, *SMALL_RUN, "--total_steps", "200",
                             "--savedir", str(tmp_path), "--xpid", "exit-hangs"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "run.py: the process had not exited 2 s after the run ended" in result.stderr
    assert re.search(r"threading\.py\", line \d+ in wait", result.stderr), result.stderr  # the stuck thread
    run_dir = tmp_path / "exit-hangs"
    assert checkpoint_step(run_dir) == 200
    assert json.loads((run_dir / "meta.json").read_text())["end_reason"] == "finished"


def test_a_daemon_thread_inside_torch_at_the_exit_does_not_abort_it(tmp_path: Path) -> None:
    """The interpreter's teardown ends a daemon thread that is inside a torch call with pthread_exit, from a C++
    destructor, which aborts the process ("terminate called without an active exception", SIGABRT) and loses
    the run's exit code (a CI run of the back-to-back SIGTERM test, once). `run.exit_within` ends the process
    without that teardown, after doing the rest of an exit: atexit handlers, stdout flushed. Before it, this
    driver aborted 10 times in 10."""
    marker = tmp_path / "atexit-ran"
    driver = ("import atexit, pathlib, sys, threading, torch, run\n"
              "a = torch.ones(64, 64)\n"
              "def spin():\n"
              "    while True:\n"
              "        a @ a\n"
              "threading.Thread(target=spin, daemon=True).start()\n"
              f"atexit.register(pathlib.Path({str(marker)!r}).write_text, 'yes')\n"
              "print('last words', end='')\n"  # left in the buffer of a pipe
              "run.exit_within(143)\n")
    result = subprocess.run([sys.executable, "-c", driver], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 143, result.stderr
    assert result.stdout == "last words"
    assert marker.read_text() == "yes"


def test_a_rank_that_cannot_leave_its_process_group_still_ends(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Under torchrun the last step of `train` is leaving the process group (`destroy_process_group`), which
    waits on the other ranks: bounded like every close after the final checkpoint."""
    release = threading.Event()
    monkeypatch.setattr(training, "END_CLOSE_TIMEOUT_S", 0.5)
    # As if under torchrun, as a rank other than 0 (which alone logs the run: its console keeps to warnings).
    monkeypatch.setattr(distributed, "join", lambda config: (config, types.SimpleNamespace(rank=1)))
    monkeypatch.setattr(distributed, "leave", lambda coordinator: release.wait(60))

    def build(config: Config, coordinator: object, stop: object, lock: object) -> None:
        raise UserError("the build refused the run")

    monkeypatch.setattr(training, "build", build)
    start = time.monotonic()
    try:
        with pytest.raises(UserError, match="refused"), caplog.at_level(logging.ERROR, logger=training.log.name):
            training.train(Config(env="CartPole-v1", disable_cuda=True))
    finally:
        release.set()
    assert time.monotonic() - start < 10  # without the bound, 60 s
    assert "left leaving the learner ranks' process group behind" in caplog.text


def test_a_fork_server_that_does_not_exit_is_killed_within_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process the fork server forked keeps the server's "alive" pipe open, so the server never exits by
    itself: stopping it must still return, with the server gone."""
    from multiprocessing import forkserver

    monkeypatch.setattr(actor_pool, "FORK_SERVER_STOP_TIMEOUT_S", 1.0)
    child = actor_pool.process_context().Process(target=time.sleep, args=(60,), daemon=True)
    child.start()
    server_pid = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    try:
        start = time.monotonic()
        with monkeypatch.context() as patch:  # killed through its pidfd, never by a pid another process may have
            patch.setattr(os, "kill", lambda pid, signum: pytest.fail(f"os.kill({pid}, {signum})"))
            actor_pool.stop_fork_server()
        assert time.monotonic() - start < 5
        with pytest.raises(ProcessLookupError):  # killed and reaped
            os.kill(server_pid, 0)
        assert forkserver._forkserver._forkserver_pid is None  # type: ignore[attr-defined]  # the next run starts one
    finally:
        child.kill()
        child.join(timeout=10)


def _assert_stopped_in_order(run: Training, shm: set[int]) -> None:
    """One orderly stop on SIGTERM: no traceback, a whole final checkpoint, nothing of the run left running or
    in /dev/shm, no actor or evaluator that died or was restarted on the way."""
    assert wait_until_gone(run.pgid, timeout=30) == []
    assert shm_left(shm) == []
    for text in (run.text(), (run.run_dir / "out.log").read_text()):
        assert "Traceback" not in text and "SIGTERM: stopping" in text, text
        assert not re.search(r"died|Restarted|did not stop", text), text
    assert checkpoint_step(run.run_dir) > 0  # loads: a whole checkpoint, saved after the signals
    assert json.loads((run.run_dir / "meta.json").read_text())["end_reason"] == "terminated"


def test_back_to_back_sigterms_to_the_process_and_its_group_stop_every_run_in_order(tmp_path: Path) -> None:
    """What `timeout`, `docker stop` and job schedulers do: SIGTERM to run.py and at once to its whole group.
    A second signal used to raise inside the handling of the first (a traceback, exit 1) or inside the
    shutdown (no final checkpoint). Where the signals land varies, so the stop is repeated, two runs at a
    time; a third signal, after a random pause, lands somewhere in the shutdown."""
    pauses = random.Random(0)
    for pair in range(5):
        runs = [Training(tmp_path, f"twice-{pair}-{i}") for i in range(2)]
        try:
            for run in runs:
                run.wait_for_steps(1)  # learning: the signals land in the middle of the run
            shm = [run.shm_inodes() for run in runs]
            for run in runs:
                os.kill(run.process.pid, signal.SIGTERM)
                os.killpg(run.pgid, signal.SIGTERM)
            time.sleep(pauses.uniform(0, 0.5))
            for run in runs:
                if run.process.poll() is None:
                    os.killpg(run.pgid, signal.SIGTERM)
            for run, inodes in zip(runs, shm):
                assert run.wait(timeout=60) == 143, run.text()
                _assert_stopped_in_order(run, inodes)
        finally:
            for run in runs:
                run.close()


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs GNU timeout")
def test_gnu_timeout_expiring_stops_the_run_in_order(tmp_path: Path) -> None:
    """`timeout -s TERM N run.py` at its expiry signals run.py and then its group. SIGALRM is what expires
    `timeout`'s timer: sent now, it expires while the run learns, whatever the machine's load."""
    runs = [Training(tmp_path, f"timeout-{i}", wrapper=("timeout", "--preserve-status", "-s", "TERM", "600"))
            for i in range(2)]
    try:
        for run in runs:
            run.wait_for_steps(1)
        main_pids = [children(run.process.pid) for run in runs]
        assert all(len(pids) == 1 for pids in main_pids), main_pids  # run.py, timeout's one child
        shm = [run.shm_inodes(pids[0]) for run, pids in zip(runs, main_pids)]
        for run in runs:
            os.kill(run.process.pid, signal.SIGALRM)
        for run, inodes in zip(runs, shm):
            assert run.wait(timeout=60) == 143, run.text()  # --preserve-status: run.py's own exit code
            _assert_stopped_in_order(run, inodes)
    finally:
        for run in runs:
            run.close()


def test_a_run_killed_whole_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    """kill -9 of the whole process group, the resource tracker too, so that nothing can clean up: what the run
    mapped from /dev/shm must be unlinked already (the traceback queue's three semaphores once stayed)."""
    run = Training(tmp_path, "killed")
    try:
        run.wait_for_steps(200)
        shm = run.shm_inodes()
        assert shm, "the run maps its shared tensors from /dev/shm"
        run.signal(signal.SIGKILL, group=True)
        assert run.wait(timeout=30) == -signal.SIGKILL
        assert wait_until_gone(run.pgid, timeout=30) == []
        assert shm_left(shm) == []
    finally:
        run.close()


def _on_a_terminal(run_dir: Path, nohup: bool = False) -> tuple[int, int]:
    """run.py on a pseudo-terminal of its own, as a shell over ssh runs it (under `nohup`: SIGHUP ignored), until
    it has printed three progress lines; (its pid, the terminal's other end). Closing that end is the dropped
    connection: the kernel sends SIGHUP to run.py and its process group, and writes to the terminal fail after."""
    pid, terminal = pty.fork()
    if pid == 0:  # the child: run.py, session leader on the terminal
        signal.signal(signal.SIGHUP, signal.SIG_IGN if nohup else signal.SIG_DFL)  # the tests may run under nohup
        os.chdir(REPO_ROOT)
        os.execv(sys.executable, [sys.executable, "run.py", *SMALL_RUN, "--disable_cuda", "--savedir",
                                  str(run_dir.parent), "--xpid", run_dir.name, "--total_steps", "10000000"])
    output, deadline = b"", time.monotonic() + 90
    while len(re.findall(rb"step [\d,]+/", output)) < 3 and time.monotonic() < deadline:
        if select.select([terminal], [], [], 1.0)[0]:
            output += os.read(terminal, 65536)
    if len(re.findall(rb"step [\d,]+/", output)) < 3:
        os.killpg(pid, signal.SIGKILL)
        raise AssertionError(output.decode(errors="replace"))
    return pid, terminal


def _logged_steps(run_dir: Path) -> list[int]:
    return [int(s.replace(",", "")) for s in re.findall(r"step ([\d,]+)/", (run_dir / "out.log").read_text())]


def test_a_closed_terminal_stops_the_run_in_order_with_a_final_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "hangup"
    pid, terminal = _on_a_terminal(run_dir)
    try:
        last_logged = max(_logged_steps(run_dir))
        os.close(terminal)
        _, status = os.waitpid(pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # only if the test failed before the run ended
    assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGHUP
    assert wait_until_gone(pid) == []
    text = (run_dir / "out.log").read_text()
    assert "SIGHUP (the terminal closed): stopping" in text and "Traceback" not in text
    assert checkpoint_step(run_dir) >= last_logged > 0  # the final checkpoint, not only a periodic one
    assert json.loads((run_dir / "meta.json").read_text())["end_reason"] == "hangup"
    assert "crashed" not in text  # the actors left the hangup to the main process, as SIGTERM


def test_a_run_under_nohup_outlives_its_terminal(tmp_path: Path) -> None:
    run_dir = tmp_path / "nohup"
    pid, terminal = _on_a_terminal(run_dir, nohup=True)
    try:
        os.close(terminal)
        at_hangup, deadline = max(_logged_steps(run_dir)), time.monotonic() + 60
        while max(_logged_steps(run_dir)) < at_hangup + 2_000 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert max(_logged_steps(run_dir)) >= at_hangup + 2_000, "it trains on, writing its log to out.log"
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGTERM
    assert wait_until_gone(pid) == []
    assert "Traceback" not in (run_dir / "out.log").read_text()
    assert json.loads((run_dir / "meta.json").read_text())["end_reason"] == "terminated"


def test_children_leave_sigterm_to_the_main_process(tmp_path: Path) -> None:
    """Actors, the evaluator and the fork server ignore a SIGTERM meant for the group: they go on until the
    main process stops them in order, and a stop never reads as actors crashing."""
    run = Training(tmp_path, "group", "--eval_interval_s", "1")
    try:
        run.wait_for(r"Evaluator started")
        run.wait_for_steps(1)
        shm = run.shm_inodes()
        others = [pid for pid in group_processes(run.pgid) if pid != run.process.pid]
        assert len(others) >= 4, others  # two actors, the evaluator, the fork server (and the resource tracker)
        for pid in others:  # a group's SIGTERM, as each child sees it, before the main process handles its own
            os.kill(pid, signal.SIGTERM)
        run.wait_for_steps(run.latest_step() + 500)
        assert set(others) <= set(group_processes(run.pgid))  # all alive, still acting
        os.killpg(run.pgid, signal.SIGTERM)
        assert run.wait(timeout=60) == 143, run.text()
        _assert_stopped_in_order(run, shm)
    finally:
        run.close()


def test_a_close_that_hangs_after_the_final_checkpoint_is_left_behind(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing after the final checkpoint may hold the end of a run for good: a close still going after
    END_CLOSE_TIMEOUT_S (here the TensorBoard and CSV logs', blocked for 60 s) is left behind."""
    release = threading.Event()
    monkeypatch.setattr(training, "END_CLOSE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(RunLog, "close", lambda self: release.wait(60))
    config = Config(env="CartPole-v1", num_actors=1, envs_per_actor=2, unroll_length=5, batch_size=4,
                    num_learner_threads=1, hidden_size=16, total_steps=200, disable_cuda=True,
                    savedir=str(tmp_path), xpid="stuck-close")
    start = time.monotonic()
    try:
        run_dir = training.train(config)
    finally:
        release.set()
    assert time.monotonic() - start < 45  # without the bound, 60 s and more
    log_text = (run_dir / "out.log").read_text()
    assert "left closing the TensorBoard and CSV logs behind: it was still going after 1 s, at" in log_text
    assert re.search(r'test_shutdown\.py", line \d+, in <lambda>', log_text), log_text  # where it was stuck
    assert "Run ended (finished) at step 200" in log_text and checkpoint_step(run_dir) == 200
