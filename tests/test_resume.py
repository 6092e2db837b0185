"""A run stopped with SIGTERM and started again continues where it stopped: same step counter, optimiser and
schedule, and one continuous curve in the same TensorBoard run."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from process_helpers import Training, checkpoint_step, shm_left, wait_until_gone
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from impala.checkpoint import CHECKPOINT_NAME, load_checkpoint

TOTAL_STEPS = 6_000  # a multiple of the 20 steps per update


def test_sigterm_then_resume_reaches_total_steps_with_one_curve(tmp_path: Path) -> None:
    first = Training(tmp_path, "resumed", total_steps=TOTAL_STEPS)
    try:
        first.wait_for_steps(1_000)
        shm = first.shm_inodes()
        first.signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 143
        assert wait_until_gone(first.pgid, timeout=30) == []
        assert shm_left(shm) == []
    finally:
        first.close()
    stopped_at = checkpoint_step(first.run_dir)
    assert 1_000 <= stopped_at < TOTAL_STEPS
    saved = load_checkpoint(first.run_dir / CHECKPOINT_NAME)
    assert saved["updates"] == stopped_at // 20
    assert saved["optimizer_state_dict"]["state"], "RMSprop's running averages are saved"
    lr_at_stop = saved["optimizer_state_dict"]["param_groups"][0]["lr"]
    assert lr_at_stop == pytest.approx(0.001 * (1 - stopped_at / TOTAL_STEPS), rel=1e-6)  # the linear decay

    second = Training(tmp_path, "resumed", "--resume", total_steps=TOTAL_STEPS)
    try:
        assert second.wait(timeout=120) == 0
        assert wait_until_gone(second.pgid, timeout=30) == []
    finally:
        second.close()
    text = second.text()
    assert f"Resuming from step {stopped_at}" in text
    final = load_checkpoint(first.run_dir / CHECKPOINT_NAME)
    assert final["step"] == TOTAL_STEPS
    assert final["updates"] == TOTAL_STEPS // 20  # the counters went on; they did not start again at zero
    # The learning-rate schedule went on too: linear decay to 0 at total_steps.
    assert final["optimizer_state_dict"]["param_groups"][0]["lr"] == pytest.approx(0.0, abs=1e-12)

    events = EventAccumulator(str(first.run_dir))
    events.Reload()
    steps = [event.step for event in events.Scalars("charts/SPS")]
    assert steps == sorted(steps), "one curve: no second series starting again from zero"
    assert steps[0] < stopped_at < steps[-1]
    assert len(list(first.run_dir.glob("events.out.tfevents.*"))) == 2  # both sessions in the same run
