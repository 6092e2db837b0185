"""The run directory: one training at a time holds it; its record files are written atomically, and a record that
cannot be read never keeps a run with a good checkpoint from resuming."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch
from process_helpers import REPO_ROOT, SMALL_RUN, Training, run_py

from impala import rundir
from impala.checkpoint import CHECKPOINT_NAME, save_checkpoint
from impala.config import Config, UserError
from impala.rundir import (
    DirectoryLock,
    NameTaken,
    finish_run_files,
    keep_replaced_checkpoint,
    prepare_run_directory,
    read_meta,
    record_best,
    run_directory,
    write_latest,
)


def test_a_missing_record_is_empty_and_a_readable_one_is_read(tmp_path: Path) -> None:
    assert read_meta(tmp_path) == {}
    (tmp_path / "meta.json").write_text(json.dumps({"starts": ["a", "b"]}))
    assert read_meta(tmp_path) == {"starts": ["a", "b"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json"]


@pytest.mark.parametrize("content", [b"", b'{"starts": ["2026-01-01T00:0', b"\xff\xfe", b"[1, 2]",
                                     b'{"starts": "2026-01-01T00:00:00+00:00"}'],
                         ids=["empty", "cut short", "not text", "not an object", "starts not a list"])
def test_an_unreadable_record_is_moved_aside_whole_with_a_warning(tmp_path: Path, content: bytes,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "meta.json").write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="impala"):
        assert read_meta(tmp_path) == {}
    assert not (tmp_path / "meta.json").exists()
    assert (tmp_path / "meta.json.unreadable").read_bytes() == content
    assert "meta.json.unreadable" in caplog.text and "could not be read" in caplog.text


def test_a_second_unreadable_record_never_overwrites_the_first(tmp_path: Path) -> None:
    for number, content in enumerate([b"first", b"second", b"third"]):
        (tmp_path / "meta.json").write_bytes(content)
        assert read_meta(tmp_path) == {}
        assert number == 0 or (tmp_path / f"meta.json.unreadable-{number}").read_bytes() == content
    assert (tmp_path / "meta.json.unreadable").read_bytes() == b"first"


def test_a_write_that_fails_part_way_leaves_the_previous_record_whole(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    before = {"starts": ["2026-01-01T00:00:00+00:00"], "end_reason": None}
    (tmp_path / "meta.json").write_text(json.dumps(before))

    def full_disk(self: Path, text: str) -> int:  # half the bytes reach the file, then the disk is full
        with open(self, "w") as f:
            f.write(text[: len(text) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        finish_run_files(tmp_path, "finished", 1000)
    with pytest.raises(OSError, match="No space left"):
        record_best(tmp_path, {"step": 10})
    write_latest(tmp_path / "run")  # a convenience: never raises
    monkeypatch.undo()
    assert json.loads((tmp_path / "meta.json").read_text()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json"]  # no temporary left behind


def test_a_temporary_latest_file_of_a_start_killed_mid_write_is_removed_by_the_next(tmp_path: Path) -> None:
    """A kill -9 between the write and the rename leaves `.latest-PID`; a start running meanwhile keeps its own."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)
    stale, running = tmp_path / f".latest-{int(dead.stdout)}", tmp_path / ".latest-1"  # pid 1: always running
    elsewhere = tmp_path / ".latest-999999999"  # no such pid here: another machine's writer, on a shared SAVEDIR
    for path in (stale, running, elsewhere):
        path.write_text("old\n")
    two_minutes_ago = time.time() - 120
    os.utime(stale, (two_minutes_ago, two_minutes_ago))
    write_latest(tmp_path / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".latest-1", ".latest-999999999", "latest"]
    assert (tmp_path / "latest").read_text() == "run\n"


@pytest.mark.slow
def test_a_run_whose_record_was_cut_short_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    args = (*SMALL_RUN, "--disable_cuda", "--savedir", str(tmp_path), "--xpid", "cut")
    first = run_py(*args, "--total_steps", "400")
    assert first.returncode == 0, first.stderr
    run_dir = tmp_path / "cut"
    first_step = torch.load(run_dir / CHECKPOINT_NAME, weights_only=True)["step"]
    (run_dir / "meta.json").write_text('{"starts": ["2026')  # as a full disk left it under an older version

    resumed = run_py(*args, "--total_steps", "800")

    assert resumed.returncode == 0, resumed.stderr
    assert "Traceback" not in resumed.stderr
    assert "could not be read" in resumed.stderr + resumed.stdout
    assert (run_dir / "meta.json.unreadable").read_text() == '{"starts": ["2026'
    meta = json.loads((run_dir / "meta.json").read_text())
    assert len(meta["starts"]) == 1 and meta["end_reason"] == "finished" and meta["final_step"] >= 800
    assert torch.load(run_dir / CHECKPOINT_NAME, weights_only=True)["step"] >= 800 > first_step


def test_a_run_directory_is_held_by_one_training_at_a_time(tmp_path: Path) -> None:
    first, second = DirectoryLock(), DirectoryLock()
    first.hold(tmp_path)
    first.hold(tmp_path)  # again by its holder: nothing changes
    with pytest.raises(UserError, match=rf"run directory {tmp_path} is in use by another training"):
        second.hold(tmp_path)
    assert second.path is None
    first.release()
    with second:
        second.hold(tmp_path)  # free once the first let go
        assert second.path == tmp_path
    assert second.path is None
    first.hold(tmp_path)  # the context's exit released it
    first.release()
    assert list(tmp_path.iterdir()) == []  # taking it wrote nothing


@pytest.mark.slow
def test_a_second_training_of_a_running_run_is_refused_and_the_run_resumes_once_it_has_ended(tmp_path: Path) -> None:
    running = Training(tmp_path, "busy", "--disable_cuda", "--checkpoint_interval_s", "0.5", total_steps=10_000_000)
    try:
        running.wait_for(r"Saved checkpoint at step [1-9]")
        second = run_py(*SMALL_RUN, "--disable_cuda", "--savedir", str(tmp_path), "--xpid", "busy",
                        "--total_steps", "20000000")
        assert second.returncode == 2
        assert second.stderr == (f"run.py: error: run directory {tmp_path / 'busy'} is in use by another training "
                                 "(running or still stopping); wait for it to end, or choose another --xpid\n")
        assert len(read_meta(running.run_dir)["starts"]) == 1  # the second wrote nothing
        assert len(list(running.run_dir.glob("events.out.tfevents.*"))) == 1
        running.signal(signal.SIGTERM)
        assert running.wait(timeout=30) == 143
    finally:
        running.close()
    stopped_at = torch.load(running.run_dir / CHECKPOINT_NAME, weights_only=True)["step"]
    resumed = run_py(*SMALL_RUN, "--disable_cuda", "--savedir", str(tmp_path), "--xpid", "busy",
                     "--total_steps", str(stopped_at + 400))
    assert resumed.returncode == 0, resumed.stderr
    assert f"Resuming from step {stopped_at}" in resumed.stdout + resumed.stderr
    assert len(read_meta(running.run_dir)["starts"]) == 2


class _FrozenClock:
    @staticmethod
    def now(tz: object = None) -> datetime:
        return datetime(2026, 1, 2, 3, 4, 5)


def test_a_default_name_that_is_taken_gets_the_next_number_and_is_claimed_as_new(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("impala.rundir.datetime", _FrozenClock)
    config = Config(env="CartPole-v1", savedir=str(tmp_path))
    assert run_directory(config) == (tmp_path / "CartPole-v1-20260102-030405", False)
    (tmp_path / "CartPole-v1-20260102-030405").mkdir()  # a run started in the same second, ended or not
    (tmp_path / "CartPole-v1-20260102-030405-2").mkdir()
    run_dir, resuming = run_directory(config)
    assert (run_dir, resuming) == (tmp_path / "CartPole-v1-20260102-030405-3", False)
    assert not run_dir.exists()  # choosing writes nothing
    prepare_run_directory(run_dir, claim=True)
    assert run_dir.is_dir()
    with pytest.raises(NameTaken):  # another training claimed it between the choice and the claim
        prepare_run_directory(run_dir, claim=True)


def test_a_default_name_keeps_the_first_hundred_characters_of_a_long_env_id(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An env registered by a module under a long id (`my_envs:LLL...-v0`): its name in full made the run
    directory's name longer than a file name can be, a traceback at the start."""
    monkeypatch.setattr("impala.rundir.datetime", _FrozenClock)
    env = "my_envs:" + "L" * 230 + "-v0"
    run_dir, resuming = run_directory(Config(env=env, savedir=str(tmp_path)))
    assert (run_dir, resuming) == (tmp_path / f"my_envs_{'L' * 92}-20260102-030405", False)
    prepare_run_directory(run_dir, claim=True)
    assert run_dir.is_dir()


def test_trainings_started_together_without_a_name_each_get_a_run_of_their_own(tmp_path: Path) -> None:
    """`for seed in 1 2 3; do python run.py --seed $seed & done`: the same second, the same default name. All three
    used to choose it; the first to create it trained, the others stopped with "in use by another training"."""
    processes = [subprocess.Popen([sys.executable, "run.py", *SMALL_RUN, "--total_steps", "400", "--seed", str(seed),
                                   "--savedir", str(tmp_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for seed in (1, 2, 3)]
    outputs = [process.communicate(timeout=180)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0, 0], "\n".join(outputs)[-3000:]
    runs = sorted(path for path in tmp_path.iterdir() if path.is_dir())
    assert len(runs) == 3
    seeds = sorted(json.loads((run / "flags.json").read_text())["seed"] for run in runs)
    assert seeds == [1, 2, 3]  # each in its own directory, each with its checkpoint
    assert all(torch.load(run / CHECKPOINT_NAME, weights_only=True)["step"] >= 400 for run in runs)


def test_two_rewinds_past_the_same_step_keep_both_histories_checkpoints(tmp_path: Path) -> None:
    """Rewound from step 40, trained to 40 again, rewound again: the second history's model.tar at 40 is kept
    beside the first's, not dropped because a copy of that step's name exists."""
    current, start = tmp_path / CHECKPOINT_NAME, tmp_path / "model_best.tar"
    def state(step: int, weight: float) -> dict:
        return {"model_state_dict": {"w": torch.tensor(weight)}, "flags": {}, "step": step, "model": "mlp",
                "observation_shape": [4], "num_actions": 2}

    save_checkpoint(start, state(20, 0.0))
    for weight in (1.0, 2.0):  # two histories, both at step 40
        save_checkpoint(current, state(40, weight))
        kept = keep_replaced_checkpoint(tmp_path, start)
        assert kept is not None and torch.load(kept, weights_only=True)["model_state_dict"]["w"] == weight
    assert sorted(p.name for p in tmp_path.glob("model_replaced_*")) == ["model_replaced_step_40-2.tar",
                                                                       "model_replaced_step_40.tar"]
    assert keep_replaced_checkpoint(tmp_path, start) is None  # the same model.tar again (a rewind restarted): kept once


def test_the_same_command_with_checkpoint_path_run_again_continues_the_run_rather_than_going_back(
        tmp_path: Path) -> None:
    """`--xpid job --checkpoint PATH` in a job script that a scheduler requeues: its first session starts from
    PATH, and every later one continues job's own model.tar (a run already at --total_steps is refused for it)
    rather than going back to PATH each time, dropping all that came after."""
    assert run_py(*SMALL_RUN, "--disable_cuda", "--savedir", str(tmp_path), "--xpid", "a",
                  "--total_steps", "400").returncode == 0
    start = tmp_path / "a" / CHECKPOINT_NAME
    start_step = torch.load(start, weights_only=True)["step"]
    command = (*SMALL_RUN, "--disable_cuda", "--savedir", str(tmp_path), "--xpid", "job", "--checkpoint", str(start),
               "--total_steps", "800")
    first = run_py(*command)
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"Resumed from {start}\n" in first.stdout
    job = tmp_path / "job"
    assert read_meta(job)["checkpoint_start"] == {"checkpoint": str(start.resolve()), "step": start_step}
    job_step = torch.load(job / CHECKPOINT_NAME, weights_only=True)["step"]

    again = run_py(*command)
    assert again.returncode == 2
    assert (f"{start} (step {start_step}) was this run's start already and the run has gone on from it: it "
            f"continues from its own {job / CHECKPOINT_NAME}") in again.stdout
    assert again.stderr == (f"run.py: error: run {job} already reached step {job_step} of --total_steps 800; pass a "
                            "larger --total_steps to train it further\n")
    assert not list(job.glob("model_replaced_*")) and len(read_meta(job)["starts"]) == 1


def test_a_start_already_taken_is_taken_again_only_when_its_file_changed(tmp_path: Path) -> None:
    """The record holds the start's path and step: the start gone since (pruned by --keep_checkpoints), the run
    goes on from its model.tar; another checkpoint written at that path since (model_best.tar after a better
    evaluation) is a new start; the run's own model.tar gone, the start is all there is."""
    def state(step: int) -> dict:
        return {"model_state_dict": {}, "flags": {"env": "CartPole-v1"}, "step": step, "model": "mlp",
                "observation_shape": [4], "num_actions": 2}

    run_dir = tmp_path / "job"
    run_dir.mkdir()
    start = tmp_path / "elsewhere.tar"
    save_checkpoint(start, state(400))
    save_checkpoint(run_dir / CHECKPOINT_NAME, state(900))
    rundir.record_start(run_dir, start, 400)
    config = Config(env="CartPole-v1", savedir=str(tmp_path), xpid="job", checkpoint=str(start), total_steps=2000)

    def chosen() -> tuple[Path | None, int]:
        _, _, path, checkpoint = rundir.open_run(config, "mlp", (4,), 2)
        assert checkpoint is not None
        return path, checkpoint["step"]

    assert chosen() == (run_dir / CHECKPOINT_NAME, 900)
    kept = start.read_bytes()
    start.unlink()  # a model_step_N.tar of the run's own, pruned by --keep_checkpoints since
    assert chosen() == (run_dir / CHECKPOINT_NAME, 900)
    start.write_bytes(kept)
    save_checkpoint(start, state(600))
    assert chosen() == (start, 600)
    rundir.record_start(run_dir, start, 600)
    (run_dir / CHECKPOINT_NAME).unlink()
    assert chosen() == (start, 600)


def test_resume_of_a_run_that_another_training_holds_says_it_is_in_use(tmp_path: Path) -> None:
    """A training of the run that has not saved its first checkpoint yet: --resume has nothing to continue from
    now, but "drop --resume" would be the wrong advice while the run is in use."""
    run_dir = tmp_path / "busy"
    run_dir.mkdir()
    config = Config(env="CartPole-v1", savedir=str(tmp_path), xpid="busy", resume=True)
    with DirectoryLock() as first:
        first.hold(run_dir)
        with DirectoryLock() as second, pytest.raises(UserError, match=r"^run directory .*busy is in use by another "
                                                                        "training"):
            rundir.open_run(config, "mlp", (4,), 2, second)
    with DirectoryLock() as alone, pytest.raises(UserError, match=r"^--resume: no checkpoint at .*busy/model.tar to "
                                                                   "continue from"):
        rundir.open_run(config, "mlp", (4,), 2, alone)


def test_a_file_system_that_keeps_no_locks_costs_the_lock_with_a_warning_not_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(rundir.fcntl, "flock", no_locks)
    lock = DirectoryLock()
    with caplog.at_level(logging.WARNING, logger="impala"):
        lock.hold(tmp_path)
        lock.hold(tmp_path)  # again, as the run's start does once the directory is prepared: said once
    assert caplog.text.count(f"Could not lock the run directory {tmp_path} (No locks available)") == 1
    assert lock.path is None
    lock.release()
    with pytest.raises(UserError, match=r"^cannot open the run directory .*missing: No such file or directory"):
        lock.hold(tmp_path / "missing")


def test_a_start_removes_what_a_killed_write_left_and_nothing_else(tmp_path: Path) -> None:
    """kill -9 in the middle of a rewrite leaves its temporary file: the next start under the run's lock removes
    each kind (a checkpoint's, meta.json's, logs.csv's, the writability probe's) and keeps the run's own files."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    left = [".model.tar.tmp-41", ".meta.json.tmp-42", ".flags.json.tmp-43", "logs.csv.tmp", ".write-test-44"]
    kept = ["model.tar", "meta.json", "flags.json", "logs.csv", "model_step_100.tar", "notes.tmp"]
    for name in left + kept:
        (run_dir / name).write_text("x")
    prepare_run_directory(run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(kept)
    assert all((run_dir / name).read_text() == "x" for name in kept)


def test_a_rewind_from_checkpoints_saved_before_evaluation_seeds_were_counted_goes_on_past_their_seeds(
        tmp_path: Path) -> None:
    """Evaluation n (from 1) played the seeds n x --eval_episodes on before their count was kept: a rewind of such
    a run must go on past the seeds its model.tar's evaluations played, not from 0 (the count the load found)."""
    shapes = {"model_state_dict": {}, "observation_shape": [4], "num_actions": 2, "flags": {"eval_episodes": 10}}
    save_checkpoint(tmp_path / "model.tar", {**shapes, "step": 900, "evaluations": 9})  # 9 evaluations of 10 games
    best = {**shapes, "step": 300, "evaluations": 3}
    rundir._go_on_numbering(best, tmp_path, tmp_path / "model_best.tar", eval_episodes=5)
    assert (best["evaluations"], best["eval_seeds_used"]) == (9, 100)


def test_meta_json_records_the_flags_a_flags_file_gave_rather_than_its_name(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The file may change or go after the run started: meta.json's command is what was run."""
    (tmp_path / "run.flags").write_text("--env CartPole-v1  # the env\n--num_actors 2\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["run.py", "@run.flags", "--seed", "3"])
    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    rundir.write_run_files(Config(env="CartPole-v1", num_actors=2, seed=3), run_dir, resuming=False)
    (tmp_path / "run.flags").unlink()
    assert json.loads((run_dir / "meta.json").read_text())["command"] == (
        "run.py --env CartPole-v1 --num_actors 2 --seed 3")
    rundir.write_run_files(Config(env="CartPole-v1", num_actors=2, seed=3), run_dir, resuming=True)
    assert json.loads((run_dir / "meta.json").read_text())["command"] == "run.py @run.flags --seed 3"  # as typed


def test_a_resume_after_a_session_that_never_recorded_its_end_says_it_was_killed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A run.py killed whole (kill -9, the OOM killer taking the learner, a lost machine) writes nothing more: the
    next start is the first to know, and says so, rather than resuming as if the last session had ended in order."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = Config(env="CartPole-v1")
    said = "The last session of this run, started 2026-11-29T10:00:00+00:00, never recorded its end: it was killed"
    for ended, checkpoint_step, told in [(None, 640, True), ("2026-11-29T11:00:00+00:00", 640, False),
                                         (None, None, False)]:  # without a checkpoint, a start from step 0 says so
        meta = {"starts": ["2026-11-29T10:00:00+00:00"], "ended": ended, "checkpoint_step": checkpoint_step}
        (run_dir / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if v is not None or k == "ended"}))
        caplog.clear()
        with caplog.at_level("WARNING", logger="impala"):
            assert rundir.write_run_files(config, run_dir, resuming=True) == 1
        assert (said in caplog.text) == told, (meta, caplog.text)
