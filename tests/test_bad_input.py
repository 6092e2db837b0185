"""Every error a user can cause ends in one line on stderr, exit code 2, no traceback, and changes nothing
that was saved."""

from __future__ import annotations

import csv
import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from process_helpers import REPO_ROOT, run_py

import run
from impala import buffers, slots, training
from impala.checkpoint import CHECKPOINT_NAME, save_checkpoint
from impala.model import Net

QUICK = ["--env", "CartPole-v1", "--num_actors", "1", "--envs_per_actor", "2", "--unroll_length", "5",
         "--batch_size", "4", "--hidden_size", "32", "--total_steps", "1000"]


def _fails_with(capsys: pytest.CaptureFixture, argv: list[str], pattern: str, prefix: str = "run.py: error: ") -> str:
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(prefix) and err.count("\n") == 1, err
    assert re.search(pattern, err), err
    return err


def _saved_run(savedir: Path, xpid: str, step: int = 40) -> Path:
    """A run directory with a real CartPole checkpoint (no training needed) and its run files."""
    run_dir = savedir / xpid
    run_dir.mkdir(parents=True)
    model = Net((4,), 2, "mlp", False, 32)
    flags = {"env": "CartPole-v1", "use_lstm": False, "hidden_size": 32, "model": "auto"}
    optimizer = torch.optim.RMSprop(model.parameters())
    save_checkpoint(run_dir / CHECKPOINT_NAME, {
        "model_state_dict": model.state_dict(), "optimizer_state_dict": optimizer.state_dict(),
        "step": step, "updates": step // 20, "flags": flags,
        "model": "mlp", "observation_shape": [4], "num_actions": 2})
    (run_dir / "flags.json").write_text(json.dumps(flags))
    (run_dir / "meta.json").write_text(json.dumps({"starts": ["before"]}))
    return run_dir


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir())}


@pytest.mark.parametrize(("flags", "pattern"), [
    (["--env", "CartPol-v1"], r"unknown env id 'CartPol-v1'"),
    # gymnasium's hint for these is a name with no version, or none; the ids of that name are what exists
    (["--env", "pong"], r"error: unknown env id 'pong'; the ids of that name are ALE/Pong-v5, Pong-v0, Pong-v4$"),
    (["--env", "Breakout-v5"], r"the ids of that name are ALE/Breakout-v5, Breakout-v0, Breakout-v4$"),
    (["--env", "Pendulum-v1"], r"only Discrete is supported"),
    (["--env", "no_such_module_here:Maze-v0"], r"no module 'no_such_module_here' to import; put the module"),
    (["--env", "json:Maze-v0"], r"unknown env id 'json:Maze-v0'"),  # the module is there, the id is not
    (["--env", "my_envs:"], r"env 'my_envs:' names no env id; pass ID, or MODULE:ID"),
    (["--env", ":CartPole-v1"], r"env ':CartPole-v1': MODULE of MODULE:ID is empty; pass ID alone, or MODULE:ID"),
    (["--xpid", "latest"], r"--xpid latest: no run in .* yet \(the file .*latest names the run started last\)"),
    (["--batch_size", "0"], r"--batch_size must be >= 1, got 0"),
    (["--num_actors", "-2"], r"--num_actors: takes a number >= 0 or auto, got .-2."),
    (["--num_actors", "0"], r"--num_actors must be >= 1, got 0"),
    (["--learning_rate", "-1"], r"--learning_rate must be > 0"),
    (["--num_buffers", "3"], r"--num_buffers 3 is too few: .* hold up to \d+ slots"),
    (["--env_splits", "3"], r"--envs_per_actor 2 must be a multiple of --env_splits 3"),
    (["--use_lstm", "--inference", "central"], r"--use_lstm is not supported with --inference central"),
    (["--ppo_dual_clip", "0.5"], r"--ppo_dual_clip must be 0 \(off\) or above 1, got 0.5"),
    (["--minibatch_mode", "samples", "--use_lstm"], r"--minibatch_mode samples needs .* without --use_lstm"),
    (["--resume"], r"--resume needs --xpid"),
    (["--checkpoint", "best"], r"--checkpoint best needs --xpid NAME of the run whose model_best.tar to continue from"),
    (["--mode", "plot", "--xpid", "a", "--resume"], r"--resume is for --mode train, not --mode plot$"),
    (["--seed", "-5"], r"--seed must be in \[0, 2\^31\) = \[0, 2147483647\], got -5"),
    (["--seed", str(2**31)], r"--seed must be in \[0, 2\^31\) = \[0, 2147483647\], got 2147483648"),
    (["--unroll_length", "many"], r"--unroll_length: takes a whole number \(such as 5000000 or 5e6\), got 'many'"),
    (["--unroll_length", "1"],  # once every update NaN
     r"PPO normalises its advantages over each minibatch, which batches of 4 x 1 steps cut into 8 minibatches leave"),
    (["--minibatch_mode", "samples", "--minibatches", "20"], r"4 x 5 steps cut into 20 minibatches leave with 1 step"),
    (["--no_such_flag"], r"unrecognized arguments: --no_such_flag"),
    (["--env", "Cart\udcffPole-v1"], r"--env b'Cart\\xffPole-v1' is not UTF-8 text$"),  # bytes 0xff: a surrogate
    # Each once a traceback, a hang, or a run that could only fail later:
    (["--savedir", "~runs"], r"--savedir ~runs: ~runs is the home of a user 'runs', and there is none \(did you mean"),
    (["--xpid", "a" * 300], r"--xpid 'a+' must be a plain name \(letters, digits, '.', '_', '-'\) of at most 215 "),
    (["--checkpoint", "/tmp/" + "b" * 300], r"a part of it is 300 bytes long, more than a file name can be \(255\)"),
    (["--savedir", "/tmp/" + "/".join(["d" * 200] * 21)], (r"--savedir /tmp/d+(/d+)+: it is 4,225 bytes long, more "
     r"than a path can be with a run's files under it \(3,585\)$")),  # ENAMETOOLONG's traceback in every mode, once
    (["--mode", "test", "--checkpoint", "/".join(["c" * 200] * 18) + ".tar"], (r"--checkpoint c+(/c+)+\.tar: it is "
     r"3,621 bytes long, more than a path can be")),
    (["--savedir", " "], r"--savedir must name a directory, got ' '"),
    (["--checkpoint", ""], r"error: --checkpoint is empty \(an unset shell variable\?\); pass a path, or leave"),
    (["--mode", "plot", "--plot_out", ""], r"error: --plot_out is empty \(an unset shell variable\?\)"),
    (["--momentum", "1.5"], r"--momentum must be in \[0, 1\), got 1.5"),
    (["--inference_wait_ms", "1e30"], r"--inference_wait_ms must be at most 60,000, got 1e\+30"),
    (["--test_episodes", "99999999999999999999"], r"--test_episodes must be at most 1,000, got 9+"),
    (["--eval_episodes", "1001"], r"--eval_episodes must be at most 1,000, got 1001"),
    (["--envs_per_actor", "100000"], r"--envs_per_actor must be at most 4,096, got 100000: one actor steps"),
    (["--ray_envs_per_actor", "5000"], r"--ray_envs_per_actor must be at most 4,096, got 5000"),
    (["--total_steps", "99999999999999999999"], r"--total_steps must be at most 1,000,000,000,000,000, got 9+$"),
    (["--hidden_size", "200000"], r"--hidden_size must be at most 65,536, got 200000"),
    (["--num_actors", "200000"],  # once 200,000 processes started until the memory ran out
     (r"--num_actors 200000: each actor process holds at least 12 MiB of its own \(2343.8 GiB in all\) where this "
      r"machine has [\d.]+ GiB: lower --num_actors, or pass auto \(one per core\)$")),
    (["--num_actors", "auto", "--batch_size", "200000"],  # auto's batch's worth of actors named a number not given
     (r"--num_actors 100000 \(auto is never fewer than --batch_size 200000 / --envs_per_actor 2\): each actor "
      r"process holds at least 12 MiB of its own \(1171.9 GiB in all\) where this machine has [\d.]+ GiB: lower --batch_size, "
      r"or raise --envs_per_actor$")),
    (["--epochs", "99999999999999999999"], r"--epochs must be at most 1,000, got 9+$"),
    (["--num_learner_threads", "2000"],  # once slow to start, and its threads outlived the stop
     (r"--num_learner_threads must be at most 64, got 2000: the updates take turns, and more threads only hold "
      r"more batches$")),
    (["--minibatches", "1", "--unroll_length", "1", "--batch_size", "1"],  # none fewer to use
     r"1 x 1 steps cut into 1 minibatches leave with 1 step; use a longer --unroll_length or a larger --batch_size"),
    (["--advantage_norm", "batch", "--unroll_length", "1", "--batch_size", "1"],  # once advised fewer --minibatches
     (r"PPO normalises its advantages over each batch, which 1 x 1 steps leave with 1 step; use a longer "
      r"--unroll_length or a larger --batch_size$")),
    # Each once a run that started, skipped --max_bad_updates non-finite updates and stopped, or killed its actors
    # or itself at their first step:
    (["--learning_rate", "3e4"], r"--learning_rate must be at most 1, got 30000.0"),
    (["--epsilon", "1e30"], r"--epsilon must be at most 1, got 1e\+30"),
    (["--entropy_cost", "1e30"], r"--entropy_cost must be at most 1,000, got 1e\+30"),
    (["--baseline_cost", "5000"], r"--baseline_cost must be at most 1,000, got 5000.0"),
    (["--actor_timeout_s", "1e-9"], r"--actor_timeout_s must be 0 \(never\) or at least 1 s, got 1e-09"),
    (["--learner_timeout_s", "0.5"], r"--learner_timeout_s must be 0 \(never\) or at least 1 s, got 0.5"),
])
def test_bad_flags(capsys: pytest.CaptureFixture, tmp_path: Path, flags: list[str], pattern: str) -> None:
    _fails_with(capsys, [*QUICK, "--savedir", str(tmp_path), *flags], pattern)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_a_savedir_that_is_not_utf8_is_refused_before_anything_is_written(capsys: pytest.CaptureFixture,
                                                                            tmp_path: Path) -> None:
    savedir = tmp_path / "runs\udcff"  # a shell's argument of bytes that are not UTF-8, as Python hands it over
    _fails_with(capsys, [*QUICK, "--savedir", str(savedir)], r"--savedir b'.*/runs\\xff' is not UTF-8 text$")
    assert list(tmp_path.iterdir()) == []  # once flags.json and meta.json, then a UnicodeEncodeError's traceback


@pytest.mark.parametrize(("variables", "pattern"), [
    ({"LOCAL_WORLD_SIZE": "abc"}, r"variable LOCAL_WORLD_SIZE must be a whole number \(torchrun sets it\), got 'abc'"),
    ({"RANK": "0", "WORLD_SIZE": "two", "LOCAL_RANK": "0"}, r"the environment variable WORLD_SIZE must be a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0.5"}, r"the environment variable LOCAL_RANK must be a whole number"),
    ({"RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, r"not one torchrun sets: RANK 3 of WORLD_SIZE 2 \(0 <= RANK"),
    ({"RANK": "0", "WORLD_SIZE": "0", "LOCAL_RANK": "0"}, r"not one torchrun sets: RANK 0 of WORLD_SIZE 0"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "-1"}, r"LOCAL_RANK -1 of LOCAL_WORLD_SIZE 1"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, r"no MASTER_ADDR; launch with torchrun, or unset RANK, WORLD_"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "abc"},
     r"MASTER_PORT 'abc' \(a port number\)"),
], ids=["local world size", "world size", "local rank", "rank past the world", "no world", "negative local rank",
        "no master address", "a port that is no number"])
def test_a_torchrun_variable_that_is_no_number_is_one_line(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, variables: dict[str, str],
                                                          pattern: str) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # as a shell may have them
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():  # once a ValueError's traceback from int()
        monkeypatch.setenv(name, value)
    _fails_with(capsys, [*QUICK, "--num_actors", "auto", "--savedir", str(tmp_path), "--xpid", "env"], pattern,
                prefix="run.py: error")  # " (rank 3): " where the rank can be read
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("content", "pattern"), [
    (b"\xff\xfe\n", r"cannot read the file .*latest \('utf-8' codec can't decode"),
    (b"\0" * 8, r"the file .*latest is damaged \(it holds '\\x00.*', no run's name\); pass the run's name"),
    (b"../elsewhere\n", r"the file .*latest is damaged \(it holds '../elsewhere', no run's name\)"),
    (b"gone\n", r"the file .*latest names the run 'gone', which is not in .*runs \(moved or deleted\?\); pass a run's"),
], ids=["not text", "zeros", "outside", "a run moved away"])
@pytest.mark.parametrize("mode", ["train", "test", "plot"])
def test_a_damaged_latest_file_is_one_line(capsys: pytest.CaptureFixture, tmp_path: Path, content: bytes,
                                           pattern: str, mode: str) -> None:
    """What a power cut can leave in SAVEDIR/latest, or a hand, or a run moved away: never a traceback, never a run
    outside SAVEDIR, and no new run under the name it holds."""
    _saved_run(tmp_path, "elsewhere")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "latest").write_bytes(content)
    _fails_with(capsys, [*QUICK, "--mode", mode, "--savedir", str(tmp_path / "runs"), "--xpid", "latest"], pattern)
    assert [path.name for path in (tmp_path / "runs").iterdir()] == ["latest"]  # no run made, of any name


def test_unwritable_savedir(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    _fails_with(capsys, [*QUICK, "--savedir", str(a_file / "runs"), "--xpid", "x"],
                r"cannot make the run directory .*a_file/runs/x: .*a_file is not a directory; choose another --savedir")
    _fails_with(capsys, [*QUICK, "--savedir", str(a_file), "--xpid", "x"],
                r"cannot make the run directory .*a_file/x: .*a_file is not a directory; choose another --savedir")


def _refused_compile(capsys: pytest.CaptureFixture, tmp_path: Path, pattern: str) -> None:
    """--compile refused in one line, for a new run and for a saved one, which is left as it was."""
    saved = _saved_run(tmp_path / "runs", "saved")
    before = _snapshot(saved)
    for xpid in ("saved", "new"):
        argv = [*QUICK, "--compile", "--disable_cuda", "--savedir", str(tmp_path / "runs"), "--xpid", xpid]
        _fails_with(capsys, argv,
                    rf"error: --compile needs {pattern} \(on Debian or Ubuntu: apt install \S+\), or "
                    r"leave out --compile$")
    assert _snapshot(saved) == before and sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["saved"]


def test_compile_without_a_compiler_is_one_line_before_anything_is_written(
        capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    from torch._inductor import config as inductor_config
    # A slim image's compilers: none. (torch's own patch, which monkeypatch's undo would delete from its config.)
    with inductor_config.patch({"cpp.cxx": (str(tmp_path / "no-such-g++"),)}):
        _refused_compile(capsys, tmp_path,
                         r"a C\+\+ compiler, .* none was found \(g\+\+ on PATH, or \$CXX\): install one")
    assert inductor_config.cpp.cxx != (str(tmp_path / "no-such-g++"),)


@pytest.mark.usefixtures("cpp_compiler")
def test_compile_without_pythons_headers_is_one_line_before_anything_is_written(
        capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler, but no python3-dev: torch.compile's kernels include Python.h."""
    import sysconfig
    headers = tmp_path / "include"
    headers.mkdir()
    real = sysconfig.get_path
    monkeypatch.setattr(sysconfig, "get_path", lambda name, *args, **kwargs:
                        str(headers) if name == "include" else real(name, *args, **kwargs))
    _refused_compile(capsys, tmp_path,
                     rf"Python's C headers, .* and {re.escape(str(headers))} has no Python.h: install them")


@pytest.mark.parametrize("start", ["path", "best"])
def test_a_run_continued_from_another_checkpoint_keeps_the_model_tar_it_replaces(tmp_path: Path, start: str) -> None:
    """A rewind (--checkpoint best), or a name reused with --checkpoint PATH: the run's own model.tar, at a later
    step, would have been overwritten by the next checkpoint."""
    run_dir = _saved_run(tmp_path, "victim", step=40)
    other = _saved_run(tmp_path, "other", step=20)
    if start == "best":
        shutil.copyfile(other / CHECKPOINT_NAME, run_dir / "model_best.tar")
        state = torch.load(run_dir / "model_best.tar", weights_only=True)
        save_checkpoint(run_dir / "model_best.tar", {**state, "eval_return_mean": 9.0})
    checkpoint = str(other / CHECKPOINT_NAME) if start == "path" else "best"
    before = (run_dir / CHECKPOINT_NAME).read_bytes()
    assert run.main([*QUICK, "--savedir", str(tmp_path), "--xpid", "victim", "--checkpoint", checkpoint,
                     "--optimizer", "rmsprop"]) == 0
    assert (run_dir / "model_replaced_step_40.tar").read_bytes() == before
    assert torch.load(run_dir / CHECKPOINT_NAME, weights_only=True)["step"] == 1000
    # Said while the run was built, before out.log was open: there too, before the start's own lines.
    said = "This run's model.tar (step 40) is replaced from"
    log_text = (run_dir / "out.log").read_text()
    assert said in log_text and log_text.index(said) < log_text.index("Run ended"), log_text


def test_a_rewind_saves_its_start_as_model_tar_before_anything_can_kill_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Killed before its first checkpoint (its logs already cut back to the step it starts from), a rewound run
    must resume from that step next time, not from the later one it was rewound from."""
    run_dir = _saved_run(tmp_path, "victim", step=40)
    other = _saved_run(tmp_path, "other", step=20)
    on_disk = {}

    class Killed(Exception):
        pass

    def killed_once_built(_: object) -> None:  # what a kill -9 just after the build leaves
        on_disk.update(torch.load(run_dir / CHECKPOINT_NAME, weights_only=True))
        raise Killed

    monkeypatch.setattr(training, "_run", killed_once_built)
    with pytest.raises(Killed):
        run.main([*QUICK, "--savedir", str(tmp_path), "--xpid", "victim", "--checkpoint",
                  str(other / CHECKPOINT_NAME), "--optimizer", "rmsprop"])
    assert on_disk["step"] == 20 and on_disk["flags"]["checkpoint"] == str(other / CHECKPOINT_NAME)
    assert torch.load(run_dir / "model_replaced_step_40.tar", weights_only=True)["step"] == 40
    assert json.loads((run_dir / "meta.json").read_text())["checkpoint_step"] == 20


def test_a_console_log_that_cannot_be_written_is_one_line_before_the_run_changes(
        capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    run_dir = _saved_run(tmp_path, "resumed")
    (run_dir / "out.log").mkdir()  # whatever made it, the run's log cannot go there
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    _fails_with(capsys, [*QUICK, "--savedir", str(tmp_path), "--xpid", "resumed"],
                r"cannot write .*resumed/out.log: Is a directory; move it out of the way")
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


def test_a_file_of_the_runs_name_in_savedir_asks_for_another_xpid(capsys: pytest.CaptureFixture,
                                                                  tmp_path: Path) -> None:
    (tmp_path / "returns.png").write_bytes(b"a plot")
    _fails_with(capsys, [*QUICK, "--savedir", str(tmp_path), "--xpid", "returns.png"],
                r"cannot make the run directory .*returns.png: a file of that name is there; choose another --xpid")
    assert (tmp_path / "returns.png").read_bytes() == b"a plot"


def test_test_mode_without_a_checkpoint(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    _fails_with(capsys, ["--mode", "test", "--env", "CartPole-v1", "--savedir", str(tmp_path), "--xpid", "none"],
                r"no checkpoint at .*none/model.tar")
    _fails_with(capsys, ["--mode", "test", "--env", "CartPole-v1"], r"--mode test needs --xpid")


def test_test_mode_plays_the_checkpoints_env_unless_another_is_given(capsys: pytest.CaptureFixture,
                                                                      tmp_path: Path) -> None:
    _saved_run(tmp_path, "cartpole")
    assert run.main(["--mode", "test", "--savedir", str(tmp_path), "--xpid", "cartpole", "--test_episodes", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Playing CartPole-v1, the env of the checkpoint\n") and "Mean return over 2 episodes" in out
    _fails_with(capsys, ["--mode", "test", "--env", "Acrobot-v1", "--savedir", str(tmp_path), "--xpid", "cartpole"],
                r"was trained on 'CartPole-v1', not 'Acrobot-v1'; pass --env CartPole-v1")


def test_test_mode_video_that_has_nowhere_to_go_is_one_line_before_any_game(
        capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    run_dir = _saved_run(tmp_path, "cartpole")
    (run_dir / "test").write_text("notes")  # where test mode's TensorBoard run would go
    argv = ["--mode", "test", "--savedir", str(tmp_path), "--xpid", "cartpole", "--test_episodes", "1", "--video"]
    assert run.main(argv) == 2
    captured = capsys.readouterr()
    assert "Mean return" not in captured.out  # refused before the games, which can take long
    assert captured.err == (f"run.py: error: cannot write the video to TensorBoard in {run_dir}: {run_dir / 'test'} "
                            "is not a writable directory\n")
    assert (run_dir / "test").read_text() == "notes"


def test_test_mode_video_of_a_checkpoint_path_into_a_run_that_does_not_exist_is_one_line(
        capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """--checkpoint PATH with --xpid X writes the video into run X: where X does not exist, test mode would make
    it (holding only another agent's results, which a later training of X would take as its own)."""
    run_dir = _saved_run(tmp_path, "cartpole")
    argv = ["--mode", "test", "--savedir", str(tmp_path), "--xpid", "ghost", "--checkpoint", str(run_dir / "model.tar"),
            "--test_episodes", "1", "--video"]
    assert run.main(argv) == 2
    captured = capsys.readouterr()
    assert "Mean return" not in captured.out
    assert captured.err == (f"run.py: error: --video: there is no run 'ghost' in {tmp_path} to write the video in; "
                            "drop --xpid to write it beside the checkpoint file\n")
    assert not (tmp_path / "ghost").exists()


def test_test_mode_video_of_another_envs_checkpoint_into_a_run_is_one_line_before_any_game(
        capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """--checkpoint PATH of another game's run with --xpid X: its return and video went into X's test/ among the
    points of X's own game, without a word."""
    other = _saved_run(tmp_path, "cartpole")
    run_dir = _saved_run(tmp_path, "acrobot")
    (run_dir / "flags.json").write_text(json.dumps({"env": "Acrobot-v1"}))
    before = sorted(p.name for p in run_dir.iterdir())
    argv = ["--mode", "test", "--savedir", str(tmp_path), "--xpid", "acrobot", "--checkpoint",
            str(other / "model.tar"), "--test_episodes", "1", "--video"]
    assert run.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "Playing CartPole-v1, the env of the checkpoint\n"
    assert captured.err == ("run.py: error: --video: run 'acrobot' trained Acrobot-v1, and this test plays CartPole-v1: "
                            "its return and video would go among that run's; drop --xpid to write them beside the "
                            "checkpoint file\n")
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_test_mode_video_of_a_checkpoint_pruned_once_loaded_goes_beside_where_it_was(
        capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A kept model_step_N.tar of a run still training: --keep_checkpoints may delete it just after test mode
    loaded it. The games are played and the video written all the same, into the run's test/ directory."""
    from impala import evaluate

    run_dir = _saved_run(tmp_path, "cartpole")
    kept = run_dir / "model_step_40.tar"
    os.replace(run_dir / CHECKPOINT_NAME, kept)
    load_agent = evaluate.load_agent

    def load_then_prune(*args: object, **kwargs: object) -> object:
        loaded = load_agent(*args, **kwargs)  # type: ignore[arg-type]
        kept.unlink()
        return loaded

    monkeypatch.setattr(evaluate, "load_agent", load_then_prune)
    assert run.main(["--mode", "test", "--checkpoint", str(kept), "--test_episodes", "1", "--video"]) == 0
    assert "Mean return over 1 episode: " in capsys.readouterr().out
    assert list((run_dir / "test").glob("events.out.tfevents.*"))


def test_test_mode_names_the_file_it_played_and_how_it_chose_actions(
        capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """--checkpoint latest or best picks a file of the run (best may fall back on the kept best of the other
    --eval_actions): the results say which file, at which step, with which actions; a path is named whole."""
    run_dir = _saved_run(tmp_path, "cartpole")
    argv = ["--mode", "test", "--savedir", str(tmp_path), "--xpid", "cartpole", "--test_episodes", "1"]
    assert run.main([*argv, "--eval_actions", "sampled"]) == 0
    assert "; model.tar at step 40, sampled actions)" in capsys.readouterr().out
    assert run.main(["--mode", "test", "--checkpoint", str(run_dir / CHECKPOINT_NAME), "--test_episodes", "1"]) == 0
    assert f"; {run_dir / CHECKPOINT_NAME} at step 40, greedy actions)" in capsys.readouterr().out


def test_test_mode_video_on_a_full_disk_is_one_line_after_the_results(
        capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tensorboard.compat.tensorflow_stub.io import gfile

    def full_disk(self: object, filename: str, content: bytes, mode: str) -> None:
        open(filename, mode).close()  # the file is made, its content is not written
        raise OSError(errno.ENOSPC, "No space left on device")

    run_dir = _saved_run(tmp_path, "cartpole")
    before = _snapshot(run_dir)
    monkeypatch.setattr(gfile.LocalFileSystem, "_write", full_disk)
    argv = ["--mode", "test", "--savedir", str(tmp_path), "--xpid", "cartpole", "--test_episodes", "2", "--video"]
    assert run.main(argv) == 2
    captured = capsys.readouterr()
    assert "Mean return over 2 episodes" in captured.out  # the games' results came first
    assert captured.err == f"run.py: error: cannot write the video to TensorBoard in {run_dir}: No space left on device\n"
    assert _snapshot(run_dir) == before  # no event file begun and left empty


@pytest.mark.parametrize("ended", [0, 2])
def test_ctrl_c_in_test_mode_prints_the_games_that_had_ended_and_exits_130(
        capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ended: int) -> None:
    import impala.evaluate

    def interrupted(*args: object, **kwargs: object) -> None:
        raise impala.evaluate.PlayInterrupted(impala.evaluate.Games([3.0, 5.0][:ended], [3, 5][:ended],
                                                                    [False, True][:ended]))

    run_dir = _saved_run(tmp_path, "cartpole")
    before = _snapshot(run_dir)
    monkeypatch.setattr(impala.evaluate, "play", interrupted)
    argv = ["--mode", "test", "--savedir", str(tmp_path), "--xpid", "cartpole", "--test_episodes", "4", "--video"]
    assert run.main(argv) == 130
    captured = capsys.readouterr()
    lines = captured.out.splitlines()[1:]  # after "Playing CartPole-v1, ..."
    assert lines[0] == f"Stopped by Ctrl-C with {ended} of 4 games ended"
    if ended:
        assert lines[1:] == ["Mean return over 2 episodes: 4.00 (min 3.00, max 5.00; model.tar at step 40, greedy actions)",
                             "Games lasted 3-5 agent steps (mean 4); 1 of 2 cut by the time limit"]
    else:
        assert lines[1:] == []
    assert captured.err == ""
    assert _snapshot(run_dir) == before  # no video of a game cut short


def test_resume_without_a_checkpoint(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    _fails_with(capsys, [*QUICK, "--savedir", str(tmp_path), "--xpid", "new", "--resume"],
                r"--resume: no checkpoint at")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
@pytest.mark.parametrize("mode", ["train", "test"])
def test_damaged_checkpoint(capsys: pytest.CaptureFixture, tmp_path: Path, damage: str, mode: str) -> None:
    run_dir = _saved_run(tmp_path, "damaged")
    path = run_dir / CHECKPOINT_NAME
    data = path.read_bytes()
    path.write_bytes(os.urandom(len(data)) if damage == "garbage" else data[: len(data) // 2])
    before = _snapshot(run_dir)
    _fails_with(capsys, [*QUICK, "--mode", mode, "--savedir", str(tmp_path), "--xpid", "damaged"],
                r"is not a readable checkpoint")
    assert _snapshot(run_dir) == before


def test_existing_run_with_another_env_is_refused_before_anything_is_overwritten(
        capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    run_dir = _saved_run(tmp_path, "cartpole")
    before = _snapshot(run_dir)
    argv = [*QUICK, "--env", "Acrobot-v1", "--savedir", str(tmp_path), "--xpid", "cartpole"]
    _fails_with(capsys, argv, r"does not fit this run: env 'CartPole-v1' vs 'Acrobot-v1'")
    _fails_with(capsys, [*QUICK, "--hidden_size", "64", "--savedir", str(tmp_path), "--xpid", "cartpole"],
                r"hidden_size 32 vs 64")
    assert _snapshot(run_dir) == before  # flags.json, meta.json and the checkpoint untouched


def _unsaved_run(savedir: Path, xpid: str, env: str = "CartPole-v1") -> Path:
    """The files a run killed before its first checkpoint leaves: flags, meta, a CSV row past step 0."""
    run_dir = _saved_run(savedir, xpid)
    (run_dir / CHECKPOINT_NAME).unlink()
    (run_dir / "flags.json").write_text(json.dumps({"env": env, "hidden_size": 32}))
    (run_dir / "logs.csv").write_text("step,charts/SPS\n0,1.0\n360,123456.0\n")
    return run_dir


def test_a_run_killed_before_its_first_checkpoint_starts_again_keeping_its_starts(tmp_path: Path) -> None:
    run_dir = _unsaved_run(tmp_path, "killed")
    assert run.main([*QUICK, "--savedir", str(tmp_path), "--xpid", "killed"]) == 0
    assert json.loads((run_dir / "meta.json").read_text())["starts"][0] == "before"  # and this start after it
    assert len(json.loads((run_dir / "meta.json").read_text())["starts"]) == 2
    with open(run_dir / "logs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and not {"1.0", "123456.0"} & {row["charts/SPS"] for row in rows}  # the killed session's rows dropped
    assert torch.load(run_dir / CHECKPOINT_NAME, weights_only=True)["step"] == 1000


@pytest.mark.parametrize(("damage", "pattern"), [
    ("kept copy", r"has no model.tar but keeps model_step_40.tar: pass --checkpoint .*model_step_40.tar to continue"),
    ("another env", r"is a run of Acrobot-v1 \(its flags.json; killed before its first checkpoint\), not of Cart"),
    ("saved before", r"saved a checkpoint at step 20000 \(its meta.json\) but has no model.tar: restore it, pass "),
    ("a directory", r"model.tar is not a checkpoint file \(a directory, or a link to nothing\): restore it"),
    ("a broken link", r"model.tar is not a checkpoint file \(a directory, or a link to nothing\): restore it"),
], ids=["kept copy", "another env", "saved before", "a directory", "a broken link"])
def test_a_run_without_model_tar_is_not_started_over_where_that_loses_what_it_saved(
        capsys: pytest.CaptureFixture, tmp_path: Path, damage: str, pattern: str) -> None:
    run_dir = _unsaved_run(tmp_path, "moved", env="Acrobot-v1" if damage == "another env" else "CartPole-v1")
    if damage == "kept copy":  # model.tar moved away, its --keep_checkpoints copy left: the next run would prune it
        save_checkpoint(run_dir / "model_step_40.tar", torch.load(_saved_run(tmp_path, "source") / CHECKPOINT_NAME,
                                                                   weights_only=True))
    elif damage == "saved before":  # a finished run whose model.tar was deleted: its logs go to step 20,000
        (run_dir / "meta.json").write_text(json.dumps({"starts": ["before"], "checkpoint_step": 20_000,
                                                       "end_reason": "finished", "final_step": 20_000}))
    elif damage == "a directory":
        (run_dir / CHECKPOINT_NAME).mkdir()
    elif damage == "a broken link":  # the checkpoint moved to another disk
        (run_dir / CHECKPOINT_NAME).symlink_to(tmp_path / "elsewhere" / CHECKPOINT_NAME)
    before = {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.is_file()}
    _fails_with(capsys, [*QUICK, "--savedir", str(tmp_path), "--xpid", "moved"], pattern)
    assert {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.is_file()} == before
    assert os.path.lexists(run_dir / CHECKPOINT_NAME) == (damage in ("a directory", "a broken link"))


@pytest.mark.parametrize(("damage", "pattern"), [
    ("another model's moments", r"RMSprop: its square_avg of parameter 0 is \(32, 6\), the parameter \(32, 4\)"),
    ("no state_dict", r"does not fit this run's RMSprop: its optimiser state is not a state_dict"),
    ("a counter", r"has a counter that is not a whole number: invalid literal for int\(\)"),
], ids=["another model's moments", "no state_dict", "a counter"])
def test_a_checkpoint_whose_optimiser_state_or_counters_do_not_fit_is_one_line(
        capsys: pytest.CaptureFixture, tmp_path: Path, damage: str, pattern: str) -> None:
    """An optimiser state taken from another model's checkpoint loads without a word in torch, and a fused step over
    its mis-sized moments corrupts the heap."""
    run_dir = _saved_run(tmp_path, "mixed")
    state = torch.load(run_dir / CHECKPOINT_NAME, weights_only=True)
    if damage == "another model's moments":  # Acrobot's first layer takes 6 inputs, CartPole's 4
        acrobot = Net((6,), 3, "mlp", False, 32)
        optimizer = torch.optim.RMSprop(acrobot.parameters())
        sum(p.sum() for p in acrobot.parameters()).backward()
        optimizer.step()
        state["optimizer_state_dict"] = optimizer.state_dict()
    elif damage == "no state_dict":
        state["optimizer_state_dict"] = None
    else:
        state["updates"] = "x"
    save_checkpoint(run_dir / CHECKPOINT_NAME, state)
    before = _snapshot(run_dir)
    _fails_with(capsys, [*QUICK, "--optimizer", "rmsprop", "--savedir", str(tmp_path), "--xpid", "mixed"], pattern)
    assert _snapshot(run_dir) == before


def test_a_net_too_big_for_the_machines_memory_is_one_line_before_anything_is_allocated(
        capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An MLP's weights grow as --hidden_size squared: 20,000 on CartPole is 400M weights, 6.0 GiB in four copies."""
    monkeypatch.setattr(buffers, "physical_memory_bytes", lambda: 4 * 2**30)  # a machine of 4 GiB
    monkeypatch.setattr(buffers, "memory_limit", lambda: None)
    _fails_with(capsys, [*QUICK, "--hidden_size", "20000", "--savedir", str(tmp_path), "--xpid", "big"],
                r"the mlp net has 400,180,003 weights, and training holds at least 4 float32 copies of them "
                r"\(6.0 GiB\) where this machine has 4.0 GiB: lower --hidden_size")
    assert not (tmp_path / "big").exists()


def test_what_a_cgroup_memory_limit_cannot_hold_is_one_line_naming_the_limit(
        capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a container (`docker run --memory`, a Kubernetes limit) the kernel kills a process of the run once the
    limit is passed, however much memory the machine has: the checks of the net, the actors and the rollout buffers
    (shared memory counts against the limit too) hold them to the limit."""
    monkeypatch.setattr(buffers, "physical_memory_bytes", lambda: 64 * 2**30)
    monkeypatch.setattr(buffers, "memory_limit", lambda: 4 * 2**30)
    limit = r"this process's memory limit \(its cgroup's: a container's, a job's\) is 4.0 GiB of the machine's 64.0"
    _fails_with(capsys, [*QUICK, "--hidden_size", "20000", "--savedir", str(tmp_path), "--xpid", "big"],
                r"the mlp net has 400,180,003 weights, and training holds at least 4 float32 copies of them "
                rf"\(6.0 GiB\) where {limit}: lower --hidden_size")
    monkeypatch.setattr(buffers, "memory_limit", lambda: 2**28)  # 256 MiB
    limit = limit.replace("4.0 GiB", "0.2 GiB")
    _fails_with(capsys, [*QUICK, "--num_actors", "30", "--savedir", str(tmp_path), "--xpid", "big"],
                rf"--num_actors 30: each actor process holds at least 12 MiB of its own \(0.4 GiB in all\) where "
                rf"{limit}: lower --num_actors, or pass auto \(one per core\)")
    monkeypatch.setattr(buffers, "memory_limit", lambda: 2**26)  # 64 MiB: room for one actor, not the slots
    limit = limit.replace("0.2 GiB", "0.1 GiB")
    _fails_with(capsys, [*QUICK, "--savedir", str(tmp_path), "--xpid", "big"],
                rf"the rollout buffers need 0 MiB of shared memory, 64 MiB with the shared models and queues, "
                rf"where {limit}: lower --num_buffers, --unroll_length or --envs_per_actor")
    assert not (tmp_path / "big").exists()


def test_more_slots_than_an_actors_pipe_holds_are_refused_before_anything_is_written(
        capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Filling a pipe that cannot hold them would block the main process for good, before any actor reads."""
    monkeypatch.setattr(slots, "pipe_records", lambda record_bytes, wanted: 65)  # a system that allows 64 slots
    _fails_with(capsys, [*QUICK, "--num_buffers", "100", "--savedir", str(tmp_path), "--xpid", "many"],
                r"100 slots \(--num_buffers, or what --batch_size asks for\) put up to 100 in one actor's pipe, which "
                r"holds 64 here")
    assert not (tmp_path / "many").exists()
    monkeypatch.setattr(slots, "pipe_records", lambda record_bytes, wanted: 101)
    assert run.main([*QUICK, "--num_buffers", "100", "--savedir", str(tmp_path), "--xpid", "many"]) == 0


def test_a_directory_with_files_of_a_run_but_no_flags_is_not_written_over(
        capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """Not a run this program can continue (no flags.json), and a new run would replace its meta.json and logs."""
    other = tmp_path / "notes"
    other.mkdir()
    (other / "meta.json").write_text('{"author": "someone"}')
    (other / "logs.csv").write_text("step,x\n1,2\n")
    before = _snapshot(other)
    _fails_with(capsys, [*QUICK, "--savedir", str(tmp_path), "--xpid", "notes"],
                r"notes holds meta.json, logs.csv but no flags.json: not a run this program can continue")
    assert _snapshot(other) == before


def test_a_new_run_directory_found_unwritable_is_not_left_behind(
        capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_text = Path.write_text

    def no_inodes(path: Path, text: str, *args: object, **kwargs: object) -> int:
        if path.name.startswith(".write-test-"):  # the probe of a directory just made (a quota, no inodes left)
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        return write_text(path, text, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", no_inodes)
    _fails_with(capsys, [*QUICK, "--savedir", str(tmp_path), "--xpid", "new"],
                r"cannot write the run directory .*new: Disk quota exceeded; choose another --savedir")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("resuming", [False, True])
def test_a_full_disk_is_refused_in_one_line_before_anything_is_changed(
        capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, resuming: bool) -> None:
    run_dir = _saved_run(tmp_path, "full") if resuming else tmp_path / "full"
    before = _snapshot(run_dir) if resuming else {}
    write_text = Path.write_text

    def no_space(path: Path, text: str, *args: object, **kwargs: object) -> int:
        if path.parent == run_dir and text:  # no byte more there (an empty file takes none); elsewhere, space
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_text(path, text, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", no_space)
    _fails_with(capsys, [*QUICK, "--optimizer", "rmsprop", "--savedir", str(tmp_path), "--xpid", "full"],
                rf"cannot write the run files in {run_dir}: No space left on device; free space there or choose")
    if resuming:
        assert _snapshot(run_dir) == before
    else:  # nothing left of a new run
        assert not run_dir.exists()


def test_a_finished_run_is_not_resumed_silently(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    run_dir = _saved_run(tmp_path, "finished", step=1000)
    before = _snapshot(run_dir)
    _fails_with(capsys, [*QUICK, "--savedir", str(tmp_path), "--xpid", "finished"],
                r"already reached step 1000 of --total_steps 1000; pass a larger --total_steps")
    assert _snapshot(run_dir) == before


def test_a_flags_file_is_read_as_the_flags_it_holds_and_a_missing_one_is_one_line(
        capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    flags = tmp_path / "quick.flags"
    flags.write_text(" ".join(QUICK) + "\n--env CartPol-v1  # mistyped\n")
    _fails_with(capsys, [f"@{flags}", "--savedir", str(tmp_path)], r"unknown env id 'CartPol-v1'")
    _fails_with(capsys, [f"@{tmp_path}/absent.flags"], r"flags file .*absent.flags: No such file or directory$")
    assert list(tmp_path.iterdir()) == [flags]


def test_from_the_command_line_no_traceback(tmp_path: Path) -> None:
    """The same through a real `python run.py`: exit code 2 and exactly one line on stderr."""
    for argv in (["--env", "CartPol-v1"], ["--mode", "test", "--env", "CartPole-v1", "--xpid", "nothing-here"]):
        result = run_py(*argv, "--savedir", str(tmp_path))
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("run.py: error: ") and result.stderr.count("\n") == 1, result.stderr
        assert "Traceback" not in result.stdout + result.stderr


def test_an_older_python_is_one_line_before_anything_is_read(tmp_path: Path) -> None:
    """Python 3.10 installs the requirements, then failed at `from datetime import UTC` with a traceback. Here
    `sys.version_info` is made 3.10's before run.py runs; tried for real with Python 3.10.13 too."""
    older = ("import runpy, sys; sys.version_info = (3, 10, 13, 'final', 0); "
             "sys.argv = ['run.py', '--env', 'CartPole-v1', '--savedir', sys.argv[1]]; "
             "runpy.run_path('run.py', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", older, str(tmp_path / "runs")], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60, check=False)
    assert (result.returncode, result.stderr) == (
        2, "run.py: error: impala needs Python 3.11 or later; this is Python 3.10.13\n"), result.stderr
    assert not (tmp_path / "runs").exists()


def test_under_torchrun_another_ranks_error_names_its_rank(capsys: pytest.CaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every rank checks its own flags and env (a module missing on one machine fails there alone): a rank other
    than 0 says which it is, in the same one line."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "9")
    _fails_with(capsys, [*QUICK, "--savedir", str(tmp_path), "--env", "CartPol-v1"], "unknown env id 'CartPol-v1'",
                prefix="run.py: error (rank 9): ")
    monkeypatch.setenv("RANK", "0")
    _fails_with(capsys, [*QUICK, "--savedir", str(tmp_path), "--env", "CartPol-v1"], "unknown env id 'CartPol-v1'")


def test_under_torchrun_another_ranks_failure_names_its_rank(capsys: pytest.CaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose run failed (another rank gone, most often) says which it is: its line comes before or after the
    line of the rank that refused the run, which says why."""
    from impala import training

    def lost(config: object, started_s: object = None) -> None:
        raise training.TrainingError("another learner process ended before the run began")

    monkeypatch.setattr(training, "train", lost)
    for rank, said in (("1", " (rank 1)"), ("0", "")):
        monkeypatch.setenv("LOCAL_RANK", rank)
        monkeypatch.setenv("RANK", rank)
        assert run.main([*QUICK]) == 1
        assert capsys.readouterr().err == (f"run.py: training failed{said}: another learner process ended before "
                                           "the run began\n")
