"""Evaluation while training and the checkpoints kept: the evaluation process plays the games test mode
plays, model_best.tar holds the best evaluation (and a worse one never replaces it, resumed or not), a
killed evaluator is reported and replaced while training goes on, --keep_checkpoints keeps the newest
copies, and --checkpoint picks what test mode and resume load."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import multiprocessing
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import Callable, Iterator
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from process_helpers import (
    IMPALA_RULE,
    REPO_ROOT,
    Training,
    checkpoint_step,
    run_py,
    wait_until_gone,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import impala.actor_pool
import impala.checkpoint
import impala.evaluator
import run
from impala import evaluate
from impala.checkpoint import (
    BEST_CHECKPOINT_NAME,
    CHECKPOINT_NAME,
    best_so_far,
    find_checkpoint,
    keep_step_copy,
    load_checkpoint,
    save_checkpoint,
)
from impala.config import Config, UserError, parse_config
from impala.evaluate import EVAL_SEED_OFFSET, EpisodeRecorder, Games, PlayInterrupted, play, serve_evaluations
from impala.evaluator import Evaluator, check_evaluator, finish_evaluation, replace_evaluator
from impala.learner import LearnerState
from impala.metrics import RunLog
from impala.model import Net
from impala.seeding import SEED_LIMIT, ActorLives, env_seeds

EVAL_TAG = "eval/episodic_return_mean"
CARTPOLE_MAX_RETURN = 500.0  # CartPole-v1 truncates a game at 500 steps: no evaluation can score more


def _net() -> Net:
    torch.manual_seed(0)
    return Net((4,), 2, "mlp", False, 32)


def _state(model: Net, step: int, **extra: object) -> dict:
    return {"model_state_dict": model.state_dict(), "step": step, "flags": {"env": "CartPole-v1", "hidden_size": 32},
            "model": "mlp", "observation_shape": [4], "num_actions": 2, **extra}


# ----------------------------------------------------------------------------------- flags and files


def test_flags_parse_and_are_validated() -> None:
    config = parse_config(["--eval_interval_s", "10", "--eval_episodes", "5", "--eval_actions", "sampled",
                           "--keep_checkpoints", "3", "--checkpoint", "best", "--xpid", "r"])
    assert (config.eval_interval_s, config.eval_episodes, config.eval_actions) == (10.0, 5, "sampled")
    assert (config.keep_checkpoints, config.checkpoint) == (3, "best")
    assert Config().eval_interval_s == 0  # off unless asked for: no CPU spent on it by default
    problems = Config(eval_interval_s=-1, eval_episodes=0, keep_checkpoints=-2).validate()
    assert "--eval_interval_s must be >= 0, got -1" in problems
    assert "--eval_episodes must be >= 1, got 0" in problems
    assert "--keep_checkpoints must be >= 0, got -2" in problems
    assert Config(mode="test", checkpoint="some/model.tar").validate() == []  # a path needs no --xpid
    assert any("--mode test needs --xpid" in p for p in Config(mode="test", checkpoint="best").validate())


def test_keep_step_copy_keeps_the_newest_copies_whole(tmp_path: Path) -> None:
    model = _net()
    path = tmp_path / CHECKPOINT_NAME
    written_ns = time.time_ns()

    def save(step: int) -> None:  # each a second after the last, whatever the file system's clock grain
        nonlocal written_ns
        save_checkpoint(path, _state(model, step))
        written_ns += 1_000_000_000
        os.utime(path, ns=(written_ns, written_ns))  # the copy is a hard link: its time too

    for step in (100, 200, 300):
        save(step)
        removed = keep_step_copy(path, step, keep=2)
    assert [p.name for p in removed] == ["model_step_100.tar"]
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == [CHECKPOINT_NAME, "model_step_200.tar", "model_step_300.tar"]  # no temporary left
    assert load_checkpoint(tmp_path / "model_step_200.tar")["step"] == 200  # the old one, not model.tar's
    # Resumed from an earlier step: its copy is the newest written, whatever the step numbers say.
    save(150)
    assert [p.name for p in keep_step_copy(path, 150, keep=2)] == ["model_step_200.tar"]
    assert keep_step_copy(path, 260, keep=0) == [] and not (tmp_path / "model_step_260.tar").exists()


def test_find_checkpoint_names_what_is_missing(tmp_path: Path) -> None:
    assert find_checkpoint(tmp_path, "latest") == tmp_path / CHECKPOINT_NAME
    with pytest.raises(UserError, match=r"no model_best.tar in .*--eval_interval_s"):
        find_checkpoint(tmp_path, "best")
    with pytest.raises(UserError, match=r"--checkpoint nowhere.tar: no such file"):
        find_checkpoint(tmp_path, "nowhere.tar")
    with pytest.raises(UserError, match=r"--checkpoint /dev/null: not a regular file; pass latest, best or the path"):
        find_checkpoint(tmp_path, "/dev/null")
    save_checkpoint(tmp_path / BEST_CHECKPOINT_NAME, _state(_net(), 40, eval_return_mean=12.5))
    assert find_checkpoint(tmp_path, "best") == tmp_path / BEST_CHECKPOINT_NAME
    assert best_so_far(tmp_path / BEST_CHECKPOINT_NAME) == (12.5, 40)
    # --checkpoint best: the best of the session's --eval_actions; model_best.tar where there is none of those
    save_checkpoint(tmp_path / BEST_CHECKPOINT_NAME, _state(_net(), 40, eval_return_mean=12.5, eval_actions="sampled"))
    assert find_checkpoint(tmp_path, "best", "greedy") == tmp_path / BEST_CHECKPOINT_NAME
    save_checkpoint(tmp_path / "model_best_greedy.tar", _state(_net(), 30, eval_return_mean=20.0, eval_actions="greedy"))
    assert find_checkpoint(tmp_path, "best", "greedy") == tmp_path / "model_best_greedy.tar"
    assert find_checkpoint(tmp_path, "best", "sampled") == tmp_path / BEST_CHECKPOINT_NAME
    (tmp_path / "model_best_greedy.tar").unlink()
    assert best_so_far(tmp_path / "elsewhere" / BEST_CHECKPOINT_NAME) is None
    for score in (None, "abc", float("nan")):  # a damaged file: one line, not a traceback at resume
        save_checkpoint(tmp_path / BEST_CHECKPOINT_NAME, _state(_net(), 40, eval_return_mean=score))
        with pytest.raises(UserError, match=r"model_best.tar records no evaluation score \(eval_return_mean "):
            best_so_far(tmp_path / BEST_CHECKPOINT_NAME)


@pytest.mark.parametrize("mode", ["test", "train"])
def test_a_bad_checkpoint_path_is_one_line_and_exit_2(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                      mode: str) -> None:
    argv = ["--mode", mode, "--env", "CartPole-v1", "--savedir", str(tmp_path), "--xpid", "x",
            "--checkpoint", str(tmp_path / "missing.tar")]
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("run.py: error: --checkpoint ") and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()  # nothing was created


def _renamed_keys(state: dict) -> dict:
    return {**state, "model_state_dict": {f"x.{k}": v for k, v in state["model_state_dict"].items()}}


@pytest.mark.parametrize(("damage", "pattern"), [
    (_renamed_keys, r"hidden_size 32\): Error\(s\) in loading state_dict for Net: Missing key\(s\)"),
    (lambda state: {**state, "flags": {**state["flags"], "hidden_size": 64}},
     r"hidden_size 64\): .*size mismatch for torso.layers.0.weight"),
    (lambda state: {**state, "num_actions": 3}, r"3 actions, hidden_size 32\): .*size mismatch for policy.weight"),
])
def test_test_mode_refuses_weights_that_do_not_fit_the_checkpoints_header_in_one_line(
        capsys: pytest.CaptureFixture, tmp_path: Path, damage: Callable[[dict], dict], pattern: str) -> None:
    path = tmp_path / "damaged.tar"
    save_checkpoint(path, damage(_state(_net(), 40)))
    assert run.main(["--mode", "test", "--checkpoint", str(path), "--test_episodes", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"run.py: error: checkpoint {path} does not fit the Net its own header describes (mlp, "
                          "observations (4,), ") and err.count("\n") == 1, err
    assert re.search(pattern, err), err
    assert err.endswith("; it is damaged or from another version: use another checkpoint\n"), err


@pytest.mark.parametrize("env", [None, "", 3])
def test_a_checkpoint_whose_flags_name_no_env_is_one_line_and_exit_2(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                                     env: object) -> None:
    path = tmp_path / "damaged.tar"
    state = _state(_net(), 40)
    flags = {key: value for key, value in state["flags"].items() if key != "env"}
    save_checkpoint(path, {**state, "flags": flags if env is None else {**flags, "env": env}})
    assert run.main(["--mode", "test", "--savedir", str(tmp_path), "--checkpoint", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"run.py: error: checkpoint {path} is not an impala checkpoint (no env in its flags)\n", err


@pytest.mark.parametrize("mode", ["test", "train"])
@pytest.mark.parametrize("hidden_size", ["abc", 0, 32.0, True])
def test_a_checkpoint_whose_hidden_size_is_not_a_whole_number_is_one_line_and_exit_2(
        capsys: pytest.CaptureFixture, tmp_path: Path, mode: str, hidden_size: object) -> None:
    path = tmp_path / "damaged.tar"
    state = _state(_net(), 40)
    save_checkpoint(path, {**state, "flags": {**state["flags"], "hidden_size": hidden_size}})
    argv = ["--mode", mode, "--env", "CartPole-v1", "--savedir", str(tmp_path), "--xpid", "x", "--checkpoint",
            str(path), "--num_actors", "1", "--envs_per_actor", "2", "--unroll_length", "5", "--batch_size", "4",
            "--hidden_size", "32", "--total_steps", "1000", "--test_episodes", "1"]
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"run.py: error: checkpoint {path} is not an impala checkpoint (its flags' hidden_size "
                   f"{hidden_size!r} is not a whole number >= 1)\n"), err
    assert not (tmp_path / "x").exists()  # nothing was created


def _nan_weights(state: dict) -> dict:
    weights = dict(state["model_state_dict"])
    weights["policy.weight"] = weights["policy.weight"].clone().fill_(math.nan)
    return {**state, "model_state_dict": weights}


@pytest.mark.parametrize("mode", ["test", "train"])
@pytest.mark.parametrize(("damage", "said"), [
    (_nan_weights, "is damaged: its weights policy.weight are not all finite numbers; use another checkpoint"),
    (lambda state: {**state, "num_actions": 0},
     "is not an impala checkpoint (its model has 0 actions and observations (4,))"),
    (lambda state: {**state, "observation_shape": [4, 0]},
     "is not an impala checkpoint (its model has 2 actions and observations (4, 0))"),
    (lambda state: {**state, "step": -5}, "is not an impala checkpoint (its step -5 is not a count of agent steps)"),
    (lambda state: {**state, "step": True}, "is not an impala checkpoint (its step True is not a count of agent steps)"),
], ids=["nan weights", "no actions", "empty observations", "negative step", "step True"])
def test_a_checkpoint_whose_model_cannot_act_is_one_line_and_exit_2(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                                    mode: str, damage: Any, said: str) -> None:
    path = tmp_path / "damaged.tar"
    save_checkpoint(path, damage(_state(_net(), 40)))
    argv = ["--mode", mode, "--env", "CartPole-v1", "--savedir", str(tmp_path), "--xpid", "x", "--checkpoint",
            str(path), "--num_actors", "1", "--envs_per_actor", "2", "--unroll_length", "5", "--batch_size", "4",
            "--hidden_size", "32", "--total_steps", "1000", "--test_episodes", "1"]
    assert run.main(argv) == 2
    assert capsys.readouterr().err == f"run.py: error: checkpoint {path} {said}\n"  # no warning or traceback before
    assert not (tmp_path / "x").exists()  # nothing was created


# ------------------------------------------------------------------------------ the evaluation itself


def test_the_evaluator_plays_the_games_test_mode_plays() -> None:
    """One loop for both: an evaluation answers with exactly `play`'s returns for its seed."""
    model, config = _net(), Config(env="CartPole-v1", eval_episodes=3, seed=7)
    main_end, process_end = Pipe()
    heartbeat = _CountingHeartbeat()
    server = threading.Thread(target=serve_evaluations, args=(model, config, process_end, heartbeat))
    server.start()
    main_end.send((2, 1234, 6))  # evaluation 2, after two of 3 games: its seeds from the run's seventh
    number, step, games, cpu_s = main_end.recv()
    main_end.close()  # end-of-file ends the loop
    server.join(timeout=30)
    assert not server.is_alive()
    assert (number, step) == (2, 1234)
    assert games == play(model, "CartPole-v1", 3, 7 + EVAL_SEED_OFFSET + 6, greedy=True)
    assert len(games.returns) == 3 and all(r >= 1 for r in games.returns) and cpu_s > 0
    # It beat once on taking the request and once per agent step: the games run side by side, the longest last.
    assert heartbeat.beats == 1 + max(games.lengths)


@pytest.mark.parametrize("seed", [7, SEED_LIMIT - 100])
def test_test_mode_and_evaluations_play_none_of_the_games_a_long_runs_actors_were_seeded_with(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, seed: int) -> None:
    """Actors take env seeds in turn from --seed: a run of weeks with restarts takes millions. Test mode's games and
    the evaluations' (tens of thousands) come from ranges of their own, also where the seeds wrap at 2^31."""
    path = tmp_path / "model.tar"
    save_checkpoint(path, _state(_net(), 40))
    tested: list[int] = []

    def recording_play(model: Net, env_id: str, episodes: int, first_seed: int, **kwargs: object) -> Games:
        tested.extend(env_seeds(first_seed, episodes))
        return play(model, env_id, episodes, first_seed, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(evaluate, "play", recording_play)
    evaluate.test(Config(mode="test", env="CartPole-v1", checkpoint=str(path), test_episodes=2, seed=seed))
    evaluated = env_seeds(seed + EVAL_SEED_OFFSET, 100_000)
    actor_seeds = 10**7

    def after_the_actors(seeds: tuple[int, ...] | list[int]) -> bool:
        return all((s - seed) % SEED_LIMIT >= actor_seeds for s in seeds)

    assert len(tested) == 2 and after_the_actors(tested) and after_the_actors(evaluated)
    assert not set(tested) & set(evaluated)


class _CountingHeartbeat:
    """A stand-in for the shared double the evaluator beats: counts the beats."""

    def __init__(self) -> None:
        self.beats, self._value = 0, 0.0

    @property
    def value(self) -> float:
        return self._value

    @value.setter
    def value(self, now: float) -> None:
        self.beats, self._value = self.beats + 1, now


def test_play_reports_each_games_length_and_whether_a_time_limit_cut_it() -> None:
    """An untrained policy drops CartPole's pole long before the 500-step limit; the same env cut at 5 steps
    (the pole cannot fall that soon) ends every game at the limit. A CartPole step is worth 1."""
    model = _net()
    games = play(model, "CartPole-v1", 4, 3)
    assert games.lengths == [int(r) for r in games.returns] and all(0 < n < 500 for n in games.lengths)
    assert games.cut == [False] * 4
    if "TestEvalCartPoleLimit5-v1" not in gym.registry:
        gym.register("TestEvalCartPoleLimit5-v1", entry_point="gymnasium.envs.classic_control.cartpole:CartPoleEnv",
                     max_episode_steps=5)
    games = play(model, "TestEvalCartPoleLimit5-v1", 3, 3)
    assert (games.returns, games.lengths, games.cut) == ([5.0] * 3, [5] * 3, [True] * 3)
    assert games.summary() == "Games lasted 5-5 agent steps (mean 5); 3 of 3 cut by the time limit"


def test_games_of_an_env_that_never_ends_are_cut_at_eval_max_steps_in_evaluations_and_test_mode(
        capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """An env without a time limit of its own and a policy that never ends a game once stalled every evaluation
    and test mode for good; its games are now cut at --eval_max_steps, as a time limit cuts them."""
    import odd_spaces_env  # noqa: F401  (registers Endless-v0: no end, no time limit)

    model = Net((1,), 2, "mlp", False, 16)
    games = play(model, "Endless-v0", 3, 0, max_steps=40)
    assert (games.lengths, games.cut) == ([40] * 3, [True] * 3)
    config = Config(env="Endless-v0", eval_episodes=2, eval_max_steps=25, seed=0)
    main_end, process_end = Pipe()
    server = threading.Thread(target=serve_evaluations, args=(model, config, process_end))
    server.start()
    main_end.send((0, 100, 0))
    _, _, games, _ = main_end.recv()
    main_end.close()
    server.join(timeout=30)
    assert (games.lengths, games.cut) == ([25] * 2, [True] * 2)
    save_checkpoint(tmp_path / "endless.tar", {**_state(model, 100), "flags": {"env": "Endless-v0", "hidden_size": 16},
                                               "observation_shape": [1]})
    argv = ["--mode", "test", "--env", "Endless-v0", "--checkpoint", str(tmp_path / "endless.tar"),
            "--test_episodes", "2", "--eval_max_steps", "30", "--hidden_size", "16"]
    assert run.main(argv) == 0
    assert "Games lasted 30-30 agent steps (mean 30); 2 of 2 cut by the time limit" in capsys.readouterr().out


def test_ctrl_c_while_playing_hands_over_the_games_that_had_ended() -> None:
    model = _net()
    whole = play(model, "CartPole-v1", 4, 3)
    stop_at = sorted(whole.lengths)[1] + 1  # two games have ended by then, at least one has not

    def ctrl_c(obs: np.ndarray, game_over: np.ndarray) -> None:
        nonlocal steps
        steps += 1
        if steps == stop_at:
            raise KeyboardInterrupt

    steps = 0
    with pytest.raises(PlayInterrupted) as stopped:
        play(model, "CartPole-v1", 4, 3, on_step=ctrl_c)
    ended = [i for i, n in enumerate(whole.lengths) if n < stop_at]
    assert 2 <= len(ended) < 4
    assert stopped.value.games == Games([whole.returns[i] for i in ended], [whole.lengths[i] for i in ended],
                                        [whole.cut[i] for i in ended])


def test_the_evaluator_follows_fire_on_life_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """--no-fire_on_life_loss reaches the evaluation's envs, as it reaches the actors' and test mode's."""
    import impala.evaluate

    built: list[bool] = []

    class RecordingEnvBatch(impala.evaluate.EnvBatch):
        def __init__(self, *args: object, fire_on_life_loss: bool = True, **kwargs: object) -> None:
            built.append(fire_on_life_loss)
            super().__init__(*args, fire_on_life_loss=fire_on_life_loss, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(impala.evaluate, "EnvBatch", RecordingEnvBatch)
    main_end, process_end = Pipe()
    config = Config(env="CartPole-v1", eval_episodes=1, fire_on_life_loss=False)
    server = threading.Thread(target=serve_evaluations, args=(_net(), config, process_end))
    server.start()
    main_end.send((0, 0, 0))
    main_end.recv()
    main_end.close()
    server.join(timeout=30)
    assert built == [False]


def test_an_evaluators_heartbeat_goes_on_while_its_envs_are_made_and_stops_with_a_game_that_hangs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Hundreds of envs made and reset at the lowest priority can outlast --actor_timeout_s: the evaluator beats
    until their first step. From then on only steps beat, so a game that hangs is still found."""
    beats: list[float] = []

    class Heartbeat:  # the shared double, each value set kept
        value = property(lambda self: beats[-1], lambda self, value: beats.append(value))

    def slow_to_start(model: object, env_id: str, episodes: int, seed: int, on_step: Callable[..., None],
                      **kwargs: object) -> Games:
        time.sleep(0.3)  # making and resetting the envs
        on_step(None, None)
        count = len(beats)
        time.sleep(0.3)  # a step that hangs
        assert len(beats) <= count + 1, "beats from the start's thread after the first step"  # one already due
        return _games([1.0, 2.0])

    monkeypatch.setattr(evaluate, "EVAL_START_BEAT_S", 0.05)
    monkeypatch.setattr(evaluate, "play", slow_to_start)
    main_end, process_end = Pipe()
    server = threading.Thread(target=serve_evaluations, args=(_net(), Config(env="CartPole-v1"), process_end, Heartbeat()))
    server.start()
    main_end.send((0, 0, 0))
    assert main_end.recv()[2].returns == [1.0, 2.0]
    main_end.close()
    server.join(timeout=30)
    assert len(beats) >= 4  # the request's, three or more while starting, the first step's


def test_an_evaluators_start_beats_no_longer_than_its_allowance(monkeypatch: pytest.MonkeyPatch) -> None:
    """A start that hangs (an env that never resets) must still be found by the watch: the start's beats end after
    EVAL_START_ALLOWANCE x --actor_timeout_s."""
    beats: list[float] = []

    class Heartbeat:
        value = property(lambda self: beats[-1], lambda self, value: beats.append(time.monotonic()))

    def hung_start(*args: object, **kwargs: object) -> Games:
        time.sleep(0.8)  # never a first step
        return _games([1.0, 2.0])

    monkeypatch.setattr(evaluate, "EVAL_START_BEAT_S", 0.02)
    monkeypatch.setattr(evaluate, "EVAL_START_ALLOWANCE", 0.2 / 300)  # 0.2 s of the default --actor_timeout_s
    monkeypatch.setattr(evaluate, "play", hung_start)
    main_end, process_end = Pipe()
    server = threading.Thread(target=serve_evaluations, args=(_net(), Config(env="CartPole-v1"), process_end,
                                                              Heartbeat()))
    started = time.monotonic()
    server.start()
    main_end.send((0, 0, 0))
    main_end.recv()
    main_end.close()
    server.join(timeout=30)
    assert len(beats) >= 3 and beats[-1] - started < 0.5  # beats while it may start, none in its last 0.3 s


def test_an_evaluator_whose_main_end_closed_while_it_played_ends_quietly() -> None:
    """An evaluator the main process took for dead (its fork server died) and replaced finds the pipe closed once
    its games are over: it ends, with nothing to report and no traceback."""
    main_end, process_end = Pipe()
    config = Config(env="CartPole-v1", eval_episodes=1)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            serve_evaluations(_net(), config, process_end, heartbeat=types.SimpleNamespace(value=0.0))
        except BaseException as exc:  # noqa: BLE001 - what the test checks for
            errors.append(exc)

    server = threading.Thread(target=serve)
    main_end.send((0, 0, 0))
    main_end.close()  # before the game ends
    server.start()
    server.join(timeout=60)
    assert not server.is_alive() and errors == []


def _fake_run(tmp_path: Path, best: tuple[float, int] | None) -> types.SimpleNamespace:
    model = _net()
    evaluator = Evaluator(_net(), best)
    return types.SimpleNamespace(config=Config(env="CartPole-v1", eval_interval_s=1, hidden_size=32), run_dir=tmp_path,
                                 model=model, runlog=RunLog(tmp_path), evaluator=evaluator, coordinator=None,
                                 resumed_step=None, learners=types.SimpleNamespace(weights_whole=lambda: True))


def _games(returns: list[float], lengths: tuple[int, int] = (120, 80), cut: tuple[bool, bool] = (False, False)
           ) -> Games:
    return Games(returns, list(lengths), list(cut))


def test_only_a_better_evaluation_replaces_the_best(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="impala")
    run_ = _fake_run(tmp_path, best=None)
    with torch.no_grad():  # the learner moved on since the copy the evaluator played with
        for parameter in run_.model.parameters():
            parameter.add_(1.0)
    pending = {"number": 1, "step": 100, "updates": 5, "episodes": 9, "cpu_s": 0.5}
    finish_evaluation(run_, run_.evaluator, pending, _games([20.0, 30.0]))
    saved = load_checkpoint(tmp_path / BEST_CHECKPOINT_NAME)
    assert (saved["step"], saved["eval_return_mean"], saved["eval_return_std"]) == (100, 25.0, 5.0)
    assert saved["eval_returns"] == [20.0, 30.0] and saved["updates"] == 5
    assert "number" not in saved and "cpu_s" not in saved  # the request's own, not counters of the weights
    assert all(torch.equal(v, run_.evaluator.model.state_dict()[k]) for k, v in saved["model_state_dict"].items())
    assert not torch.equal(saved["model_state_dict"]["policy.weight"], run_.model.state_dict()["policy.weight"])
    first = (tmp_path / BEST_CHECKPOINT_NAME).read_bytes()
    for step, returns in ((200, [25.0, 25.0]), (300, [10.0, 12.0])):  # equal, then worse: both kept out
        finish_evaluation(run_, run_.evaluator, {**pending, "step": step}, _games(returns))
    assert (tmp_path / BEST_CHECKPOINT_NAME).read_bytes() == first
    finish_evaluation(run_, run_.evaluator, {**pending, "step": 400}, _games([40.0, 40.0], (500, 500), (True, False)))
    assert load_checkpoint(tmp_path / BEST_CHECKPOINT_NAME)["step"] == 400
    assert run_.evaluator.best == (40.0, 400)
    meta = json.loads((tmp_path / "meta.json").read_text())["best_evaluation"]
    assert (meta["step"], meta["episodic_return_mean"], meta["episodes"]) == (400, 40.0, 2)
    run_.runlog.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars(EVAL_TAG)] == [(100, 25), (200, 25), (300, 11), (400, 40)]
    assert [e.value for e in events.Scalars("eval/episodic_return_std")] == [5, 0, 1, 0]
    assert [e.value for e in events.Scalars("eval/cpu_s")] == [0.5] * 4
    assert [e.value for e in events.Scalars("eval/episode_length_mean")] == [100, 100, 100, 500]
    assert [e.value for e in events.Scalars("eval/games_cut")] == [0, 0, 0, 1]
    assert "Evaluation at step 400: mean return 40.00 (std 0.00, 2 games, 0.50 CPU s). Games lasted 500-500 " \
        "agent steps (mean 500); 1 of 2 cut by the time limit" in caplog.text


@pytest.mark.parametrize("failing", ["meta.json", "the directory's sync"])
def test_a_best_agent_saved_whose_record_failed_is_still_the_best_a_worse_one_must_beat(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, failing: str) -> None:
    """model_best.tar holds the 20 once it is renamed into place, whatever failed after: the 15 that comes next
    must not replace it."""
    run_ = _fake_run(tmp_path, best=(10.0, 100))
    pending = {"number": 2, "step": 200, "updates": 10, "episodes": 9}
    if failing == "meta.json":
        def no_space(*args: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(impala.evaluator, "record_best", no_space)
    else:
        real_fsync = os.fsync

        def failing_fsync(fd: int) -> None:  # the rename's sync, after the file's own
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                raise OSError(errno.EIO, "Input/output error")
            real_fsync(fd)

        monkeypatch.setattr(impala.checkpoint.os, "fsync", failing_fsync)
    with caplog.at_level(logging.ERROR, logger="impala"):
        finish_evaluation(run_, run_.evaluator, pending, _games([20.0, 20.0]))
    assert "Could not" in caplog.text
    assert load_checkpoint(tmp_path / BEST_CHECKPOINT_NAME)["step"] == 200
    monkeypatch.undo()
    finish_evaluation(run_, run_.evaluator, {**pending, "step": 300}, _games([15.0, 15.0]))
    assert run_.evaluator.best == (20.0, 200)
    assert load_checkpoint(tmp_path / BEST_CHECKPOINT_NAME)["step"] == 200
    run_.runlog.close()


def test_an_evaluator_that_keeps_dying_ends_evaluation_not_training(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    run_ = _fake_run(tmp_path, best=None)
    run_.config = Config(env="CartPole-v1", eval_interval_s=1, max_actor_restarts=0)
    dead = types.SimpleNamespace(pid=4321, exitcode=-9, join=lambda timeout=None: None)
    run_.evaluator.process, run_.evaluator.connection = dead, types.SimpleNamespace(close=lambda: None)
    run_.evaluator.pending = {"number": 3, "step": 700}
    replace_evaluator(run_, run_.evaluator)  # with max_actor_restarts 0 the first death is one too many
    assert run_.evaluator.disabled and run_.evaluator.pending is None
    assert "Evaluator (pid 4321) died: killed by SIGKILL; the evaluation of step 700 is lost, training goes on" \
        in caplog.text
    assert "no more evaluations in this run; training goes on" in caplog.text
    logged = caplog.text
    check_evaluator(run_)  # a disabled evaluator is left alone: nothing to poll, nothing started
    assert run_.evaluator.process is dead and run_.evaluator.pending is None and caplog.text == logged
    run_.runlog.close()


def test_an_evaluator_that_dies_in_every_evaluation_however_seldom_ends_evaluation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """One death per --eval_interval_s of 300 s is too seldom for the 10-minute window: counted in a row, with no
    evaluation finished between them, they end evaluation too; one that finishes starts the row again."""
    now = [1000.0]
    monkeypatch.setattr(impala.actor_pool.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(impala.evaluator, "start_evaluator", lambda run: None)
    run_ = _fake_run(tmp_path, best=None)
    run_.config = Config(env="CartPole-v1", eval_interval_s=300, max_actor_restarts=2)
    dead = types.SimpleNamespace(pid=4321, exitcode=1, join=lambda timeout=None: None)
    run_.evaluator.process, run_.evaluator.connection = dead, types.SimpleNamespace(close=lambda: None)
    for death in range(1, 4):
        if death == 2:
            run_.evaluator.finished += 1  # an evaluation came back between the first two deaths
        replace_evaluator(run_, run_.evaluator)
        now[0] += 300
    assert not run_.evaluator.disabled
    replace_evaluator(run_, run_.evaluator)
    assert run_.evaluator.disabled
    assert "The evaluator died 3 times in a row, with no progress in between (--max_actor_restarts 2)" in caplog.text
    run_.runlog.close()


def test_an_evaluator_silent_in_an_evaluation_for_actor_timeout_s_is_killed_and_reported(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A process that sleeps stands for an evaluator whose env is stuck in a step. Waiting for a request is not a
    hang, nor is a silence the monitor was stopped for too (Ctrl-Z); a hang is killed, reported and counted as a
    death (here the last one allowed: no replacement starts)."""
    ctx = multiprocessing.get_context("fork")
    run_ = _fake_run(tmp_path, best=None)
    run_.config = Config(env="CartPole-v1", eval_interval_s=3600, actor_timeout_s=1, max_actor_restarts=0)
    evaluator = run_.evaluator
    stuck = ctx.Process(target=time.sleep, args=(60,))
    stuck.start()
    main_end, process_end = ctx.Pipe()
    evaluator.process, evaluator.connection = stuck, main_end
    evaluator.heartbeat = ctx.Value("d", time.monotonic() - 10, lock=False)
    try:
        check_evaluator(run_)  # silent, but no evaluation asked for
        assert stuck.is_alive() and not evaluator.disabled
        evaluator.pending = {"number": 1, "step": 700}
        evaluator.last_hang_check_s = time.monotonic() - 10  # the monitor itself was stopped for 10 s
        check_evaluator(run_)
        assert stuck.is_alive() and time.monotonic() - evaluator.heartbeat.value < 1  # a new grace period
        evaluator.heartbeat.value = time.monotonic() - 5
        check_evaluator(run_)
        assert not stuck.is_alive() and stuck.exitcode == -signal.SIGKILL
        assert evaluator.disabled and evaluator.pending is None
    finally:
        stuck.kill()
        stuck.join()
        process_end.close()
        run_.runlog.close()
    assert re.search(rf"Evaluator \(pid {stuck.pid}\) made no progress for (?:[5-9]|\d{2,}) s in the evaluation of step 700 "
                     r"\(--actor_timeout_s 1\); killing it", caplog.text)
    assert f"Evaluator (pid {stuck.pid}) died: killed by SIGKILL; the evaluation of step 700 is lost" in caplog.text


def test_the_wait_for_a_request_is_not_held_against_the_evaluation_it_asks_for(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Evaluations further apart than --actor_timeout_s: the evaluator's last beat is from the previous one, and
    asking for the next starts its clock afresh."""
    ctx = multiprocessing.get_context("fork")
    run_ = _fake_run(tmp_path, best=None)
    run_.config = Config(env="CartPole-v1", eval_interval_s=600, actor_timeout_s=300, max_actor_restarts=0)
    model = _net()
    optimizer = torch.optim.Adam(model.parameters())
    state = LearnerState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                         ActorLives(seed=0, session=1, lives=6, env_seeds_used=24), step=900, updates=9, episodes=3,
                         evaluations=4, eval_seeds_used=40)
    run_.update_lock, run_.state = threading.Lock(), state
    evaluator = run_.evaluator
    idle = ctx.Process(target=time.sleep, args=(60,))
    idle.start()
    main_end, process_end = ctx.Pipe()
    evaluator.process, evaluator.connection = idle, main_end
    evaluator.heartbeat = ctx.Value("d", time.monotonic() - 700, lock=False)  # its last evaluation's last step
    evaluator.last_request_s = time.monotonic() - 700
    try:
        check_evaluator(run_)  # due: asks for the next evaluation
        # The run's fifth evaluation (its counts are in the checkpoint), whatever the session: games of its own, from
        # the seeds the earlier ones left, whatever --eval_episodes they had.
        assert evaluator.pending is not None and process_end.recv() == (5, 900, 40)
        assert (run_.state.evaluations, run_.state.eval_seeds_used) == (5, 40 + run_.config.eval_episodes)
        # The counters and lives of the weights copied, for model_best.tar: a resume from it plays lives of its own.
        assert evaluator.pending == {"number": 5, "step": 900, "updates": 9, "skipped_updates": 0, "episodes": 3,
                                     "evaluations": 5, "eval_seeds_used": 40 + run_.config.eval_episodes,
                                     "actor_lives": 6, "env_seeds_used": 24}
        check_evaluator(run_)
        assert idle.is_alive() and "made no progress" not in caplog.text
        # Under torchrun, the lives every rank reached, as a checkpoint keeps them: a resume from model_best.tar
        # must not hand another rank's lives out again.
        run_.coordinator = types.SimpleNamespace(run_wide_lives=lambda counters: {**counters, "actor_lives": 11})
        evaluator.pending, evaluator.last_request_s = None, time.monotonic() - 700
        check_evaluator(run_)
        assert process_end.recv()[0] == 6 and evaluator.pending["actor_lives"] == 11
    finally:
        idle.kill()
        idle.join()
        process_end.close()
        run_.runlog.close()


@contextlib.contextmanager
def _evaluation_due(tmp_path: Path) -> Iterator[tuple[types.SimpleNamespace, Connection]]:
    """A run at step 900 after 4 evaluations, its evaluator an idle process whose next evaluation is due; yields
    the run and the evaluator's end of the pipe, on which a request arrives."""
    ctx = multiprocessing.get_context("fork")
    run_ = _fake_run(tmp_path, best=None)
    model = _net()
    optimizer = torch.optim.Adam(model.parameters())
    run_.state = LearnerState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                              ActorLives(seed=0, session=1), step=900, evaluations=4)
    run_.update_lock = threading.Lock()
    idle = ctx.Process(target=time.sleep, args=(60,))
    idle.start()
    main_end, process_end = ctx.Pipe()
    run_.evaluator.process, run_.evaluator.connection = idle, main_end
    run_.evaluator.last_request_s = time.monotonic() - 10  # due, by --eval_interval_s 1
    try:
        yield run_, process_end
    finally:
        idle.kill()
        idle.join()
        process_end.close()
        run_.runlog.close()


def test_a_resumed_run_asks_for_no_evaluation_before_its_learner_moves_past_the_checkpoints_step(
        tmp_path: Path) -> None:
    """The session that saved the checkpoint may have evaluated its weights and logged it at that step, which a
    resume keeps: the same weights are not evaluated there a second time."""
    with _evaluation_due(tmp_path) as (run_, process_end):
        run_.resumed_step = 900
        check_evaluator(run_)
        assert run_.evaluator.pending is None and not process_end.poll()
        run_.state.step = 920  # the first update of the session
        check_evaluator(run_)
        assert process_end.recv()[:2] == (5, 920)


def test_weights_a_failed_update_may_have_torn_are_not_copied_for_an_evaluation(tmp_path: Path) -> None:
    """A learner whose update raised marks the weights torn under the update lock; an evaluation due before the
    monitor ends the run must not play them, or keep them as model_best.tar."""
    with _evaluation_due(tmp_path) as (run_, process_end):
        with torch.no_grad():
            for parameter in run_.state.model.parameters():
                parameter.fill_(7.0)
        whole = [False]
        run_.learners = types.SimpleNamespace(weights_whole=lambda: whole[0])
        check_evaluator(run_)
        assert run_.evaluator.pending is None and not process_end.poll() and run_.state.evaluations == 4
        assert all(not (parameter == 7.0).all() for parameter in run_.evaluator.model.parameters())
        whole[0] = True  # the same run with its weights whole: the copy and the request go
        check_evaluator(run_)
        assert process_end.recv()[:2] == (5, 900) and run_.state.evaluations == 5
        assert all((parameter == 7.0).all() for parameter in run_.evaluator.model.parameters())


# ---------------------------------------------------------------------------------- whole runs


LEARNING_RUN = ["--env", "CartPole-v1", "--num_actors", "2", "--envs_per_actor", "4", "--unroll_length", "5",
                "--batch_size", "8", "--learning_rate", "0.001", *IMPALA_RULE, "--entropy_cost", "0.01", "--log_interval_s", "1"]


@pytest.mark.slow
def test_a_run_evaluates_keeps_its_best_and_test_mode_plays_it(tmp_path: Path) -> None:
    result = run_py(*LEARNING_RUN, "--total_steps", "60000", "--eval_interval_s", "2", "--eval_episodes", "5",
                    "--keep_checkpoints", "2", "--checkpoint_interval_s", "3", "--savedir", str(tmp_path),
                    "--xpid", "evaluated", timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "evaluated"
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    evaluations = events.Scalars(EVAL_TAG)
    assert len(evaluations) >= 2, "evaluations while training, not only at the end"
    assert all(0 <= e.step <= 60_000 for e in evaluations)  # against the step of the weights played
    assert evaluations[-1].step == 60_000  # the final weights too, once the run reached its total
    assert len(events.Scalars("eval/episodic_return_std")) == len(evaluations)
    lengths = events.Scalars("eval/episode_length_mean")  # CartPole's games: 1 to 500 agent steps
    assert [e.step for e in lengths] == [e.step for e in evaluations] and all(1 <= e.value <= 500 for e in lengths)
    best = max(evaluations, key=lambda e: e.value)
    saved = load_checkpoint(run_dir / BEST_CHECKPOINT_NAME)
    assert saved["eval_return_mean"] == pytest.approx(best.value, rel=1e-6)
    assert saved["step"] == min(e.step for e in evaluations if e.value == best.value)  # the first to reach it
    meta = json.loads((run_dir / "meta.json").read_text())["best_evaluation"]
    assert (meta["step"], meta["episodic_return_mean"]) == (saved["step"], saved["eval_return_mean"])
    with open(run_dir / "logs.csv") as f:
        assert EVAL_TAG in f.readline()  # the CSV has the column too
    copies = sorted(p.name for p in run_dir.glob("model_step_*.tar"))
    assert 1 <= len(copies) <= 2 and "model_step_60000.tar" in copies

    played = run_py("--mode", "test", "--env", "CartPole-v1", "--savedir", str(tmp_path), "--xpid", "evaluated",
                    "--checkpoint", "best", "--test_episodes", "3")
    assert played.returncode == 0, played.stderr
    assert f"model_best.tar at step {saved['step']}, greedy actions; its greedy evaluation while training: " \
        f"{saved['eval_return_mean']:.2f}" in played.stdout


def test_the_final_weights_are_not_evaluated_after_a_stop_or_when_their_step_was(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during the wait for the evaluation in flight skips the final one, and so does a wait past
    FINAL_EVALUATION_MAX_S (an env that hangs with --actor_timeout_s 0); weights evaluated already (the last
    request's step is the final step) are not played twice."""
    import types

    from impala import evaluator as evaluator_module
    from impala.evaluator import Evaluator, evaluate_final_weights

    sent: list[object] = []
    evaluator = Evaluator(model=None, best=None, pending={"number": 4, "step": 900},  # type: ignore[arg-type]
                          process=types.SimpleNamespace(is_alive=lambda: True),
                          connection=types.SimpleNamespace(poll=lambda: False, send=sent.append))
    run_ = types.SimpleNamespace(evaluator=evaluator, state=types.SimpleNamespace(step=1_000), resumed_step=None,
                                 config=Config(actor_timeout_s=0))
    evaluate_final_weights(run_, lambda: True)  # type: ignore[arg-type]
    assert sent == [] and evaluator.pending == {"number": 4, "step": 900}
    monkeypatch.setattr(evaluator_module, "FINAL_EVALUATION_MAX_S", 0.0)
    evaluate_final_weights(run_, lambda: False)  # type: ignore[arg-type]
    assert sent == [] and evaluator.pending == {"number": 4, "step": 900}
    monkeypatch.undo()
    evaluator.pending, evaluator.evaluated_step = None, 1_000
    evaluate_final_weights(run_, lambda: False)  # type: ignore[arg-type]
    assert sent == [] and evaluator.pending is None


def test_a_finished_runs_checkpoint_is_saved_before_its_final_evaluation_and_again_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The final evaluation may play for many minutes (up to FINAL_EVALUATION_MAX_S): a kill meanwhile (the OOM
    killer, a preempted machine) lost the training since the last periodic checkpoint."""
    from impala import training

    saved_then: list[int] = []

    def final_evaluation(run_: Any, stopped: Callable[[], bool]) -> None:
        saved_then.append(load_checkpoint(run_.run_dir / CHECKPOINT_NAME)["step"] if (
            run_.run_dir / CHECKPOINT_NAME).is_file() else -1)
        run_.state.evaluations += 1  # what an evaluation counts, for the save after it

    monkeypatch.setattr(training, "evaluate_final_weights", final_evaluation)
    config = Config(env="CartPole-v1", model="mlp", hidden_size=16, num_actors=1, envs_per_actor=2, unroll_length=5,
                    batch_size=4, total_steps=2_000, eval_interval_s=3600, checkpoint_interval_s=3600,
                    disable_cuda=True, savedir=str(tmp_path), xpid="final")
    run_dir = training.train(config)
    final = load_checkpoint(run_dir / CHECKPOINT_NAME)
    assert saved_then == [final["step"]] and final["step"] >= 2_000  # saved at the final step before it
    assert final["evaluations"] == 1  # and after it


@pytest.mark.slow
def test_a_killed_evaluator_is_reported_and_replaced_and_training_goes_on(tmp_path: Path) -> None:
    """Stopped once the replacement has evaluated: a run of a fixed number of steps could end before that."""
    run_ = Training(tmp_path, "kill-eval", "--eval_interval_s", "1", "--eval_episodes", "2")
    try:
        victim = int(run_.wait_for(r"Evaluator started \(pid (\d+)\)").group(1))
        run_.wait_for(r"Evaluation at step \d+")
        os.kill(victim, signal.SIGKILL)
        died = run_.wait_for(rf"Evaluator \(pid {victim}\) died: killed by SIGKILL; .*training goes on", timeout=15)
        step_at_death = run_.latest_step()
        replacement = run_.wait_for(r"Evaluator started \(pid (\d+)\)", timeout=15, after=died.end())
        assert int(replacement.group(1)) != victim
        assert "Restarted the evaluator" in run_.text()[died.end():]
        run_.wait_for(r"Evaluation at step \d+", after=replacement.end())  # the replacement evaluates
        run_.signal(signal.SIGTERM)
        assert run_.wait(timeout=120) == 143
        assert wait_until_gone(run_.pgid, timeout=30) == []
    finally:
        run_.close()
    assert checkpoint_step(run_.run_dir) > step_at_death  # training went on, and ended in order


@pytest.mark.slow
def test_an_evaluator_whose_game_raises_is_reported_once_with_its_traceback_and_replaced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The evaluator's traceback reaches the console once, with its death, not also from the dying process.

    The run is stopped once the replacement has evaluated: a run of a fixed number of steps could end first (5,000
    steps took one second in a CI run, and its replacement had not finished a game)."""
    import crashing_env

    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT / "tests"))  # for the env's module, in every process of the run
    monkeypatch.setenv("CRASHING_ENV_SEED", str(EVAL_SEED_OFFSET))  # the first game of the run's first evaluation
    run_ = Training(tmp_path, "crash", "--env", crashing_env.ENV, "--eval_interval_s", "1", "--eval_episodes", "2")
    try:
        died = run_.wait_for(r"Evaluator \(pid \d+\) died: exit code 1; the evaluation of step \d+ is lost")
        run_.wait_for(r"New best evaluation")  # none before the death: the first evaluation is the one that died
        run_.signal(signal.SIGTERM)
        assert run_.wait(timeout=60) == 143
    finally:
        run_.close()
    console = run_.text()
    assert "New best evaluation" in console[died.end():]  # the replacement plays the next evaluations' games
    assert len(re.findall(r"Evaluator started", console)) >= 2  # and replaced
    assert console.count(f"RuntimeError: {crashing_env.MESSAGE}") == 1, console
    assert console.count("Traceback (most recent call last)") == 1, console


def test_a_resumed_run_keeps_its_best_and_never_saves_a_worse_one(tmp_path: Path) -> None:
    first = Training(tmp_path, "resumed", "--eval_interval_s", "1", "--eval_episodes", "2", total_steps=10_000)
    try:
        assert first.wait(timeout=120) == 0
    finally:
        first.close()
    best_path = first.run_dir / BEST_CHECKPOINT_NAME
    first_best = load_checkpoint(best_path)
    first_evaluations = load_checkpoint(first.run_dir / CHECKPOINT_NAME)["evaluations"]
    assert first_evaluations >= 1
    assert first_best["evaluations"] >= 1 and first_best["actor_lives"] >= 2  # the two actors' first lives at least
    # Make the recorded best unbeatable, so every evaluation of the resumed run is worse (or equal).
    save_checkpoint(best_path, {**first_best, "eval_return_mean": CARTPOLE_MAX_RETURN})
    before = best_path.read_bytes()

    second = Training(tmp_path, "resumed", "--eval_interval_s", "1", "--eval_episodes", "2")
    try:  # stopped after two evaluations: a resumed run of a fixed number of steps could end before its first
        resumed = second.wait_for(r"Resuming from step").end()
        evaluated = second.wait_for(r"Evaluation at step \d+", after=resumed)
        second.wait_for(r"Evaluation at step \d+", after=evaluated.end())
        second.signal(signal.SIGTERM)
        assert second.wait(timeout=120) == 143
    finally:
        second.close()
    text = second.text().split("Resuming from step")[1]
    assert f"Best evaluation so far: mean return 500.00 at step {first_best['step']}" in text
    assert re.search(r"Evaluation at step \d+: .*; the best is 500.00", text), "the resumed run evaluated"
    assert "New best evaluation" not in text
    assert best_path.read_bytes() == before
    assert checkpoint_step(first.run_dir) > 10_000  # the resumed run trained on, and saved at its stop
    # Its evaluations went on from the first session's count: they played games of their own.
    assert load_checkpoint(first.run_dir / CHECKPOINT_NAME)["evaluations"] >= first_evaluations + 2

    # --checkpoint PATH: a new run that starts from the best agent's weights and step counters.
    branch = Training(tmp_path, "branch", "--checkpoint", str(best_path), total_steps=first_best["step"] + 2_000)
    try:
        assert branch.wait(timeout=120) == 0
    finally:
        branch.close()
    assert f"Resuming from step {first_best['step']}" in branch.text()
    lives = [int(life) for life in re.findall(r"Actor \d+ started \(pid \d+\); life (\d+)", branch.text())]
    assert min(lives) == first_best["actor_lives"], "a new run goes on from the lives of the weights it starts from"

    # --checkpoint best into the run itself, a rewind: its lives and evaluations go on from the highest its model.tar
    # reached, not from those of the best agent's moment, which later sessions had already played.
    reached = load_checkpoint(first.run_dir / CHECKPOINT_NAME)
    assert reached["actor_lives"] > first_best["actor_lives"]
    rewind = Training(tmp_path, "resumed", "--checkpoint", "best", total_steps=first_best["step"] + 2_000)
    try:
        assert rewind.wait(timeout=120) == 0
    finally:
        rewind.close()
    text = rewind.text().split("Resuming from step")[-1]
    lives = [int(life) for life in re.findall(r"Actor \d+ started \(pid \d+\); life (\d+)", text)]
    assert lives and min(lives) == reached["actor_lives"], text
    assert load_checkpoint(first.run_dir / CHECKPOINT_NAME)["evaluations"] >= reached["evaluations"]
    assert f"Resumed from {best_path} (it holds no optimiser state" in branch.text()
    assert checkpoint_step(branch.run_dir) == first_best["step"] + 2_000


def test_an_evaluator_that_cannot_reach_the_main_process_prints_its_traceback_itself() -> None:
    """Its traceback goes to the main process, which shows it with the death; where the pipe is gone (the main
    process is shutting down), the evaluator writes it to stderr itself, once, and exits with 1."""
    script = textwrap.dedent("""
        import os
        from multiprocessing import Pipe
        from impala.config import Config
        from impala.evaluator import _evaluator_process
        from impala.model import Net
        main_end, process_end = Pipe()
        main_end.send((0, 0, 0))  # evaluation 0, of the weights of step 0, its games from the first seed
        main_end.close()  # and no one left to answer to
        config = Config(env="crashing_env:CrashingCartPole-v1", eval_episodes=1, hidden_size=16, num_actors=1)
        _evaluator_process(os.getpid(), config, Net((4,), 2, "mlp", False, 16), process_end, None)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")]),
           "CRASHING_ENV_SEED": str(EVAL_SEED_OFFSET)}  # evaluation 0's first game
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("Traceback") == 1 and "RuntimeError: this env crashes on purpose" in result.stderr


def _recorded(observations: np.ndarray) -> np.ndarray:
    recorder = EpisodeRecorder()
    for t, obs in enumerate(observations):
        recorder.add(obs[None], np.array([t == len(observations) - 1]))
    return recorder.frames()


def test_the_video_of_three_channel_images_is_in_colour_and_of_atari_stacks_their_newest_frame_in_grey() -> None:
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (5, 3, 6, 4), dtype=np.uint8)  # [T, C, H, W] as EnvBatch hands them on
    frames = _recorded(rgb)
    assert frames.shape == (5, 12, 8, 3) and frames.dtype == np.uint8  # each pixel shown 2x2
    np.testing.assert_array_equal(frames[:, ::2, ::2], rgb.transpose(0, 2, 3, 1))
    stacks = rng.integers(0, 256, (5, 4, 6, 4), dtype=np.uint8)
    frames = _recorded(stacks)
    assert frames.shape == (5, 12, 8, 3)
    for channel in range(3):
        np.testing.assert_array_equal(frames[:, ::2, ::2, channel], stacks[:, -1])


def test_the_video_of_a_long_vector_keeps_its_bars_within_a_thousand_pixels() -> None:
    """One bar per dimension up to 341 (2 pixels, 1 between), one per group of neighbouring dimensions beyond:
    a 7,056-vector drew 21,169 pixels wide (116 MiB for 20 frames; 11 GiB at the 2,000-frame cap)."""
    frames = _recorded(np.array([[1.0, -2.0, 0.0, 0.25], [-1.0, 2.0, 0.0, 0.5]]))  # each scaled to its largest
    assert frames.shape == (2, 96, 4 * 32 + 8, 3)  # CartPole's bars as they were: 24 pixels wide, 8 between
    positive, negative, zero_line = (40, 120, 200), (220, 90, 60), (160, 160, 160)
    bar_columns = [8 + 32 * d + 12 for d in range(4)]  # the middle of each bar
    assert [frames[0, 10, x].tolist() for x in bar_columns] == [list(positive), [255] * 3, [255] * 3, [255] * 3]
    assert [frames[0, 85, x].tolist() for x in bar_columns] == [[255] * 3, list(negative), [255] * 3, [255] * 3]
    assert frames[0, 30, bar_columns[3]].tolist() == list(positive)  # half its largest: up to row 26
    assert frames[1, 48, 4].tolist() == list(zero_line) and frames[1, 85, bar_columns[0]].tolist() == list(negative)
    assert frames[1, 10, bar_columns[3]].tolist() == list(positive)
    assert _recorded(np.eye(341)[[3, 7]]).shape == (2, 96, 341 * 3 + 1, 3)  # the most that fit, one each
    one_hot = np.eye(500)[[3, 7]]  # Taxi's squares: 250 bars of 2 squares, 3 pixels wide, 1 between
    frames = _recorded(one_hot)
    assert frames.shape == (2, 96, 250 * 4 + 1, 3)
    blue = (frames[:, 40] == positive).all(axis=-1)  # a row above the zero line
    assert [sorted(set(np.flatnonzero(row) // 4)) for row in blue] == [[3 // 2], [7 // 2]]  # the hot square kept
    long = np.zeros((3, 100_000), np.float32)
    long[0, 99_999], long[1, 5] = -1.0, 3.0  # in the last bar and the first: 341 bars of 294 dimensions each
    frames = _recorded(long)
    assert frames.shape == (3, 96, 1024, 3) and frames.nbytes == 3 * 96 * 1024 * 3
    assert (frames[0, 80, -3:-1] == negative).all() and (frames[1, 10, 1:3] == positive).all()


def test_the_video_of_2d_observations_is_a_grey_image_of_bounded_size() -> None:
    """A [H, W] observation (a grey frame without a channel axis) was drawn as H * W bars: 84 x 84 took 116 MiB for
    20 frames (21,169 pixels wide) and an out-of-memory kill at the 2,000-frame cap; now it is an image, twice
    its size, and a large one is subsampled to fit VIDEO_MAX_SIDE pixels."""
    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, (20, 84, 84), dtype=np.uint8)
    frames = _recorded(grey)
    assert frames.shape == (20, 168, 168, 3) and frames.dtype == np.uint8
    assert frames.nbytes == 20 * 168 * 168 * 3  # 1.7 MB
    for channel in range(3):
        np.testing.assert_array_equal(frames[:, ::2, ::2, channel], grey)
        np.testing.assert_array_equal(frames[:, 1::2, 1::2, channel], grey)
    levels = np.linspace(-1.0, 3.0, 2 * 6 * 5, dtype=np.float32).reshape(2, 6, 5)  # not uint8: spread over 0..255
    frames = _recorded(levels)
    assert frames.shape == (2, 12, 10, 3)
    np.testing.assert_allclose(frames[:, ::2, ::2, 1], (levels + 1) * 255 / 4, atol=1)
    large = rng.integers(0, 256, (2, 1200, 900), dtype=np.uint8)
    frames = _recorded(large)
    assert frames.shape == (2, 400, 300, 3)  # every third pixel: within VIDEO_MAX_SIDE, 512
    np.testing.assert_array_equal(frames[..., 0], large[:, ::3, ::3])
    assert _recorded(np.ones((2, 1, 6), np.float32)).shape == (2, 96, 6 * 32 + 8, 3)  # one row: a vector's bars


def _run_with_evaluations(run_dir: Path, step: int, evaluations: dict[int, float]) -> None:
    """A run dir as training leaves it: a checkpoint at `step` and its evaluations while training."""
    run_dir.mkdir(parents=True)
    save_checkpoint(run_dir / CHECKPOINT_NAME, _state(_net(), step))
    runlog = RunLog(run_dir)
    for at, value in evaluations.items():
        runlog.scalar("charts/episodic_return", value / 2, at)
        runlog.scalars(at, {EVAL_TAG: value})
    runlog.close()


def _events(log_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events


def test_test_modes_video_and_return_stay_apart_from_trainings_evaluations_and_survive_a_resume(
        capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """Test mode's --video wrote eval/episodic_return_mean and eval/video into the run's own event files at the
    checkpoint's step: a second point at one step of the evaluations' curve (and `--mode plot` drew it as one), and
    a resume from that checkpoint purged both. Now they are test/... tags in RUN_DIR/test."""
    import impala.plotting

    run_dir = tmp_path / "b"
    _run_with_evaluations(run_dir, 300, {200: 10.0, 300: 12.0})
    argv = ["--mode", "test", "--env", "CartPole-v1", "--savedir", str(tmp_path), "--xpid", "b", "--test_episodes",
            "2", "--video", "--hidden_size", "32"]
    assert run.main(argv) == 0

    def training_series() -> list[tuple[int, float]]:
        events = _events(run_dir)
        assert not events.Tags()["images"] and not [t for t in events.Tags()["scalars"] if t.startswith("test/")]
        return [(e.step, e.value) for e in events.Scalars(EVAL_TAG)]

    assert training_series() == [(200, 10.0), (300, 12.0)]  # no second point at step 300
    drawn = impala.plotting.load_curve(tmp_path, "b").evaluation  # what --mode plot draws as evaluations
    assert drawn is not None and (drawn.steps.tolist(), drawn.values.tolist()) == ([200, 300], [10.0, 12.0])
    out = capsys.readouterr().out
    test_dir = run_dir / "test"
    assert f"to TensorBoard in {test_dir} (IMAGES tab, test/video)" in out
    played = re.search(r"Mean return over 2 episodes: ([\d.]+)", out)
    assert played is not None, out
    # A resume from the checkpoint: its purge drops the run's events after step 300, and it evaluates again later.
    runlog = RunLog(run_dir, purge_step=301)
    runlog.scalars(320, {EVAL_TAG: 14.0})
    runlog.close()
    assert training_series() == [(200, 10.0), (300, 12.0), (320, 14.0)]
    test_events = _events(test_dir)  # the test's records, whole
    test_returns = [(e.step, round(e.value, 2)) for e in test_events.Scalars("test/episodic_return_mean")]
    assert test_returns == [(300, float(played.group(1)))]
    (video,) = test_events.Images("test/video")
    assert video.step == 300 and video.encoded_image_string.startswith(b"GIF")
    assert impala.plotting.find_runs(tmp_path) == ["b"]  # RUN_DIR/test is no run of its own to plot


def test_greedy_and_sampled_evaluations_each_keep_their_own_best_across_sessions(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A session evaluating with other --eval_actions than model_best.tar's compares its means only with the best of
    its own actions: its first best takes model_best.tar and the other kind's is kept as model_best_ACTIONS.tar,
    which a later session of those actions compares with, takes back, and deletes once beaten."""
    import multiprocessing

    from impala import training
    from impala.checkpoint import best_eval_actions
    from impala.evaluator import make_evaluator

    best, greedy_kept, sampled_kept = (tmp_path / name for name in (
        BEST_CHECKPOINT_NAME, "model_best_greedy.tar", "model_best_sampled.tar"))
    pending = {"number": 1, "step": 100, "updates": 5, "episodes": 9}
    caplog.set_level(logging.INFO, logger="impala")
    runs: list[types.SimpleNamespace] = []

    def session(actions: str) -> types.SimpleNamespace:
        """A fake run of a session evaluating with `actions`, its evaluator made as `build` makes it."""
        run_ = _fake_run(tmp_path, best=None)
        runs.append(run_)
        run_.config = Config(env="CartPole-v1", model="mlp", eval_interval_s=1, hidden_size=32, eval_actions=actions)
        run_.evaluator = make_evaluator(run_.config, tmp_path, (4,), 2, multiprocessing.get_context("fork"))
        caplog.clear()
        training._log_best(tmp_path, run_.evaluator, actions)
        return run_

    def evaluate(run_: types.SimpleNamespace, step: int, mean: float) -> None:
        finish_evaluation(run_, run_.evaluator, {**pending, "step": step}, _games([mean, mean]))

    def held(path: Path) -> tuple[str, float, int]:
        saved = load_checkpoint(path)
        return saved["eval_actions"], saved["eval_return_mean"], saved["step"]

    greedy = session("greedy")
    evaluate(greedy, 100, 25.0)
    assert held(best) == ("greedy", 25.0, 100) and not greedy_kept.exists()
    first = best.read_bytes()

    sampled = session("sampled")  # resumed with --eval_actions sampled: no sampled best yet
    assert sampled.evaluator.best is None
    assert ("model_best.tar holds the best of greedy evaluations; this session's take sampled actions, whose means "
            "are compared only with each other") in caplog.text
    evaluate(sampled, 200, 10.0)  # worse than the greedy 25, and the first sampled one: the sampled best
    assert held(best) == ("sampled", 10.0, 200) and greedy_kept.read_bytes() == first
    assert best_eval_actions(best) == "sampled" and "Kept model_best.tar, the best of greedy evaluations, as " \
        "model_best_greedy.tar" in caplog.text
    evaluate(sampled, 300, 8.0)
    assert held(best) == ("sampled", 10.0, 200)

    greedy = session("greedy")  # back to greedy: compared with the greedy 25 kept aside
    assert greedy.evaluator.best == (25.0, 100)
    assert "Best greedy evaluation so far: mean return 25.00 at step 100 (model_best_greedy.tar)" in caplog.text
    evaluate(greedy, 400, 20.0)
    assert held(best) == ("sampled", 10.0, 200) and greedy_kept.read_bytes() == first
    evaluate(greedy, 500, 30.0)
    assert held(best) == ("greedy", 30.0, 500) and held(sampled_kept) == ("sampled", 10.0, 200)
    assert not greedy_kept.exists()  # beaten by the 30
    meta = json.loads((tmp_path / "meta.json").read_text())  # each kind's best, and the file it is in
    assert {actions: (record["step"], record["episodic_return_mean"], record["checkpoint"])
            for actions, record in meta["best_evaluations"].items()} == {
        "greedy": (500, 30.0, BEST_CHECKPOINT_NAME), "sampled": (200, 10.0, "model_best_sampled.tar")}
    assert meta["best_evaluation"] == meta["best_evaluations"]["greedy"]

    session("greedy")  # the same actions as model_best.tar: nothing to say of the other kind
    assert "Best evaluation so far: mean return 30.00 at step 500 (model_best.tar)" in caplog.text
    assert "holds the best of" not in caplog.text
    for run_ in runs:
        run_.runlog.close()


def test_a_best_of_other_actions_that_cannot_be_kept_aside_is_not_replaced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """model_best.tar of greedy evaluations that cannot be renamed (a read-only directory, a full quota) stays as it
    was: the sampled best is not saved over it, and training goes on."""
    save_checkpoint(tmp_path / BEST_CHECKPOINT_NAME, _state(_net(), 100, eval_return_mean=25.0, eval_actions="greedy"))
    before = (tmp_path / BEST_CHECKPOINT_NAME).read_bytes()
    run_ = _fake_run(tmp_path, best=None)
    run_.config = Config(env="CartPole-v1", eval_interval_s=1, hidden_size=32, eval_actions="sampled")
    run_.evaluator.best_actions = "greedy"

    def refuse(source: object, target: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(impala.checkpoint.os, "rename", refuse)
    finish_evaluation(run_, run_.evaluator, {"number": 1, "step": 200}, _games([10.0, 10.0]))
    run_.runlog.close()
    assert (tmp_path / BEST_CHECKPOINT_NAME).read_bytes() == before
    assert sorted(p.name for p in tmp_path.glob("model*")) == [BEST_CHECKPOINT_NAME]
    assert run_.evaluator.best is None and "Could not keep " in caplog.text and "Read-only file system" in caplog.text


def test_a_beaten_best_left_aside_by_a_cut_clean_up_is_replaced_and_never_outranks_the_best(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A kill between a greedy session's new best and its deletion of the greedy best it beat leaves that beaten
    model_best_greedy.tar beside model_best.tar. A later sampled session keeps model_best.tar aside over it: the
    greedy best is not orphaned under another name, and the next greedy session must beat it, not the beaten one."""
    from impala.evaluator import make_evaluator

    best, greedy_kept = tmp_path / BEST_CHECKPOINT_NAME, tmp_path / "model_best_greedy.tar"
    save_checkpoint(best, _state(_net(), 500, eval_return_mean=30.0, eval_actions="greedy"))
    save_checkpoint(greedy_kept, _state(_net(), 100, eval_return_mean=25.0, eval_actions="greedy"))  # beaten, left
    winner = best.read_bytes()
    assert find_checkpoint(tmp_path, "best", "greedy") == best
    sampled = _fake_run(tmp_path, best=None)
    sampled.config = Config(env="CartPole-v1", model="mlp", eval_interval_s=1, hidden_size=32, eval_actions="sampled")
    sampled.evaluator = make_evaluator(sampled.config, tmp_path, (4,), 2, multiprocessing.get_context("fork"))
    caplog.set_level(logging.INFO, logger="impala")
    finish_evaluation(sampled, sampled.evaluator, {"number": 1, "step": 600}, _games([10.0, 10.0]))
    sampled.runlog.close()
    assert sorted(p.name for p in tmp_path.glob("model_best*")) == [BEST_CHECKPOINT_NAME, greedy_kept.name]
    assert greedy_kept.read_bytes() == winner and load_checkpoint(best)["eval_actions"] == "sampled"
    assert "Kept model_best.tar, the best of greedy evaluations, as model_best_greedy.tar" in caplog.text
    greedy = make_evaluator(Config(env="CartPole-v1", model="mlp", eval_interval_s=1, hidden_size=32), tmp_path,
                            (4,), 2, multiprocessing.get_context("fork"))
    assert greedy is not None and greedy.best == (30.0, 500)
    assert find_checkpoint(tmp_path, "best", "greedy") == greedy_kept


def test_a_best_kept_aside_that_scores_more_or_cannot_be_read_is_never_replaced(tmp_path: Path) -> None:
    best, greedy_kept = tmp_path / BEST_CHECKPOINT_NAME, tmp_path / "model_best_greedy.tar"
    for kept_bytes in (b"", None):  # unreadable; better than model_best.tar
        for path in tmp_path.glob("model_best*"):
            path.unlink()
        save_checkpoint(best, _state(_net(), 500, eval_return_mean=20.0, eval_actions="greedy"))
        if kept_bytes is None:
            save_checkpoint(greedy_kept, _state(_net(), 100, eval_return_mean=25.0, eval_actions="greedy"))
        else:
            greedy_kept.write_bytes(kept_bytes)
        before = greedy_kept.read_bytes(), best.read_bytes()
        assert impala.checkpoint.keep_other_best(tmp_path, "greedy") == tmp_path / "model_best_greedy-1.tar"
        assert (greedy_kept.read_bytes(), (tmp_path / "model_best_greedy-1.tar").read_bytes()) == before
        assert not best.exists()


def test_the_best_is_found_whatever_state_a_kill_or_a_damaged_file_left(tmp_path: Path) -> None:
    """--checkpoint best after a kill between keeping model_best.tar aside and saving the new best in its place
    (only the other kind's kept file is there), and where model_best.tar is damaged: a kept best of the session's
    actions is played rather than refused; where that is the damaged one, the message says to move it away."""
    greedy_kept = tmp_path / "model_best_greedy.tar"
    save_checkpoint(greedy_kept, _state(_net(), 100, eval_return_mean=25.0, eval_actions="greedy"))
    for actions in ("greedy", "sampled"):
        assert find_checkpoint(tmp_path, "best", actions) == greedy_kept
    (tmp_path / BEST_CHECKPOINT_NAME).write_bytes(b"torn")  # then the sampled best, most likely
    assert find_checkpoint(tmp_path, "best", "greedy") == greedy_kept
    damaged = r"model_best.tar is not a readable checkpoint .*: restore it, or move it away to start a new best$"
    with pytest.raises(UserError, match=damaged):
        find_checkpoint(tmp_path, "best", "sampled")
    greedy_kept.unlink()
    with pytest.raises(UserError, match=damaged):
        find_checkpoint(tmp_path, "best", "greedy")
