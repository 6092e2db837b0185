"""Every way a run ends leaves nothing behind: no process of its group, no /dev/shm file it had mapped,
and a final checkpoint. (SIGTERM and resume: test_resume.py; actor failures: test_faults.py.)"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from process_helpers import Training, checkpoint_step, shm_left, wait_until_gone

from impala import actor_pool


def test_ctrl_c_to_the_process_group_stops_in_order(tmp_path: Path) -> None:
    run = Training(tmp_path, "ctrl-c")
    try:
        run.wait_for_steps(200)
        shm = run.shm_inodes()
        assert shm, "the run maps its semaphores and shared tensors from /dev/shm"
        run.signal(signal.SIGINT, group=True)  # what a terminal's Ctrl-C does: the whole group gets it
        assert run.wait(timeout=30) == 130
        assert wait_until_gone(run.pgid, timeout=30) == []
        assert shm_left(shm) == []
        text = run.text()
        assert "Interrupted: stopping" in text and "Traceback" not in text
        assert checkpoint_step(run.run_dir) >= 200
        assert json.loads((run.run_dir / "meta.json").read_text())["end_reason"] == "interrupted"
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
    finally:
        run.close()


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
        actor_pool.stop_fork_server()
        assert time.monotonic() - start < 5
        with pytest.raises(ProcessLookupError):  # killed and reaped
            os.kill(server_pid, 0)
        assert forkserver._forkserver._forkserver_pid is None  # type: ignore[attr-defined]  # the next run starts one
    finally:
        child.kill()
        child.join(timeout=10)
