"""Reading a run's scalars back: the same points TensorBoard's own reader shows (a resume's purge applied), a
damaged record reported, and a run's training time without the pauses between its sessions."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.record_writer import RecordWriter
from torch.utils.tensorboard import SummaryWriter

from impala import plotting
from impala.events import RunScalars, read_scalars

REPO = Path(__file__).resolve().parent.parent
A = plotting.RETURN_TAG


def _resumed_run(run_dir: Path) -> None:
    """Killed at step 300 with its checkpoint at 200; resumed there; "b" logged only by the killed session past 200."""
    with SummaryWriter(str(run_dir)) as writer:
        for step in (100, 200, 300):
            writer.add_scalar(A, float(step), step)
        for step in (200, 300):
            writer.add_scalar("b", float(step), step)
        writer.add_text("note", "not a scalar", 0)
    with SummaryWriter(str(run_dir), purge_step=200) as writer:
        for step in (200, 400):
            writer.add_scalar(A, -float(step), step)


def test_the_points_are_those_tensorboards_reader_shows_of_a_resumed_run(tmp_path: Path) -> None:
    _resumed_run(tmp_path)
    reference = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    reference.Reload()
    assert sorted(reference.Tags()["scalars"]) == ["b", A]  # "b" listed, though none of its points is left

    scalars = read_scalars(tmp_path, (A, "b", "never"))

    for tag in (A, "b"):
        assert scalars.points[tag] == [(e.step, e.wall_time, e.value) for e in reference.Scalars(tag)]
    assert [(step, value) for step, _, value in scalars.points[A]] == [(100, 100.0), (200, -200.0), (400, -400.0)]
    assert scalars.points["b"] == [] and scalars.points["never"] == []
    assert len(scalars.resumes) == 1 and scalars.damaged == []
    first_point_wall = scalars.points[A][0][1]
    assert scalars.first_wall is not None and 0 <= first_point_wall - scalars.first_wall < 60


def _framed(payload: bytes) -> bytes:
    return struct.pack("<QI", len(payload), 0) + payload + b"\0\0\0\0"


def test_a_record_that_cannot_be_read_ends_its_file_and_is_reported_but_the_newest_files_last_is_not(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _resumed_run(tmp_path)
    older, newest = sorted(tmp_path.glob("events.out.tfevents.*"))
    whole = read_scalars(tmp_path, (A,)).points[A]
    older_size = older.stat().st_size
    with open(older, "ab") as f:  # a kill cut the older session's last record short
        f.write(struct.pack("<QI", 100, 0) + b"abc")
    with open(newest, "ab") as f:  # the newest is being written: its last record not yet whole
        f.write(struct.pack("<QI", 100, 0))
    scalars = read_scalars(tmp_path, (A,))
    assert scalars.points[A] == whole
    assert scalars.damaged == [(older, older_size)]

    with open(older, "ab") as f:  # zeros after the record cut short, as a power cut leaves them: still its end
        f.write(bytes(32))
    assert read_scalars(tmp_path, (A,)).damaged == [(older, older_size)]
    zeros = tmp_path / "events.out.tfevents.0.zeros"  # read first: zeros where its first record should be
    zeros.write_bytes(bytes(64))
    scalars = read_scalars(tmp_path, (A,))
    assert scalars.damaged[0] == (zeros, 0) and scalars.first_wall is not None and scalars.first_wall > 1e9
    assert scalars.resumes[0][1] < 60  # the pause before the resumed session is not counted from time 0
    zeros.unlink()

    garbled = tmp_path / "events.out.tfevents.0.garbled"  # read first: its name sorts first
    event = Event(step=7, wall_time=1.0, summary=Summary(value=[Summary.Value(tag=A, simple_value=7.0)]))
    good = _framed(event.SerializeToString())
    garbled.write_bytes(good + _framed(b"\xff\xff\xff") + good)
    scalars = read_scalars(tmp_path, (A,))
    assert scalars.points[A] == [(7, 1.0, 7.0), *whole]  # the record after the garbled one is not trusted
    assert scalars.damaged == [(garbled, len(good)), (older, older_size)]
    curve = plotting.load_curve(tmp_path.parent, tmp_path.name)  # plot mode draws what was read, and says so
    assert curve.steps.tolist() == [7, 100, 200, 400]
    assert capsys.readouterr().out == (
        f"Run {tmp_path.name}: left out the rest of 2 event file(s) after a record that could not be read (damaged, "
        f"or cut short by a kill): {garbled.name} from byte {len(good):,}; {older.name} from byte {older_size:,}\n")


def test_training_time_leaves_out_the_pause_between_sessions() -> None:
    scalars = RunScalars({}, first_wall=100.0, resumes=[(1_000.0, 500.0), (2_000.0, 50.0)])
    assert scalars.active_s(np.array([100.0, 400.0, 1_000.0, 1_100.0, 2_100.0])).tolist() == [0, 300, 400, 500, 1450]


def _session(path: Path, start_s: float, steps: range, purge_step: int | None = None) -> None:
    """An event file as a session of run.py writes it, its wall times chosen: one game a second from `start_s`."""
    with open(path, "wb") as f:
        writer = RecordWriter(f)
        writer.write(Event(wall_time=start_s, file_version="brain.Event:2").SerializeToString())
        if purge_step is not None:
            start = Event(wall_time=start_s, step=purge_step, session_log=SessionLog(status=SessionLog.START))
            writer.write(start.SerializeToString())
        for i, step in enumerate(steps):
            value = Summary.Value(tag="charts/episodic_return", simple_value=float(step))
            writer.write(Event(wall_time=start_s + 1 + i, step=step, summary=Summary(value=[value])).SerializeToString())


def test_results_script_reads_a_resumed_run_whose_games_are_all_purged_and_counts_no_pause(tmp_path: Path) -> None:
    """A run rewound to before its first game (every point of its return tag dropped) is read as a run without
    games, not a traceback; a run resumed three days later trained for its sessions' time, not three days."""
    purged, paused = tmp_path / "purged", tmp_path / "paused"
    for run_dir in (purged, paused):
        run_dir.mkdir()
        (run_dir / "flags.json").write_text(json.dumps({"env": "PongNoFrameskip-v4"}))
        (run_dir / "meta.json").write_text(json.dumps({"final_step": 1000, "command": "run.py"}))
    _session(purged / "events.out.tfevents.1.h.1.0", 1_000.0, range(100, 400, 100))
    _session(purged / "events.out.tfevents.2.h.2.0", 5_000.0, range(0), purge_step=50)
    _session(paused / "events.out.tfevents.1.h.1.0", 1_000.0, range(100, 400, 100))  # games at 1,001-1,003 s
    three_days_s = 3 * 86_400.0
    _session(paused / "events.out.tfevents.2.h.2.0", 1_003.0 + three_days_s, range(300, 600, 100), purge_step=300)

    done = subprocess.run([sys.executable, "scripts/results.py", "pong", "--compare", str(purged), str(paused),
                           "--out", str(tmp_path / "cmp.png")], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)

    assert done.returncode == 0, done.stderr
    rows = {row["xpid"]: row for row in map(json.loads, filter(lambda line: line.startswith("{"),
                                                                done.stdout.splitlines()))}
    assert (rows["purged"]["games"], rows["purged"]["wall_s"]) == (0, None)
    # Two games of the first session (the third, at step 300, dropped), three of the second: 3 s, then 3 s more.
    assert (rows["paused"]["games"], rows["paused"]["wall_s"]) == (5, 6.0)
