"""Every way a run ends leaves nothing behind: no process of its group, no /dev/shm file it had mapped,
and a final checkpoint. (SIGTERM and resume: test_resume.py; actor failures: test_faults.py.)"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from process_helpers import Training, checkpoint_step, shm_left, wait_until_gone


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
