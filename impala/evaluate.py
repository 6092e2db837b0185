"""Full-game episodes with an agent: test mode (a saved agent) and the evaluations while training (the
newest weights, played in the evaluation process that `training` starts). Both go through `play`."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter

from impala.checkpoint import find_checkpoint, load_checkpoint
from impala.config import Config, UserError, run_path
from impala.environment import EnvBatch, is_atari
from impala.metrics import quiet_event_writer_threads, remove_empty_files, video_summary
from impala.model import Net

log = logging.getLogger("impala")


def load_agent(config: Config, env_from_checkpoint: bool = False) -> tuple[Net, dict]:
    """The model `--checkpoint` names (latest or best of SAVEDIR/XPID, or a path), checked against the env (unless
    the env is to be the checkpoint's own)."""
    path = find_checkpoint(_run_dir(config), config.checkpoint)
    state = load_checkpoint(path)
    flags = state["flags"]
    if not env_from_checkpoint and flags.get("env") != config.env:
        config_env = config.env
        raise UserError(f"checkpoint {path} was trained on {flags.get('env')!r}, not {config_env!r}; "
                        f"pass --env {flags.get('env')}")
    model = _saved_net(state, path)
    model.eval()
    return model, state


def _saved_net(state: dict[str, Any], path: Path) -> Net:
    """The Net that checkpoint `state` (read from `path`) describes in its header, holding its weights.

    Weights that do not fit that header (keys renamed, another hidden size or number of actions: a damaged file,
    or one of another version) are the checkpoint's fault: a UserError naming it, as training says for the same
    file (`learner.LearnerState.load_state_dict`), not a traceback.
    """
    flags = state["flags"]
    description = (f"{state.get('model')}, observations {tuple(state['observation_shape'])}, "
                   f"{state['num_actions']} actions, hidden_size {flags.get('hidden_size', 256)}")
    try:
        model = Net(tuple(state["observation_shape"]), int(state["num_actions"]), state.get("model", "auto"),
                    bool(flags.get("use_lstm")), int(flags.get("hidden_size", 256)))
        model.load_state_dict(state["model_state_dict"])
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__  # load_state_dict's details are on later lines
        reason = reason if len(reason) <= 300 else reason[:297] + "..."
        raise UserError(f"checkpoint {path} does not fit the Net its own header describes ({description}): "
                        f"{reason}; it is damaged or from another version: use another checkpoint") from None
    return model


@dataclass(frozen=True)
class Games:
    """What `play` played, one entry a game: its return, its length in agent steps, and whether a time limit
    cut it (a policy that stalls plays every game to the limit)."""

    returns: list[float]
    lengths: list[int]
    cut: list[bool]

    def summary(self) -> str:
        """One line on the games' lengths."""
        cut = sum(self.cut)
        return (f"Games lasted {min(self.lengths)}-{max(self.lengths)} agent steps (mean {np.mean(self.lengths):.0f}); "
                f"{cut} of {len(self.cut)} cut by the time limit")


class PlayInterrupted(KeyboardInterrupt):
    """Ctrl-C while `play` played: `games` holds the games that had ended by then."""

    def __init__(self, games: Games) -> None:
        super().__init__()
        self.games = games


def play(model: Net, env_id: str, episodes: int, seed: int, greedy: bool = True,
         on_step: Callable[[np.ndarray, np.ndarray], None] | None = None, fire_on_life_loss: bool = True,
         max_steps: int | None = None) -> Games:
    """The full games of `episodes` parallel envs, the first game of each; on Ctrl-C, `PlayInterrupted` with the
    games that had ended. `max_steps` cuts the games of an env without a time limit of its own (--eval_max_steps).

    `on_step(obs, game_over)`, when given, sees every observation the agent acts on ([episodes, ...]) and
    which games ended on that action ([episodes] bool): `EpisodeRecorder.add` keeps env 0's frames.
    """
    env = EnvBatch(env_id, episodes, seed, episodic_life=False, fire_on_life_loss=fire_on_life_loss,
                   max_episode_steps=max_steps)
    returns: list[float | None] = [None] * episodes
    lengths, cut = [0] * episodes, [False] * episodes
    try:  # the envs closed however it ends, a checkpoint of another env's shapes too
        check_compatible_env(model, env)
        obs = torch.from_numpy(env.reset())
        done = torch.ones(episodes, dtype=torch.bool)
        core_state = model.initial_state(episodes)
        generator = torch.Generator().manual_seed(seed)
        while any(r is None for r in returns):
            with torch.no_grad():
                output, core_state = model(obs[None], done[None], core_state)
            logits = output.policy_logits[0]
            if greedy:
                action = logits.argmax(-1)
            else:
                action = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(-1)
            step = env.step(action.numpy())
            if on_step is not None:
                on_step(obs.numpy(), step.game_over)
            for i in np.flatnonzero(step.game_over):
                if returns[i] is None:
                    lengths[i], cut[i] = int(step.episode_step[i]), bool(step.truncated[i])
                    returns[i] = float(step.episode_return[i])  # last: a game counts once all three are set
            obs, done = torch.from_numpy(step.obs), torch.from_numpy(step.done)
    except KeyboardInterrupt:
        raise PlayInterrupted(_ended(returns, lengths, cut)) from None
    finally:
        env.close()
    return _ended(returns, lengths, cut)  # every game, by now


def _ended(returns: list[float | None], lengths: list[int], cut: list[bool]) -> Games:
    """The games that have ended: those with a return."""
    ended = [(r, n, c) for r, n, c in zip(returns, lengths, cut, strict=True) if r is not None]
    return Games([r for r, _, _ in ended], [n for _, n, _ in ended], [c for _, _, c in ended])


def check_compatible_env(model: Net, env: EnvBatch) -> None:
    if tuple(env.observation_shape) != model.observation_shape or env.num_actions != model.num_actions:
        raise UserError(f"the saved model expects observations {model.observation_shape} and "
                        f"{model.num_actions} actions; the env has {env.observation_shape} and {env.num_actions}")


def _run_dir(config: Config) -> Path | None:
    return run_path(config.savedir, config.xpid) if config.xpid else None


def test(config: Config, env_from_checkpoint: bool = False) -> float:
    """Play `config.test_episodes` games (greedy unless --eval_actions sampled) and print their mean return; on
    the checkpoint's own env where `env_from_checkpoint` (no --env given)."""
    torch.set_num_threads(1)
    model, state = load_agent(config, env_from_checkpoint)
    if env_from_checkpoint and state["flags"].get("env") != config.env:
        config = dataclasses.replace(config, env=str(state["flags"]["env"]))
        print(f"Playing {config.env}, the env of the checkpoint")
    recorder = EpisodeRecorder() if config.video else None
    try:
        games = play(model, config.env, config.test_episodes, config.seed + 12345,
                     greedy=config.eval_actions == "greedy", on_step=recorder.add if recorder is not None else None,
                     fire_on_life_loss=config.fire_on_life_loss, max_steps=config.eval_max_steps)
    except PlayInterrupted as stopped:  # what had been played, then exit code 130 (no video: a game unfinished)
        print(f"Stopped by Ctrl-C with {len(stopped.games.returns)} of {config.test_episodes} games ended")
        if stopped.games.returns:
            _print_results(stopped.games, state)
        raise
    mean = _print_results(games, state)
    if recorder is not None:
        run_dir = _run_dir(config) or find_checkpoint(None, config.checkpoint).parent
        write_evaluation(run_dir, int(state["step"]), games.returns, recorder.frames(), VIDEO_FPS_ATARI
                         if is_atari(config.env) else VIDEO_FPS_OTHER)
        print(f"Wrote the first episode ({len(recorder.observations)} frames) to TensorBoard in {run_dir} "
              "(IMAGES tab, eval/video)")
    return mean


def _print_results(games: Games, state: dict) -> float:
    """Print the games' mean return and lengths; return the mean."""
    returns = games.returns
    mean = float(np.mean(returns))
    best = (f"; its evaluation while training: {state['eval_return_mean']:.2f}" if "eval_return_mean" in state
            else "")
    print(f"Mean return over {len(returns)} episodes: {mean:.2f} (min {min(returns):.2f}, max {max(returns):.2f}; "
          f"checkpoint at step {state['step']}{best})")
    print(games.summary())
    return mean


# Evaluations play the games seeded EVAL_SEED_OFFSET after the run's seed and on, one per game (`play`), each
# evaluation the next --eval_episodes of them: other games than the actors' and the test mode's, and other games in
# every evaluation, so the best is not chosen on one fixed set. The count of seeds handed out is in the checkpoint, as
# the actor lives are: a resumed session goes on from it, whatever its --eval_episodes. Only what a killed session
# evaluated after its last checkpoint is played again, as its training is done again.
EVAL_SEED_OFFSET = 1_000_000


def serve_evaluations(model: Net, config: Config, connection: Connection, heartbeat: Any = None) -> None:
    """The evaluation process's loop; returns when the main process closes its end of `connection`, also while
    it plays (the main process took it for dead: its fork server died, and another evaluator took its place).

    For each request `(number, step, seeds_from)` it plays `config.eval_episodes` full games with `model` (the
    shared copy the main process fills with the weights of agent step `step` and leaves alone until the answer
    comes), seeded from the run's evaluation seed number `seeds_from` on, and answers `(number, step, games,
    cpu_s)`, `games` the `Games` played and `cpu_s` the CPU seconds this process spent on them.
    `heartbeat.value`, when given, is set to `time.monotonic()` at every agent step (for the main process's
    hung-evaluator watch, --actor_timeout_s).
    """

    def beat(*_: object) -> None:
        if heartbeat is not None:
            heartbeat.value = time.monotonic()

    while True:
        try:
            number, step, seeds_from = connection.recv()
        except EOFError:
            return
        beat()
        start_cpu_s = time.process_time()
        seed = config.seed + EVAL_SEED_OFFSET + seeds_from
        games = play(model, config.env, config.eval_episodes, seed,
                     greedy=config.eval_actions == "greedy", on_step=beat, fire_on_life_loss=config.fire_on_life_loss,
                     max_steps=config.eval_max_steps)
        try:
            connection.send((number, step, games, time.process_time() - start_cpu_s))
        except BrokenPipeError:  # nobody to answer
            return


# Atari plays at 60 frames/s and an agent step is 4 frames; other envs have no common clock.
VIDEO_FPS_ATARI = 15.0
VIDEO_FPS_OTHER = 30.0
VIDEO_MAX_FRAMES = 2000  # a long game would make a GIF of tens of MB: keep its start
VIDEO_SCALE = 2  # 84x84 Atari frames are small on screen


class EpisodeRecorder:
    """Keeps env 0's observations until its first game ends, and turns them into video frames.

    Frames show what the agent sees, so no renderer is needed (gymnasium's classic-control renderer
    needs pygame): for image observations [C, H, W] with 3 channels the colour image, with any other number
    the newest frame of the stack (Atari's 4), in grey; for vector observations [D] one bar per dimension (up:
    positive, down: negative, each scaled to its largest magnitude in the episode).
    """

    def __init__(self, max_frames: int = VIDEO_MAX_FRAMES) -> None:
        self.max_frames = max_frames
        self.observations: list[np.ndarray] = []
        self.finished = False

    def add(self, obs: np.ndarray, game_over: np.ndarray) -> None:
        """`on_step` for `play`: `obs` [N, ...] was acted on; `game_over` [N] ended on that action."""
        if self.finished:
            return
        if len(self.observations) < self.max_frames:
            self.observations.append(np.array(obs[0]))
        self.finished = bool(game_over[0])

    def frames(self) -> np.ndarray:
        """[T, H, W, 3] uint8."""
        if not self.observations:
            raise ValueError("no observation recorded")
        stacked = np.stack(self.observations)
        if stacked.ndim == 4:  # [T, C, H, W] images
            image = stacked.transpose(0, 2, 3, 1) if stacked.shape[1] == 3 else stacked[:, -1, :, :, None]
            image = image.astype(np.uint8).repeat(VIDEO_SCALE, axis=1).repeat(VIDEO_SCALE, axis=2)
            return np.repeat(image, 3 // image.shape[-1], axis=-1)
        return _bar_frames(stacked.reshape(len(stacked), -1).astype(np.float64))


def _bar_frames(values: np.ndarray, height: int = 96, max_width: int = 1024) -> np.ndarray:
    """[T, D] values -> [T, height, D * (bar_width + gap) + gap, 3] uint8 bar charts around a zero line, bars 24
    pixels wide with 8 between them, narrower where D is large (at least 2 and 1), to keep near `max_width`."""
    steps, dims = values.shape
    bar_width = max(2, min(24, max_width * 3 // (4 * dims + 1)))
    gap = max(1, bar_width // 3)
    scale = np.abs(values).max(axis=0)
    scale[scale == 0] = 1.0
    heights = np.rint(values / scale * (height // 2 - 4)).astype(np.int64)  # [T, D], 4 px margin
    frames = np.full((steps, height, dims * (bar_width + gap) + gap, 3), 255, np.uint8)
    middle = height // 2
    frames[:, middle, :] = 160  # the zero line
    for t in range(steps):
        for d in range(dims):
            left = gap + d * (bar_width + gap)
            top, bottom = sorted((middle, middle - heights[t, d]))
            color = (40, 120, 200) if heights[t, d] >= 0 else (220, 90, 60)
            frames[t, top:bottom + 1, left:left + bar_width] = color
    return frames


def write_evaluation(run_dir: Path, step: int, returns: list[float], frames: np.ndarray, fps: float) -> None:
    """The test returns (eval/episodic_return_mean) and one episode's video (eval/video) at the checkpoint's step."""
    quiet_event_writer_threads()
    before = set(run_dir.glob("events.out.tfevents.*"))
    try:  # not a RunLog, which reports a failed write and goes on: here it is the command's whole work
        with SummaryWriter(log_dir=str(run_dir)) as writer:
            writer.add_scalar("eval/episodic_return_mean", float(np.mean(returns)), step)
            writer._get_file_writer().add_summary(video_summary("eval/video", frames, fps), step)
    except OSError as exc:
        remove_empty_files(set(run_dir.glob("events.out.tfevents.*")) - before)  # the event file it began
        raise UserError(f"cannot write the video to TensorBoard in {run_dir}: {exc.strerror or exc}") from None
