"""Full-game episodes with an agent: test mode (a saved agent) and the evaluations while training (the
newest weights, played in the evaluation process that `training` starts). Both go through `play`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter

from impala.checkpoint import find_checkpoint, load_checkpoint
from impala.config import Config, UserError, run_path, say
from impala.environment import EnvBatch, is_atari
from impala.metrics import quiet_event_writer_threads, remove_empty_files, video_summary
from impala.model import Net
from impala.seeding import EVAL_SEED_OFFSET, TEST_SEED_OFFSET

log = logging.getLogger("impala")


def load_agent(config: Config, env_from_checkpoint: bool = False) -> tuple[Net, dict, Path]:
    """The model `--checkpoint` names (latest or best of SAVEDIR/XPID, or a path), checked against the env (unless
    the env is to be the checkpoint's own), its checkpoint, and the file it was read from."""
    path = find_checkpoint(_run_dir(config), config.checkpoint, config.eval_actions)
    state = load_checkpoint(path)
    flags = state["flags"]
    if not isinstance(flags.get("env"), str) or not flags["env"]:
        raise UserError(f"checkpoint {path} is not an impala checkpoint (no env in its flags)")
    if not env_from_checkpoint and flags.get("env") != config.env:
        config_env = config.env
        raise UserError(f"checkpoint {path} was trained on {flags.get('env')!r}, not {config_env!r}; "
                        f"pass --env {flags.get('env')}")
    model = _saved_net(state, path)
    model.eval()
    return model, state, path


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
    model, state, path = load_agent(config, env_from_checkpoint)
    # which file --checkpoint latest or best chose in the run (best may fall back on another kind's), and how it plays
    played = f"{path.name if config.xpid else path} at step {state['step']}, {config.eval_actions} actions"
    if env_from_checkpoint and state["flags"].get("env") != config.env:
        config = dataclasses.replace(config, env=str(state["flags"]["env"]))
        say(f"Playing {config.env}, the env of the checkpoint")
    recorder = EpisodeRecorder() if config.video else None
    # Without --xpid, beside the file loaded (--keep_checkpoints of a live run may have pruned it since)
    video_run_dir = (_run_dir(config) or Path(config.checkpoint).expanduser().parent) if recorder else None
    if video_run_dir is not None and config.xpid and not video_run_dir.is_dir():  # --checkpoint PATH of elsewhere
        raise UserError(f"--video: there is no run {config.xpid!r} in {config.savedir} to write the video in; drop "
                        "--xpid to write it beside the checkpoint file")
    if video_run_dir is not None and config.xpid and (trained := _run_env(video_run_dir)) not in (None, config.env):
        raise UserError(f"--video: run {config.xpid!r} trained {trained}, and this test plays {config.env}: its "
                        "return and video would go among that run's; drop --xpid to write them beside the "
                        "checkpoint file")
    if video_run_dir is not None:  # before the games, which may take long: a video that cannot be kept is one line
        _check_writable(video_run_dir / TEST_DIR_NAME)
    try:
        games = play(model, config.env, config.test_episodes, config.seed + TEST_SEED_OFFSET,
                     greedy=config.eval_actions == "greedy", on_step=recorder.add if recorder is not None else None,
                     fire_on_life_loss=config.fire_on_life_loss, max_steps=config.eval_max_steps)
    except PlayInterrupted as stopped:  # what had been played, then exit code 130 (no video: a game unfinished)
        say(f"Stopped by Ctrl-C with {len(stopped.games.returns)} of {config.test_episodes} games ended")
        if stopped.games.returns:
            _print_results(stopped.games, state, played)
        raise
    mean = _print_results(games, state, played)
    if recorder is not None and video_run_dir is not None:
        log_dir = write_test_results(video_run_dir, int(state["step"]), games.returns, recorder.frames(),
                                     VIDEO_FPS_ATARI if is_atari(config.env) else VIDEO_FPS_OTHER)
        say(f"Wrote the first episode ({len(recorder.observations)} frames) to TensorBoard in {log_dir} "
            f"(IMAGES tab, {TEST_TAG_PREFIX}/video)")
    return mean


def _run_env(run_dir: Path) -> str | None:
    """The env a run trained (its flags.json); None where that cannot be read."""
    try:
        env = json.loads((run_dir / "flags.json").read_text()).get("env")
    except (OSError, ValueError, AttributeError):  # missing, damaged, or not an object
        return None
    return env if isinstance(env, str) else None


def _check_writable(log_dir: Path) -> None:
    """UserError where `log_dir` (test mode's, made by its first write) could not be written."""
    existing = next(path for path in (log_dir, *log_dir.parents) if path.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"cannot write the video to TensorBoard in {log_dir.parent}: "
                        f"{existing} is not a writable directory")


def _print_results(games: Games, state: dict, played: str) -> float:
    """Print the games' mean return and lengths, and `played` (the checkpoint's file and step, and the actions);
    return the mean."""
    returns = games.returns
    mean = float(np.mean(returns))
    actions = f"{state['eval_actions']} " if isinstance(state.get("eval_actions"), str) else ""
    best = (f"; its {actions}evaluation while training: {state['eval_return_mean']:.2f}" if "eval_return_mean" in state
            else "")
    say(f"Mean return over {len(returns)} episode{'s' if len(returns) != 1 else ''}: {mean:.2f} (min {min(returns):.2f}, max {max(returns):.2f}; "
        f"{played}{best})")
    say(games.summary())
    return mean


# Evaluations play the games seeded EVAL_SEED_OFFSET (impala/seeding.py) after the run's seed and on, one per game
# (`play`), each evaluation the next --eval_episodes of them: other games than the actors' and the test mode's, and
# other games in every evaluation, so the best is not chosen on one fixed set. The count of seeds handed out is in the checkpoint, as
# the actor lives are: a resumed session goes on from it, whatever its --eval_episodes. Only what a killed session
# evaluated after its last checkpoint is played again, as its training is done again.


def serve_evaluations(model: Net, config: Config, connection: Connection, heartbeat: Any = None) -> None:
    """The evaluation process's loop; returns when the main process closes its end of `connection`, also while
    it plays (the main process took it for dead: its fork server died, and another evaluator took its place).

    For each request `(number, step, seeds_from)` it plays `config.eval_episodes` full games with `model` (the
    shared copy the main process fills with the weights of agent step `step` and leaves alone until the answer
    comes), seeded from the run's evaluation seed number `seeds_from` on, and answers `(number, step, games,
    cpu_s)`, `games` the `Games` played and `cpu_s` the CPU seconds this process spent on them.
    `heartbeat.value`, when given, is set to `time.monotonic()` at every agent step (for the main process's
    hung-evaluator watch, --actor_timeout_s), and every EVAL_START_BEAT_S until the first: making and resetting
    hundreds of envs, at the lowest priority on busy cores, can take minutes.
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
        with _beating_until_the_first_step(beat, EVAL_START_ALLOWANCE * config.actor_timeout_s) as step_beat:
            games = play(model, config.env, config.eval_episodes, seed, greedy=config.eval_actions == "greedy",
                         on_step=step_beat, fire_on_life_loss=config.fire_on_life_loss, max_steps=config.eval_max_steps)
        try:
            connection.send((number, step, games, time.process_time() - start_cpu_s))
        except BrokenPipeError:  # nobody to answer
            return


EVAL_START_BEAT_S = 5.0  # the evaluator's heartbeat while its envs are made and reset, before their first step
# How long that may go on, in --actor_timeout_s: a start that takes longer is a hang, which the watch then finds.
EVAL_START_ALLOWANCE = 3


@contextlib.contextmanager
def _beating_until_the_first_step(beat: Callable[[], None], limit_s: float) -> Iterator[Callable[..., None]]:
    """`beat()` every EVAL_START_BEAT_S from a thread until the block calls the `on_step` it is given (which beats
    too), the block ends, or `limit_s` has passed."""
    stepping = threading.Event()
    deadline = time.monotonic() + limit_s

    def beat_until_stepping() -> None:
        while not stepping.wait(EVAL_START_BEAT_S) and time.monotonic() < deadline:
            beat()

    def step_beat(*_: object) -> None:
        stepping.set()
        beat()

    thread = threading.Thread(target=beat_until_stepping, name="eval-start-beat", daemon=True)
    thread.start()
    try:
        yield step_beat
    finally:
        stepping.set()
        thread.join()

# Atari plays at 60 frames/s and an agent step is 4 frames; other envs have no common clock.
VIDEO_FPS_ATARI = 15.0
VIDEO_FPS_OTHER = 30.0
VIDEO_MAX_FRAMES = 2000  # a long game would make a GIF of tens of MB: keep its start
VIDEO_SCALE = 2  # 84x84 Atari frames are small on screen
VIDEO_MAX_SIDE = 512  # pixels: a larger image observation is shown subsampled (2,000 frames of 512x512: 1.5 GB)
VIDEO_MAX_WIDTH = 1024  # pixels: the bar charts of vector observations

# Test mode's records: TensorBoard events of their own in RUN_DIR/test (another TensorBoard run beside the
# training's, which a resume's purge of the run directory's events does not touch, and which `--mode plot` does
# not read), under tags of their own, so that no test result joins the curves of the evaluations while training.
TEST_DIR_NAME = "test"
TEST_TAG_PREFIX = "test"


class EpisodeRecorder:
    """Keeps env 0's observations until its first game ends, and turns them into video frames.

    Frames show what the agent sees, so no renderer is needed (gymnasium's classic-control renderer
    needs pygame): for image observations [C, H, W] with 3 channels the colour image, with any other number
    the newest frame of the stack (Atari's 4), in grey; for 2-D observations [H, W] the grey image; for vector
    observations [D] (and any other shape, flattened) one bar per dimension (up: positive, down: negative, each
    scaled to its largest magnitude in the episode), or, for more dimensions than VIDEO_MAX_WIDTH has room for
    (about a third of it), one bar per group of neighbouring dimensions. Images are shown VIDEO_SCALE times
    their size, where that stays within VIDEO_MAX_SIDE, subsampled where they are larger.
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
            return _image_frames(stacked.transpose(0, 2, 3, 1) if stacked.shape[1] == 3 else stacked[:, -1, :, :, None])
        if stacked.ndim == 3 and min(stacked.shape[1:]) > 1:  # [T, H, W]: a grey image (a row or column: a vector)
            return _image_frames(stacked[..., None])
        return _bar_frames(stacked.reshape(len(stacked), -1).astype(np.float64), max_width=VIDEO_MAX_WIDTH)


def _image_frames(images: np.ndarray, max_side: int = VIDEO_MAX_SIDE) -> np.ndarray:
    """[T, H, W, C] images (C 3: colour, 1: grey) -> [T, h, w, 3] uint8: VIDEO_SCALE times their size where that
    stays within `max_side` pixels, else as large as fits (every k-th pixel of a larger one). uint8 values are
    shown as they are; others (float observations) spread over 0..255 from the episode's smallest to largest."""
    largest = max(images.shape[1:3])
    stride = -(-largest // max_side)  # ceil: 1 where the image fits
    images = images[:, ::stride, ::stride]
    if images.dtype != np.uint8:
        low, high = float(images.min()), float(images.max())
        levels = (images - low) * (255.0 / (high - low)) if high > low else np.zeros(images.shape, np.float32)
        images = np.rint(levels).astype(np.uint8)
    scale = max(1, min(VIDEO_SCALE, max_side // max(images.shape[1:3])))
    if scale > 1:
        images = images.repeat(scale, axis=1).repeat(scale, axis=2)
    return np.repeat(images, 3 // images.shape[-1], axis=-1)


# The bar charts on white: a grey zero line, blue bars up (positive), red ones down.
_ZERO_LINE, _POSITIVE, _NEGATIVE = (160, 160, 160), (40, 120, 200), (220, 90, 60)


def _bar_frames(values: np.ndarray, height: int = 96, max_width: int = VIDEO_MAX_WIDTH) -> np.ndarray:
    """[T, D] values -> [T, height, width, 3] uint8 bar charts around a zero line, `width` at most `max_width`.

    One bar per dimension, each scaled to its largest magnitude in the episode: 24 pixels wide with 8 between
    them, narrower where D is large (at least 2 and 1), to keep near `max_width`. Where even those do not fit
    (D above (max_width - 1) // 3, 341 for 1,024 pixels), each bar stands for a group of neighbouring dimensions
    and shows the one of them farthest from zero (a one-hot vector's one keeps its bar)."""
    steps, dims = values.shape
    scale = np.abs(values).max(axis=0)
    scale[scale == 0] = 1.0
    values = values / scale  # [T, D] in [-1, 1]
    max_bars = max(1, (max_width - 1) // 3)  # bars of 2 pixels with 1 between them and before the first
    if dims > max_bars:
        group = -(-dims // max_bars)
        bars = -(-dims // group)
        grouped = np.zeros((steps, bars * group))
        grouped[:, :dims] = values
        grouped = grouped.reshape(steps, bars, group)
        farthest = np.abs(grouped).argmax(axis=-1)  # [T, bars]
        values = np.take_along_axis(grouped, farthest[..., None], axis=-1)[..., 0]
    bars = values.shape[1]
    bar_width = max(2, min(24, max_width * 3 // (4 * bars + 1)))
    gap = max(1, bar_width // 3)
    period = bar_width + gap
    middle, reach = height // 2, height // 2 - 4  # 4 px margin
    heights = np.rint(values * reach).astype(np.int64)  # [T, bars], -reach..reach
    # Each height's bar as one column of pixels, bar_width wide, [2 * reach + 1, height, bar_width * 3]; picked
    # for every bar of every frame at once: no loop over the bars.
    levels = np.arange(-reach, reach + 1)[:, None]
    rows = np.arange(height)[None, :]
    in_bar = (rows >= np.minimum(middle, middle - levels)) & (rows <= np.maximum(middle, middle - levels))
    empty = np.where((rows == middle)[..., None], _rgb(_ZERO_LINE), _rgb((255, 255, 255)))  # [1, height, 3]
    colour = np.where((levels >= 0)[..., None], _rgb(_POSITIVE), _rgb(_NEGATIVE))  # [2 * reach + 1, 1, 3]
    bar_columns = np.tile(np.where(in_bar[..., None], colour, empty), (1, 1, bar_width))
    frames = np.full((steps, height, bars * period + gap, 3), 255, np.uint8)  # white
    frames[:, middle] = _ZERO_LINE
    # A view of the frames' rows after the first gap: per bar, its pixels' bytes, then its gap's.
    per_bar = frames.reshape(steps, height, -1)[:, :, gap * 3:].reshape(steps, height, bars, period * 3)
    per_bar[:, :, :, :bar_width * 3] = bar_columns[heights + reach].transpose(0, 2, 1, 3)
    return frames


def _rgb(colour: tuple[int, int, int]) -> np.ndarray:
    return np.array(colour, np.uint8)


def write_test_results(run_dir: Path, step: int, returns: list[float], frames: np.ndarray, fps: float) -> Path:
    """Test mode's mean return (test/episodic_return_mean) and one episode's video (test/video) at the checkpoint's
    step, in a new event file in RUN_DIR/test (see TEST_DIR_NAME); returns that directory. UserError where they
    cannot be written (a full disk), leaving no event file begun nor directory made."""
    quiet_event_writer_threads()
    log_dir = run_dir / TEST_DIR_NAME
    made = not log_dir.is_dir()
    before = set(log_dir.glob("events.out.tfevents.*"))
    try:  # not a RunLog, which reports a failed write and goes on: here it is the command's whole work
        with SummaryWriter(log_dir=str(log_dir)) as writer:
            writer.add_scalar(f"{TEST_TAG_PREFIX}/episodic_return_mean", float(np.mean(returns)), step)
            writer._get_file_writer().add_summary(video_summary(f"{TEST_TAG_PREFIX}/video", frames, fps), step)
    except OSError as exc:
        remove_empty_files(set(log_dir.glob("events.out.tfevents.*")) - before)  # the event file it began
        if made:
            with contextlib.suppress(OSError):
                log_dir.rmdir()  # only where empty
        raise UserError(f"cannot write the video to TensorBoard in {run_dir}: {exc.strerror or exc}") from None
    return log_dir
