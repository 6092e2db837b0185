"""A training run: build, start, monitor, shut down. The only module that creates processes,
threads, locks and queues.

    main thread: build() -> start_actors() -> start_learners() -> monitor() -> shutdown()
    actor processes: actor.run_actor(), filling slots from their own free pipe into the full queue
    learner threads: take batch_size full slots, update, publish weights to the shared actor model
    evaluation process (--eval_interval_s): evaluate.serve_evaluations(), full games with a weights snapshot
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import functools
import logging
import os
import signal
import statistics
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from impala import learner
from impala.actor_pool import (
    ACTOR_JOIN_TIMEOUT_S,
    RESTART_WINDOW_S,
    LocalActorPool,
    die_with_main_process,
    exit_description,
    keep_freed_memory,
    process_context,
)
from impala.buffers import Buffers, BufferSpec, create_buffers
from impala.checkpoint import (
    BEST_CHECKPOINT_NAME,
    CHECKPOINT_NAME,
    best_so_far,
    check_compatible,
    keep_step_copy,
    load_checkpoint,
    save_checkpoint,
)
from impala.config import Config, TrainingError, UserError
from impala.environment import EnvBatch, is_atari
from impala.evaluate import serve_evaluations
from impala.inference import InferenceServer
from impala.metrics import STATUS, RunLog, close_console, progress_line, setup_console
from impala.model import Net, use_amp
from impala.rundir import (
    finish_run_files,
    prepare_run_directory,
    record_best,
    resume_checkpoint,
    run_directory,
    write_run_files,
)
from impala.seeding import INFERENCE_STREAM, ActorLives, sampling_seed

log = logging.getLogger("impala")

LEARNER_JOIN_TIMEOUT_S = 10.0  # a learner in the middle of an update finishes it; the checkpoint waits for it
EVALUATOR_NICENESS = 19  # evaluation plays with the CPU time actors and learners leave; it is never in their way


class Stopped(Exception):
    """Raised by `train` after an orderly stop on Ctrl-C or SIGTERM; `exit_code` is the shell convention."""

    def __init__(self, reason: str, signum: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.exit_code = 128 + signum


@dataclass
class Evaluator:
    """The evaluation process (--eval_interval_s > 0) and what the monitor knows of it.

    Only the monitor thread uses it. The monitor writes the newest weights into `model`, a shared CPU copy,
    only while no evaluation is pending, and the evaluation process reads it only while one is: no lock.
    """

    model: Net
    best: tuple[float, int] | None  # (mean return, agent step) recorded in model_best.tar
    process: Any = None
    connection: Any = None  # the main end of the pipe to `process`
    pending: dict | None = None  # counters of the weights being evaluated: number, step, updates, episodes
    requested: int = 0  # evaluations asked for in this session; numbers their games' seeds
    last_request_s: float = field(default_factory=time.monotonic)
    error_text: str = ""  # the traceback a failing evaluator sent before it died
    deaths: list = field(default_factory=list)  # times of deaths, for the crash-rate limit
    disabled: bool = False


@dataclass
class Run:
    """Everything the stages of a run share. Mutable fields change under `update_lock`."""

    config: Config
    run_dir: Path
    device: torch.device
    model: Net  # the learner's, on `device`
    actor_model: Net  # shared CPU copy the actors act with
    optimizer: torch.optim.Optimizer
    scheduler: Any
    buffers: Buffers
    pool: LocalActorPool  # the actors; learners take full slots from `pool.slots`
    ctx: Any
    runlog: RunLog
    amp: bool = False  # bfloat16 autocast in the learner
    learner_model: Any = None  # `model`, or its torch.compile'd wrapper (same parameters) with --compile
    inference: InferenceServer | None = None  # --inference central
    inference_thread: threading.Thread | None = None
    inference_error: Exception | None = None  # why the inference thread died; the monitor stops the run
    evaluator: Evaluator | None = None  # --eval_interval_s > 0
    resumed_from: Path | None = None
    stop_inference: threading.Event = field(default_factory=threading.Event)
    step: int = 0
    updates: int = 0
    start_step: int = 0
    saved_step: int | None = None  # the step of the newest checkpoint on disk
    final_save_error: OSError | None = None
    bad_updates_in_a_row: int = 0
    skipped_updates: int = 0
    learner_threads: list = field(default_factory=list)
    learner_errors: list = field(default_factory=list)
    update_lock: threading.Lock = field(default_factory=threading.Lock)
    stop_learning: threading.Event = field(default_factory=threading.Event)
    last_stats: dict = field(default_factory=dict)
    stats_sum: dict = field(default_factory=lambda: collections.defaultdict(float))
    stats_count: int = 0
    episode_returns: collections.deque = field(default_factory=lambda: collections.deque(maxlen=100))
    episodes: int = 0
    policy_lag_sum: float = 0.0
    timing_sum_s: dict = field(default_factory=lambda: collections.defaultdict(float))  # per learner phase
    timing_count: int = 0


# ----------------------------------------------------------------------------------------- build


def select_device(config: Config) -> torch.device:
    if not config.disable_cuda and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def build(config: Config) -> Run:
    """Everything a run needs, with no process or thread started yet.

    Every check a user can fail (env id, model, checkpoint, shared memory, savedir) comes before the
    first file is written, so a refused run leaves an existing run directory exactly as it was.
    """
    probe = EnvBatch(config.env, 1, config.seed)  # shapes, and an early error for a bad env id
    observation_shape, num_actions = probe.observation_shape, probe.num_actions
    observation_dtype = torch.uint8 if probe.observation_dtype.kind == "u" else torch.float32
    probe.close()
    torch.manual_seed(config.seed)
    try:
        model = Net(observation_shape, num_actions, config.model, config.use_lstm, config.hidden_size)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    run_dir, resuming = run_directory(config)
    checkpoint_path = resume_checkpoint(config, run_dir)  # model.tar, or --checkpoint best|PATH
    checkpoint = load_checkpoint(checkpoint_path) if checkpoint_path is not None else None
    if checkpoint is not None:
        check_compatible(checkpoint, env=config.env, model=model.model, use_lstm=config.use_lstm,
                         hidden_size=config.hidden_size, observation_shape=observation_shape,
                         num_actions=num_actions, path=checkpoint_path)
        if int(checkpoint["step"]) >= config.total_steps:
            raise UserError(f"run {run_dir} already reached step {checkpoint['step']} of --total_steps "
                            f"{config.total_steps}; pass a larger --total_steps to train it further")
        load_state(model, checkpoint["model_state_dict"], checkpoint_path)
    actor_model = Net(observation_shape, num_actions, config.model, config.use_lstm, config.hidden_size)
    actor_model.load_state_dict(model.state_dict())
    actor_model.share_memory()
    actor_model.eval()
    evaluator = make_evaluator(config, run_dir, observation_shape, num_actions)

    device = select_device(config)
    if device.type == "cpu":
        # The actors keep num_actors cores busy; the learner gets the rest. Extra torch threads on busy
        # cores cost more CPU per update than they save (measured in BENCHMARKS.md).
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - config.num_actors))
    model = model.to(device)
    optimizer, scheduler = learner.make_optimizer(model, config)
    if checkpoint is not None:
        if "optimizer_state_dict" in checkpoint:  # model_best.tar holds weights only: the optimiser starts afresh
            load_state(optimizer, checkpoint["optimizer_state_dict"], checkpoint_path)
        scheduler = learner.make_schedule(optimizer, config, start_step=int(checkpoint["step"]))

    core_shapes = model.core_state_shapes()
    spec = BufferSpec(config.resolved_num_buffers, config.unroll_length, observation_shape, observation_dtype,
                      num_actions, core_shapes)
    buffers = create_buffers(spec)
    prepare_run_directory(run_dir)  # the last check; nothing in the directory changed before it

    step = int(checkpoint["step"]) if checkpoint is not None else 0
    session = write_run_files(config, run_dir, resuming)
    ctx = process_context()
    lives = ActorLives(config.seed, session)
    if checkpoint is not None:
        lives.load_state_dict(checkpoint)
    pool = LocalActorPool(config, ctx, buffers, actor_model, lives,
                          policy_version=int(checkpoint.get("updates", 0)) if checkpoint is not None else 0)
    runlog = RunLog(run_dir, purge_step=step if resuming else None)
    runlog.flags(config.to_dict(), step)
    run = Run(config, run_dir, device, model, actor_model, optimizer, scheduler, buffers, pool, ctx, runlog,
              step=step, start_step=step, saved_step=step if checkpoint is not None else None)
    run.amp = use_amp(config.amp, device, model.model)
    run.evaluator, run.resumed_from = evaluator, checkpoint_path
    # Compiled for the learner's fixed [T + 1, B] shape only; actors and central inference use the eager model.
    run.learner_model = torch.compile(model) if config.compile else model
    if config.inference == "central":
        run.inference = pool.inference = InferenceServer(model, buffers, pool.channels.inference_positions, device,
                                                         run.amp,
                                        config.inference_wait_ms / 1000,
                                        seed=sampling_seed(config.seed, session, INFERENCE_STREAM, 0))
    if checkpoint is not None:
        run.updates = int(checkpoint.get("updates", 0))
        run.skipped_updates = int(checkpoint.get("skipped_updates", 0))
        run.episodes = int(checkpoint.get("episodes", 0))
    return run


def load_state(target: Any, state: dict[str, Any], path: Path) -> None:
    """`target.load_state_dict(state)`, where a mismatch is the checkpoint's fault: a UserError naming it."""
    try:
        target.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"checkpoint {path} does not fit this run's {type(target).__name__}: "
                        f"{first_line[:300]}") from None


# ----------------------------------------------------------------------------------------- start


def start_actors(run: Run) -> None:
    run.pool.start()


def start_inference(run: Run) -> None:
    """--inference central: the thread that answers actors' requests for actions."""
    if run.inference is None:
        return
    run.inference_thread = threading.Thread(target=_inference_thread, args=(run,), name="inference", daemon=True)
    run.inference_thread.start()


def _inference_thread(run: Run) -> None:
    try:
        run.inference.serve(run.stop_inference)
    except Exception as exc:  # logged here with its traceback; the monitor stops the run
        log.exception("The inference thread failed")
        run.inference_error = exc


def start_learners(run: Run) -> None:
    for i in range(run.config.num_learner_threads):
        thread = threading.Thread(target=_learner_thread, args=(run,), name=f"learner-{i}", daemon=True)
        thread.start()
        run.learner_threads.append(thread)


def _take_full_slots(run: Run) -> list[int] | None:
    slots = []
    while len(slots) < run.config.batch_size:
        slot = run.pool.slots.take_full(timeout_s=0.2)
        if slot is not None:
            slots.append(slot)
        elif run.stop_learning.is_set():
            for slot in slots:  # give them back so a later run of this process could use them
                run.pool.slots.give_back(slot)
            return None
    return slots


def _learner_thread(run: Run) -> None:
    try:
        _learn(run)
    except Exception as exc:  # logged here with its traceback; the monitor stops the run
        log.exception("Learner thread %s failed", threading.current_thread().name)
        run.learner_errors.append(exc)
        run.stop_learning.set()


def _learn(run: Run) -> None:
    config = run.config
    staging = learner.BatchStaging(run.buffers, config.batch_size, pin=run.device.type == "cuda")
    while not run.stop_learning.is_set():
        wait_start = time.perf_counter()
        slots = _take_full_slots(run)
        if slots is None:
            return
        copy_start = time.perf_counter()
        staging.fill(run.buffers, slots)
        versions = run.buffers["policy_version"][slots].clone()
        for slot in slots:
            run.pool.slots.give_back(slot)
        batch, core_state = staging.to(run.device)
        copy_end = time.perf_counter()
        with run.update_lock:
            if run.step >= config.total_steps or run.stop_learning.is_set():
                return
            update_start = time.perf_counter()
            stats = learner.update(run.learner_model, run.optimizer, run.scheduler, batch, core_state, config,
                                   run.amp)
            # update() ends by reading its stats as floats, which waits for the device: on CUDA this phase
            # also holds the tail of the non-blocking host-to-device copy.
            publish_start = time.perf_counter()
            run.pool.publish(run.model, run.updates + 1)
            publish_end = time.perf_counter()
            run.step += config.steps_per_update
            run.updates += 1
            timings_s = {"wait_batch": copy_start - wait_start, "host_to_device": copy_end - copy_start,
                         "update_lock_wait": update_start - copy_end,
                         "forward_backward": publish_start - update_start, "publish": publish_end - publish_start}
            _record(run, stats, float((run.updates - 1 - versions).float().mean()), timings_s)


def _record(run: Run, stats: dict[str, float], policy_lag: float, timings_s: dict[str, float] | None = None) -> None:
    """Add one update's stats and phase times to the sums `_log_progress` averages. Caller holds `update_lock`."""
    for phase, seconds in (timings_s or {}).items():  # skipped updates took time too
        run.timing_sum_s[phase] += seconds
    run.timing_count += 1 if timings_s else 0
    if stats["skipped"]:
        run.skipped_updates += 1
        run.bad_updates_in_a_row += 1
        log.warning("Skipped a non-finite update at step %d (loss %s, grad norm %s)",
                    run.step, stats["total_loss"], stats["grad_norm"])
        if run.bad_updates_in_a_row >= run.config.max_bad_updates:
            run.learner_errors.append(TrainingError(
                f"{run.bad_updates_in_a_row} non-finite updates in a row; stopping with the last good "
                "checkpoint (try a lower --learning_rate or --grad_norm_clipping)"))
            run.stop_learning.set()
        return
    run.bad_updates_in_a_row = 0
    for key, value in stats.items():
        run.stats_sum[key] += value
    run.stats_count += 1
    run.policy_lag_sum += policy_lag
    run.last_stats = stats


# --------------------------------------------------------------------------------------- monitor


def monitor(run: Run) -> str:
    """Watch the run until it is done; returns why it ended. Raises TrainingError on a fault."""
    config = run.config
    last_log_time = last_checkpoint_time = start_time = time.monotonic()
    last_log_step = run.step
    while True:
        _check_threads(run)
        if run.step >= config.total_steps:
            _drain_episodes(run)  # the last games and a 100% progress line, at total_steps
            now = time.monotonic()
            _log_progress(run, max(now - last_log_time, 1e-3), run.step - last_log_step, now - start_time)
            return "finished"
        _drain_episodes(run)
        run.pool.check()
        _check_evaluator(run)
        now = time.monotonic()
        if now - last_log_time >= config.log_interval_s:
            _log_progress(run, now - last_log_time, run.step - last_log_step, now - start_time)
            last_log_time, last_log_step = now, run.step
        if now - last_checkpoint_time >= config.checkpoint_interval_s:
            _periodic_checkpoint(run)
            last_checkpoint_time = now
        time.sleep(0.05)


def _check_threads(run: Run) -> None:
    """Raise TrainingError when a learner or the inference thread died: without them actors wait forever
    (and keep beating their heartbeat while they wait for actions)."""
    if run.learner_errors:
        error = run.learner_errors[0]
        if isinstance(error, TrainingError):
            raise error
        raise TrainingError(f"learner thread failed: {error!r}") from error
    if run.inference_error is not None:
        error = run.inference_error
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise TrainingError(f"the central inference thread failed: {type(error).__name__}: {first_line}") from error


def _drain_episodes(run: Run) -> None:
    for episode_return, episode_length in run.pool.episodes():
        run.episode_returns.append(episode_return)
        run.episodes += 1
        run.runlog.scalar("charts/episodic_return", episode_return, run.step)
        run.runlog.scalar("charts/episodic_length", episode_length, run.step)


def _log_progress(run: Run, interval_s: float, interval_steps: int, elapsed_s: float) -> None:
    """Average what the learners recorded since the last call, write it against agent steps, print progress.

    Called by the monitor every `log_interval_s`; the sums are taken and reset under `update_lock`.
    """
    config = run.config
    step = run.step  # learners keep stepping while this runs: one value for every scalar below
    sps = interval_steps / interval_s
    mean_return = sum(run.episode_returns) / len(run.episode_returns) if run.episode_returns else float("nan")
    scalars = {"charts/SPS": sps, "charts/frames": step * _frames_per_step(config.env),
               "charts/episodes": run.episodes}
    if run.episode_returns:
        scalars["charts/mean_return_100"] = mean_return
    with run.update_lock:
        count, sums, lag = run.stats_count, dict(run.stats_sum), run.policy_lag_sum
        timing_count, timing_sums = run.timing_count, dict(run.timing_sum_s)
        run.stats_sum.clear()
        run.stats_count = 0
        run.policy_lag_sum = 0.0
        run.timing_sum_s.clear()
        run.timing_count = 0
    if count:
        for key in ("total_loss", "pg_loss", "baseline_loss", "entropy_loss"):
            scalars[f"losses/{key}"] = sums[key] / count
        scalars["charts/learning_rate"] = sums["learning_rate"] / count
        scalars["stats/grad_norm"] = sums["grad_norm"] / count
        scalars["stats/rho_mean"] = sums["rho_mean"] / count
        scalars["stats/rho_clipped_fraction"] = sums["rho_clipped_fraction"] / count
        scalars["stats/policy_lag"] = lag / count  # in learner updates
    scalars["stats/skipped_updates"] = run.skipped_updates
    scalars.update(_queue_sizes(run))
    if run.inference is not None and run.inference.batches:
        # Actors (env splits, with --env_splits) served per forward: 1 means no batching across them.
        scalars["stats/inference_actors_per_batch"] = run.inference.served / run.inference.batches
    for phase, seconds in timing_sums.items():
        scalars[f"timing/{phase}_ms"] = 1000.0 * seconds / timing_count  # mean per update
    run.runlog.scalars(step, scalars)
    log.info(progress_line(step, config.total_steps, sps, elapsed_s, mean_return, run.episodes), extra=STATUS)


@functools.cache
def _frames_per_step(env_id: str) -> int:
    """Env frames per agent step: the frame skip, 4 for Atari (see `environment.EnvBatch`), 1 otherwise."""
    return 4 if is_atari(env_id) else 1


def _queue_sizes(run: Run) -> dict[str, float]:
    """Slots waiting for a learner (full) and for an actor (free): which side is the bottleneck."""
    return {"stats/full_queue_size": run.pool.slots.full_size(), "stats/free_queue_size": run.pool.slots.free_size()}


def checkpoint(run: Run) -> None:
    """Save model, optimiser, schedule and counters; the copy is taken between two updates."""
    with run.update_lock:
        state = {
            "model_state_dict": {k: v.detach().cpu().clone() for k, v in run.model.state_dict().items()},
            "optimizer_state_dict": _to_cpu(run.optimizer.state_dict()),
            "step": run.step,
            "updates": run.updates,
            "skipped_updates": run.skipped_updates,
            "episodes": run.episodes,
            **run.pool.lives.state_dict(),
        }
    state.update(flags=run.config.to_dict(), model=run.model.model, observation_shape=list(run.model.observation_shape),
                 num_actions=run.model.num_actions)
    save_checkpoint(run.run_dir / CHECKPOINT_NAME, state)
    run.saved_step = state["step"]
    log.info("Saved checkpoint at step %d to %s", state["step"], run.run_dir / CHECKPOINT_NAME)
    _keep_step_copy(run, state["step"])


def _keep_step_copy(run: Run, step: int) -> None:
    """--keep_checkpoints: model.tar also as model_step_STEP.tar; a failure costs only the copy."""
    try:
        removed = keep_step_copy(run.run_dir / CHECKPOINT_NAME, step, run.config.keep_checkpoints)
    except OSError as exc:
        log.error("Could not keep a copy of the checkpoint at step %d: %s (model.tar is saved)", step, exc)
        return
    for path in removed:
        log.info("Removed %s (--keep_checkpoints %d)", path.name, run.config.keep_checkpoints)


def _periodic_checkpoint(run: Run) -> None:
    """A periodic save that fails (a full disk, an I/O error) does not end a run that may have days to go:
    it is reported and tried again at the next interval. The checkpoint on disk stays whole (atomic save)."""
    try:
        checkpoint(run)
    except OSError as exc:
        log.error("Could not save a checkpoint at step %d: %s. Training goes on (%s); next try in %.0f s",
                  run.step, exc, _last_saved(run), run.config.checkpoint_interval_s)


def _last_saved(run: Run) -> str:
    if run.saved_step is None:
        return "no checkpoint saved yet"
    return f"the one at step {run.saved_step} is intact"


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


# ------------------------------------------------------------------------------------ evaluation


def make_evaluator(config: Config, run_dir: Path, observation_shape: tuple[int, ...],
                   num_actions: int) -> Evaluator | None:
    """The evaluator's shared model and the best score so far (None without --eval_interval_s).

    Reads model_best.tar now, in `build`, so a damaged one is refused before anything is written.
    """
    if not config.eval_interval_s:
        return None
    model = Net(observation_shape, num_actions, config.model, config.use_lstm, config.hidden_size)
    model.share_memory()
    model.eval()
    return Evaluator(model, best_so_far(run_dir))


def start_evaluator(run: Run) -> None:
    """Start the evaluation process and log its pid; a no-op without --eval_interval_s."""
    evaluator = run.evaluator
    if evaluator is None or evaluator.disabled:
        return
    main_end, process_end = run.ctx.Pipe()
    process = run.ctx.Process(target=_evaluator_process, name="evaluator",
                              args=(os.getpid(), run.config, evaluator.model, process_end))
    process.start()
    process_end.close()  # only the evaluator holds its end, so its death reads as end-of-file here
    evaluator.process, evaluator.connection, evaluator.error_text = process, main_end, ""
    log.info("Evaluator started (pid %d): %d %s full games every %g s", process.pid, run.config.eval_episodes,
             run.config.eval_actions, run.config.eval_interval_s)


def _evaluator_process(main_pid: int, config: Config, model: Net, connection: Any) -> None:
    """The body of the evaluation process: die with the run, stay out of everyone's way, play (`evaluate`)."""
    die_with_main_process(main_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides when evaluation stops
    torch.set_num_threads(1)
    faulthandler.enable()
    with contextlib.suppress(OSError):
        os.nice(EVALUATOR_NICENESS)
    try:
        serve_evaluations(model, config, connection)
    except Exception:
        with contextlib.suppress(OSError):
            connection.send(("error", traceback.format_exc()))  # for the report of its death
        raise


def _check_evaluator(run: Run) -> None:
    """Take a finished evaluation, replace a dead evaluator, ask for the next evaluation when one is due."""
    evaluator = run.evaluator
    if evaluator is None or evaluator.disabled:
        return
    _receive_evaluation(run, evaluator)
    if not evaluator.process.is_alive():
        _replace_evaluator(run, evaluator)
    elif evaluator.pending is None and time.monotonic() - evaluator.last_request_s >= run.config.eval_interval_s:
        _request_evaluation(run, evaluator)


def _receive_evaluation(run: Run, evaluator: Evaluator) -> None:
    try:
        if not evaluator.connection.poll():
            return
        message = evaluator.connection.recv()
    except (EOFError, OSError):
        return  # it died: the liveness check reports it once the process is reaped
    if message[0] == "error":
        evaluator.error_text = message[1]
        return
    number, step, returns, cpu_s = message
    if evaluator.pending is None or number != evaluator.pending["number"]:
        log.warning("Ignoring an unexpected evaluation (number %s, step %s)", number, step)
        return
    pending, evaluator.pending = evaluator.pending, None
    _finish_evaluation(run, evaluator, {**pending, "cpu_s": cpu_s}, returns)


def _request_evaluation(run: Run, evaluator: Evaluator) -> None:
    """Copy the newest weights into the evaluator's model and ask for an evaluation of them.

    The copy is taken under `update_lock`, between two updates, as a checkpoint's is: the weights and the
    step recorded with them belong together. The learner waits at most for one copy of the weights.
    """
    with run.update_lock, torch.no_grad():
        for target, source in zip(evaluator.model.state_dict().values(), run.model.state_dict().values()):
            target.copy_(source)
        counters = {"step": run.step, "updates": run.updates, "episodes": run.episodes}
    evaluator.requested += 1
    evaluator.last_request_s = time.monotonic()
    try:
        evaluator.connection.send((evaluator.requested, counters["step"]))
    except OSError:
        return  # it died: the liveness check replaces it
    evaluator.pending = {"number": evaluator.requested, **counters}


def _finish_evaluation(run: Run, evaluator: Evaluator, pending: dict, returns: list[float]) -> None:
    """Log the evaluation against the step of the weights it played with; keep the agent if it is the best."""
    mean, std = statistics.fmean(returns), statistics.pstdev(returns)
    scalars = {"eval/episodic_return_mean": mean, "eval/episodic_return_std": std}
    if "cpu_s" in pending:  # what evaluation costs: CPU seconds per evaluation, against the eval interval
        scalars["eval/cpu_s"] = pending["cpu_s"]
    run.runlog.scalars(pending["step"], scalars)
    better = evaluator.best is None or mean > evaluator.best[0]
    log.info("Evaluation at step %d: mean return %.2f (std %.2f, %d games, %.2f CPU s)%s", pending["step"], mean,
             std, len(returns), pending.get("cpu_s", float("nan")),
             "" if better else f"; the best is {evaluator.best[0]:.2f} at step {evaluator.best[1]}")
    if better:
        _save_best(run, evaluator, pending, returns)


def _save_best(run: Run, evaluator: Evaluator, pending: dict, returns: list[float]) -> None:
    """Write model_best.tar (atomically, as model.tar) and record it in meta.json. A failed write is reported
    and training goes on; the best stays the previous one, so the next better evaluation tries again."""
    mean, std = statistics.fmean(returns), statistics.pstdev(returns)
    state = {
        "model_state_dict": {k: v.detach().clone() for k, v in evaluator.model.state_dict().items()},
        "step": pending["step"], "updates": pending["updates"], "episodes": pending["episodes"],
        "eval_return_mean": mean, "eval_return_std": std, "eval_returns": list(returns),
        "eval_actions": run.config.eval_actions, "flags": run.config.to_dict(), "model": run.model.model,
        "observation_shape": list(run.model.observation_shape), "num_actions": run.model.num_actions,
    }
    path = run.run_dir / BEST_CHECKPOINT_NAME
    try:
        save_checkpoint(path, state)
        record_best(run.run_dir, {"step": pending["step"], "episodic_return_mean": mean,
                                  "episodic_return_std": std, "episodes": len(returns),
                                  "actions": run.config.eval_actions, "checkpoint": BEST_CHECKPOINT_NAME})
    except OSError as exc:
        log.error("Could not save the best agent (step %d, mean return %.2f) to %s: %s; training goes on",
                  pending["step"], mean, path, exc)
        return
    evaluator.best = (mean, pending["step"])
    log.info("New best evaluation: mean return %.2f at step %d, saved to %s", mean, pending["step"], path)


def _replace_evaluator(run: Run, evaluator: Evaluator) -> None:
    """Report a dead evaluator and start another; evaluators that keep dying end evaluation, never training."""
    process = evaluator.process
    process.join()
    evaluator.connection.close()
    lost = f"the evaluation of step {evaluator.pending['step']} is lost" if evaluator.pending else "no evaluation lost"
    detail = evaluator.error_text.strip()
    log.error("Evaluator (pid %d) died: %s; %s, training goes on%s", process.pid,
              exit_description(process.exitcode), lost, f"\n{detail}" if detail else "")
    now = time.monotonic()
    evaluator.pending, evaluator.last_request_s = None, now
    evaluator.deaths = [t for t in evaluator.deaths if now - t < RESTART_WINDOW_S] + [now]
    if len(evaluator.deaths) > run.config.max_actor_restarts:
        evaluator.disabled = True
        log.error("The evaluator died %d times within %.0f s (--max_actor_restarts %d): no more evaluations "
                  "in this run; training goes on", len(evaluator.deaths), RESTART_WINDOW_S,
                  run.config.max_actor_restarts)
        return
    start_evaluator(run)
    log.warning("Restarted the evaluator (%d deaths in the last %.0f s)", len(evaluator.deaths), RESTART_WINDOW_S)


def _stop_evaluator(run: Run) -> None:
    """Stop the evaluation process. An evaluation that finished is logged; one still playing is dropped
    (a full game can take minutes: shutdown does not wait for it)."""
    evaluator = run.evaluator
    if evaluator is None or evaluator.process is None:
        return
    if not evaluator.disabled:
        _receive_evaluation(run, evaluator)
    process = evaluator.process
    evaluator.connection.close()
    if process.is_alive():
        process.terminate()
        process.join(timeout=ACTOR_JOIN_TIMEOUT_S)
    if process.is_alive():
        process.kill()
    process.join()


def _log_resume_details(run: Run) -> None:
    if run.resumed_from is not None and run.resumed_from.name != CHECKPOINT_NAME:
        log.info("Resumed from %s%s", run.resumed_from, "" if run.optimizer.state else
                 " (it holds no optimiser state: the optimiser starts afresh)")
    if run.evaluator is not None and run.evaluator.best is not None:
        log.info("Best evaluation so far: mean return %.2f at step %d (%s); only a better one replaces it",
                 *run.evaluator.best, BEST_CHECKPOINT_NAME)


# -------------------------------------------------------------------------------------- shutdown


def shutdown(run: Run, save: bool) -> None:
    """Stop acting and learning, save, close: the one ordered path for every way a run ends.

    Bounded in time (learners LEARNER_JOIN_TIMEOUT_S, actors ACTOR_JOIN_TIMEOUT_S, then terminate and
    kill); on return no actor process, fork server or queue thread of the run is left.
    """
    run.pool.channels.stop_event.set()
    run.stop_learning.set()
    deadline = time.monotonic() + LEARNER_JOIN_TIMEOUT_S
    for thread in run.learner_threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    try:
        run.pool.stop(functools.partial(_drain_episodes, run))
        _stop_evaluator(run)
        run.stop_inference.set()
        if run.inference_thread is not None:
            run.inference_thread.join(timeout=LEARNER_JOIN_TIMEOUT_S)
        if save:
            try:
                checkpoint(run)  # waits for a learner still inside an update: it holds update_lock
            except OSError as exc:
                run.final_save_error = exc
                log.error("Could not save the final checkpoint at step %d: %s (%s)", run.step, exc, _last_saved(run))
    finally:
        run.runlog.close()
        run.pool.close()


class _Terminated(Exception):
    pass


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated()


@contextlib.contextmanager
def _signals_ignored() -> Any:
    """Ctrl-C and SIGTERM do nothing inside: a second one must not cut the (bounded) shutdown short."""
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def train(config: Config) -> Path:
    """Train until `total_steps`; every ending goes through `shutdown`. Call from the main thread.

    Returns the run directory when the run finished. Raises `Stopped` after an orderly stop on Ctrl-C or
    SIGTERM (a final checkpoint written), `TrainingError` when the run itself failed (actors dying too
    often, non-finite updates; the last good checkpoint kept), and `UserError` for bad input, before
    anything in the run directory has changed.
    """
    keep_freed_memory()
    previous_handler = signal.signal(signal.SIGTERM, _raise_terminated)
    # Ctrl-C must stop the run in order even when this process was started with SIGINT ignored
    # (inherited from a shell's background job or a parent process).
    previous_interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        try:
            run = build(config)
        except _Terminated:
            raise Stopped("terminated", signal.SIGTERM) from None
        return _run(run)
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        signal.signal(signal.SIGINT, previous_interrupt)


def _run(run: Run) -> Path:
    config = run.config
    setup_console(run.run_dir / "out.log")
    reason = "error"
    try:
        log.info("Run %s: %s, %d actors x %d envs, T=%d, B=%d, device %s%s", run.run_dir, config.env,
                 config.num_actors, config.envs_per_actor, config.unroll_length, config.batch_size, run.device,
                 ", bfloat16 autocast" if run.amp else "")
        if run.start_step:
            log.info("Resuming from step %d (update %d)", run.start_step, run.updates)
        _log_resume_details(run)
        start_inference(run)
        start_actors(run)
        start_learners(run)
        start_evaluator(run)
        reason = monitor(run)
    except KeyboardInterrupt:
        reason = "interrupted"
        log.info("Interrupted: stopping")
    except _Terminated:
        reason = "terminated"
        log.info("SIGTERM: stopping")
    except BaseException as exc:
        log.error("Stopping: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise
    finally:
        try:
            with _signals_ignored():
                # A numerical failure keeps the last good checkpoint; any other ending saves the current state.
                shutdown(run, save=not run.learner_errors)
                try:
                    finish_run_files(run.run_dir, reason, run.step)
                except OSError as exc:
                    log.error("Could not record the end of the run in %s: %s", run.run_dir, exc)
                log.info("Run ended (%s) at step %d in %s", reason, run.step, run.run_dir)
        finally:
            close_console()
    if run.final_save_error is not None:
        raise TrainingError(f"could not save the final checkpoint to {run.run_dir / CHECKPOINT_NAME}: "
                            f"{run.final_save_error} ({_last_saved(run)})")
    if reason == "interrupted":
        raise Stopped(reason, signal.SIGINT)
    if reason == "terminated":
        raise Stopped(reason, signal.SIGTERM)
    return run.run_dir
