"""The evaluation process while training (--eval_interval_s): start, ask for an evaluation of the newest
weights, take its result, keep the best agent in model_best.tar, replace it when it dies, stop it.

Only the monitor thread calls these. The games themselves are `evaluate.serve_evaluations`'s.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from impala.actor_pool import (
    OomKills,
    RecentDeaths,
    die_with_main_process,
    end_if_lost,
    exit_description,
    leave_stop_signals_to_main_process,
    open_pidfd,
    prefer_for_the_oom_killer,
    start_process,
)
from impala.checkpoint import (
    BEST_CHECKPOINT_NAME,
    best_checkpoint,
    best_eval_actions,
    best_so_far,
    header,
    keep_other_best,
    kept_best,
    save_checkpoint,
)
from impala.config import Config, UserError
from impala.evaluate import Games, serve_evaluations
from impala.learner import LearnerState
from impala.metrics import RunLog
from impala.model import Net
from impala.rundir import record_best
from impala.seeding import ActorLives

if TYPE_CHECKING:
    from impala.distributed import Coordinator

log = logging.getLogger("impala")

EVALUATOR_NICENESS = 19  # evaluation plays with the CPU time actors and learners leave; it is never in their way
KILLED_JOIN_TIMEOUT_S = 5.0  # how long stopping waits for the killed evaluation process to end
FINAL_EVALUATION_POLL_S = 0.05  # how often the wait for the final weights' evaluation looks at the evaluator
FINAL_EVALUATION_MAX_S = 1800.0  # the longest a finished run waits for it (an env that hangs, --actor_timeout_s 0)


@dataclass
class Evaluator:
    """The evaluation process (--eval_interval_s > 0) and what the monitor knows of it.

    Only the monitor thread uses it. The monitor writes the newest weights into `model`, a shared CPU copy,
    only while no evaluation is pending, and the evaluation process reads it only while one is: no lock.
    """

    model: Net
    # (mean return, agent step) of the best evaluation with this session's --eval_actions (`best_checkpoint`)
    best: tuple[float, int] | None
    best_actions: str | None = None  # the --eval_actions model_best.tar records (greedy or sampled; None: unsaid)
    process: Any = None  # its multiprocessing.Process
    pidfd: int | None = None  # a pidfd of `process` (Linux 5.3+), to tell its end from the fork server's
    connection: Connection | None = None  # the main end of the pipe to `process`
    pending: dict | None = None  # the request's number and the counters and lives of the weights being evaluated
    last_request_s: float = field(default_factory=time.monotonic)
    error_text: str = ""  # the traceback a failing evaluator sent before it died
    deaths: RecentDeaths = field(default_factory=RecentDeaths)
    oom_kills: OomKills = field(default_factory=OomKills)  # tells a death for want of memory from another SIGKILL
    disabled: bool = False
    finished: int = 0  # evaluations received in this session
    evaluated_step: int | None = None  # the step of the weights the last evaluation received played
    ctx: BaseContext | None = None  # the run's multiprocessing context, which starts `process`
    heartbeat: Any = None  # shared double: time.monotonic() of the evaluator's last sign of progress
    last_hang_check_s: float = field(default_factory=time.monotonic)


class WholeWeights(Protocol):
    """Whether the learner's weights may be copied (`learners.Learners`)."""

    def weights_whole(self) -> bool: ...


class EvaluatedRun(Protocol):
    """What of a run the evaluator needs (`training.Run`)."""

    config: Config
    run_dir: Path
    runlog: RunLog
    state: LearnerState
    update_lock: threading.Lock
    evaluator: Evaluator | None
    coordinator: Coordinator | None
    resumed_step: int | None

    @property
    def learners(self) -> WholeWeights: ...


def make_evaluator(config: Config, run_dir: Path, observation_shape: tuple[int, ...], num_actions: int,
                   ctx: BaseContext) -> Evaluator | None:
    """The evaluator's shared model and the best score so far (None without --eval_interval_s).

    Reads the best checkpoint now, in `build`, so a damaged one is refused before anything is written.
    """
    if not config.eval_interval_s:
        return None
    model = Net(observation_shape, num_actions, config.model, config.use_lstm, config.hidden_size)
    model.share_memory()
    model.eval()
    best = best_so_far(best_checkpoint(run_dir, config.eval_actions))
    return Evaluator(model, best, best_eval_actions(run_dir / BEST_CHECKPOINT_NAME), ctx=ctx,
                     heartbeat=ctx.Value("d", time.monotonic(), lock=False))


def _pipe(evaluator: Evaluator) -> Connection:
    assert evaluator.connection is not None, "started"
    return evaluator.connection


def start_evaluator(run: EvaluatedRun) -> None:
    """Start the evaluation process and log its pid; a no-op without --eval_interval_s."""
    evaluator = run.evaluator
    if evaluator is None or evaluator.disabled:
        return
    ctx: Any = evaluator.ctx  # Process and Pipe are on the concrete contexts only
    main_end, process_end = ctx.Pipe()
    process = ctx.Process(target=_evaluator_process, name="evaluator",
                          args=(os.getpid(), run.config, evaluator.model, process_end, evaluator.heartbeat))
    start_process(process)
    process_end.close()  # only the evaluator holds its end, so its death reads as end-of-file here
    _close_pidfd(evaluator)
    evaluator.process, evaluator.connection, evaluator.error_text = process, main_end, ""
    evaluator.pidfd = open_pidfd(process.pid)
    log.info("Evaluator started (pid %d): %d %s full games every %g s", process.pid, run.config.eval_episodes,
             run.config.eval_actions, run.config.eval_interval_s)


def _evaluator_process(main_pid: int, config: Config, model: Net, connection: Connection, heartbeat: Any) -> None:
    """The body of the evaluation process: die with the run, stay out of everyone's way, play (`evaluate`)."""
    die_with_main_process(main_pid)
    leave_stop_signals_to_main_process()  # the main process decides when evaluation stops
    torch.set_num_threads(1)
    faulthandler.enable()
    with contextlib.suppress(OSError):
        os.nice(EVALUATOR_NICENESS)
    prefer_for_the_oom_killer()
    try:
        serve_evaluations(model, config, connection, heartbeat)
    except Exception:  # noqa: BLE001 - reported below
        # For the report of its death, which shows it. Printed here too (multiprocessing's default for an exception),
        # the traceback would show twice on the console; here only when it cannot reach the main process.
        text = traceback.format_exc()
        try:
            connection.send(("error", text))
        except OSError:
            sys.stderr.write(text)
        sys.exit(1)


def check_evaluator(run: EvaluatedRun) -> None:
    """Take a finished evaluation, replace a dead evaluator, ask for the next evaluation when one is due."""
    evaluator = run.evaluator
    if evaluator is None or evaluator.disabled:
        return
    _receive_evaluation(run, evaluator)
    _kill_if_hung(run, evaluator)
    evaluator.oom_kills.look()
    if not evaluator.process.is_alive():
        replace_evaluator(run, evaluator)
    elif (evaluator.pending is None and time.monotonic() - evaluator.last_request_s >= run.config.eval_interval_s
          and run.state.step != run.resumed_step):  # the weights a resumed run's logs may have evaluated already
        _request_evaluation(run, evaluator)


def _receive_evaluation(run: EvaluatedRun, evaluator: Evaluator) -> None:
    try:
        if not _pipe(evaluator).poll():
            return
        message = _pipe(evaluator).recv()
    except (EOFError, OSError):
        return  # it died: the liveness check reports it once the process is reaped
    if message[0] == "error":
        evaluator.error_text = message[1]
        return
    number, step, games, cpu_s = message
    if evaluator.pending is None or number != evaluator.pending["number"]:
        log.warning("Ignoring an unexpected evaluation (number %s, step %s)", number, step)
        return
    pending, evaluator.pending = evaluator.pending, None
    finish_evaluation(run, evaluator, {**pending, "cpu_s": cpu_s}, games)


def _kill_if_hung(run: EvaluatedRun, evaluator: Evaluator) -> None:
    """Kill an evaluator that made no progress in an evaluation for --actor_timeout_s (its env stuck in a step),
    as a hung actor is: `check_evaluator` then replaces it like one that died. Otherwise no evaluation would
    ever be reported again, and nothing would say why."""
    timeout_s = run.config.actor_timeout_s
    now = time.monotonic()
    monitor_gap_s, evaluator.last_hang_check_s = now - evaluator.last_hang_check_s, now
    if not timeout_s or evaluator.pending is None or evaluator.heartbeat is None:
        return
    if monitor_gap_s > timeout_s / 2:  # this process was stopped too (Ctrl-Z): the silence is not the evaluator's
        evaluator.heartbeat.value = now
        return
    silent_s = now - evaluator.heartbeat.value
    process = evaluator.process
    if silent_s > timeout_s and process.is_alive():
        log.error("Evaluator (pid %d) made no progress for %.0f s in the evaluation of step %d (--actor_timeout_s %g); "
                  "killing it", process.pid, silent_s, evaluator.pending["step"], timeout_s)
        evaluator.oom_kills.killed_here(process.pid)
        process.kill()
        process.join(timeout=5)
        evaluator.heartbeat.value = now  # one report per timeout if even SIGKILL does not end it


def _request_evaluation(run: EvaluatedRun, evaluator: Evaluator) -> None:
    """Copy the newest weights into the evaluator's model and ask for an evaluation of them.

    The copy is taken under `update_lock`, between two updates, as a checkpoint's is: the weights and the
    step recorded with them belong together. The learner waits at most for one copy of the weights. Weights an
    update that failed may have torn are not copied: the run ends on that failure, and such weights never become
    model_best.tar.
    """
    with run.update_lock, torch.no_grad():
        if not run.learners.weights_whole():
            return
        for target, source in zip(evaluator.model.state_dict().values(), run.state.model.state_dict().values()):
            target.copy_(source)
        # In the checkpoint: a resumed run's evaluations play games of their own.
        seeds_from = run.state.eval_seeds_used
        run.state.evaluations += 1
        run.state.eval_seeds_used += run.config.eval_episodes
        counters = run.state.counters()  # with the weights: model_best.tar saves them
    if run.coordinator is not None:  # the other ranks' actor lives too, as in a checkpoint
        counters = run.coordinator.run_wide_lives(counters)
    number = counters["evaluations"]
    evaluator.last_request_s = time.monotonic()
    if evaluator.heartbeat is not None:
        evaluator.heartbeat.value = evaluator.last_request_s  # the time it waited for this request is not a hang
    try:
        _pipe(evaluator).send((number, counters["step"], seeds_from))
    except OSError:
        return  # it died: the liveness check replaces it
    evaluator.pending = {"number": number, **counters}


def finish_evaluation(run: EvaluatedRun, evaluator: Evaluator, pending: dict, games: Games) -> None:
    """Log the evaluation against the step of the weights it played with; keep the agent if it is the best.

    Its games' mean length and how many a time limit cut are logged too: a policy that stalls plays every
    game to the limit, and its return alone does not show it.
    """
    evaluator.finished += 1
    evaluator.evaluated_step = pending["step"]
    returns = games.returns
    mean, std = statistics.fmean(returns), statistics.pstdev(returns)
    scalars = {"eval/episodic_return_mean": mean, "eval/episodic_return_std": std,
               "eval/episode_length_mean": statistics.fmean(games.lengths), "eval/games_cut": float(sum(games.cut))}
    if "cpu_s" in pending:  # what evaluation costs: CPU seconds per evaluation, against the eval interval
        scalars["eval/cpu_s"] = pending["cpu_s"]
    run.runlog.scalars(pending["step"], scalars)
    best = evaluator.best
    better = best is None or mean > best[0]
    log.info("Evaluation at step %d: mean return %.2f (std %.2f, %d games, %.2f CPU s)%s. %s", pending["step"], mean,
             std, len(returns), pending.get("cpu_s", float("nan")),
             "" if best is None or better else f"; the best is {best[0]:.2f} at step {best[1]}", games.summary())
    if better:
        _save_best(run, evaluator, pending, returns)


def _save_best(run: EvaluatedRun, evaluator: Evaluator, pending: dict, returns: list[float]) -> None:
    """Write model_best.tar (atomically, as model.tar) and record it in meta.json. A failed write is reported
    and training goes on; the best stays the one in model_best.tar, so the next better evaluation tries again and
    no worse one replaces it (a failed meta.json leaves the new best in model_best.tar: it is the best).

    A model_best.tar of evaluations with the other --eval_actions is kept first as model_best_ACTIONS.tar, and the
    one of this session's actions kept that way before (`best_checkpoint`), which the new best beat, is deleted."""
    mean, std = statistics.fmean(returns), statistics.pstdev(returns)
    state = {
        "model_state_dict": {k: v.detach().clone() for k, v in evaluator.model.state_dict().items()},
        # Counters and lives as a checkpoint of that step has them: resumed from, its actors play lives of their own.
        **{key: value for key, value in pending.items() if key in (*LearnerState.COUNTERS, *ActorLives.KEYS)},
        "eval_return_mean": mean, "eval_return_std": std, "eval_returns": list(returns),
        "eval_actions": run.config.eval_actions, **header(run.config, evaluator.model),
    }
    path = run.run_dir / BEST_CHECKPOINT_NAME
    actions, other, kept_aside = run.config.eval_actions, evaluator.best_actions, None
    if other is not None and other != actions:
        try:
            kept = keep_other_best(run.run_dir, other)
        except OSError as exc:
            log.error("Could not keep %s, the best of %s evaluations, aside to save the best of %s ones (step %d, "
                      "mean return %.2f): %s; training goes on", path, evaluator.best_actions, actions,
                      pending["step"], mean, exc)
            return
        log.info("Kept %s, the best of %s evaluations, as %s", path.name, evaluator.best_actions, kept.name)
        evaluator.best_actions, kept_aside = None, (other, kept.name)
    before = _inode(path)
    try:
        save_checkpoint(path, state)
    except OSError as exc:
        if _inode(path) != before:  # renamed into place before the error (the directory's sync): it is the best
            evaluator.best, evaluator.best_actions = (mean, pending["step"]), actions
        log.error("Could not save the best agent (step %d, mean return %.2f) to %s: %s; training goes on",
                  pending["step"], mean, path, exc)
        return
    evaluator.best, evaluator.best_actions = (mean, pending["step"]), actions
    log.info("New best evaluation: mean return %.2f at step %d, saved to %s", mean, pending["step"], path)
    _delete_beaten(kept_best(run.run_dir, actions), mean)
    try:
        record_best(run.run_dir, {"step": pending["step"], "episodic_return_mean": mean,
                                  "episodic_return_std": std, "episodes": len(returns),
                                  "actions": run.config.eval_actions, "checkpoint": BEST_CHECKPOINT_NAME}, kept_aside)
    except OSError as exc:
        log.error("Could not record the best agent in %s: %s (it is saved in %s)", run.run_dir / "meta.json", exc,
                  path)


def _delete_beaten(kept: Path, mean: float) -> None:
    """Delete `kept`, a best of this session's --eval_actions kept aside (`keep_other_best`), now that model_best.tar
    holds a better one of the same actions; a failure is reported (model_best.tar is the best all the same)."""
    try:
        beaten = best_so_far(kept)
        if beaten is None or beaten[0] >= mean:
            return
        kept.unlink()
    except (OSError, UserError) as exc:
        log.error("Could not delete %s, beaten by model_best.tar: %s", kept, exc)
        return
    log.info("Deleted %s (mean return %.2f at step %d): the new best beat it", kept.name, *beaten)


def _inode(path: Path) -> int | None:
    """Which file `path` is (None where there is none): a rename into place makes it another."""
    try:
        return path.stat().st_ino
    except OSError:
        return None


def replace_evaluator(run: EvaluatedRun, evaluator: Evaluator) -> None:
    """Report a dead evaluator and start another; evaluators that keep dying end evaluation, never training."""
    process = evaluator.process
    process.join()
    end_if_lost(evaluator.pidfd, process, "The evaluator", "killing it before its replacement starts")
    _pipe(evaluator).close()
    lost = f"the evaluation of step {evaluator.pending['step']} is lost" if evaluator.pending else "no evaluation lost"
    detail = evaluator.error_text.strip()
    how = exit_description(process.exitcode, evaluator.oom_kills, process.pid)
    log.error("Evaluator (pid %d) died: %s; %s, training goes on%s", process.pid, how, lost,
              f"\n{detail}" if detail else "")
    evaluator.pending, evaluator.last_request_s = None, time.monotonic()
    deaths = evaluator.deaths.add(evaluator.finished)  # an evaluation finished since the last death: progress
    if deaths > run.config.max_actor_restarts:
        evaluator.disabled = True
        log.error("The evaluator died %d times %s (--max_actor_restarts %d): no more evaluations in this run; "
                  "training goes on", deaths, evaluator.deaths.span(), run.config.max_actor_restarts)
        return
    start_evaluator(run)
    log.warning("Restarted the evaluator (%d deaths %s)", deaths, evaluator.deaths.span())


def evaluate_final_weights(run: EvaluatedRun, stopped: Callable[[], bool]) -> None:
    """At the end of a run that reached --total_steps, with its actors and learners stopped: evaluate its final
    weights (those of its final checkpoint) too, and keep them as model_best.tar if they are the best; else up to
    --eval_interval_s of the end of training was never a candidate. The evaluation in flight is waited for first
    (the evaluator plays one at a time). `stopped()` true (Ctrl-C, SIGTERM), the evaluator dead or killed as hung
    (--actor_timeout_s), or FINAL_EVALUATION_MAX_S passed, ends the wait: what was not played is dropped, as at
    any stop."""
    evaluator = run.evaluator
    if evaluator is None or evaluator.disabled or evaluator.process is None:
        return
    step, deadline = run.state.step, time.monotonic() + FINAL_EVALUATION_MAX_S
    if not _wait_for_evaluation(run, evaluator, stopped, deadline) or step in (evaluator.evaluated_step,
                                                                                run.resumed_step):
        return
    log.info("Evaluating the final weights (step %d): %d games (Ctrl-C skips it)", step, run.config.eval_episodes)
    _request_evaluation(run, evaluator)
    if _wait_for_evaluation(run, evaluator, stopped, deadline):
        return
    if stopped():
        log.info("The evaluation of the final weights is skipped: a stop was asked for (the run has finished)")
    elif time.monotonic() >= deadline:
        log.warning("The evaluation of the final weights took more than %.0f s: left unfinished",
                    FINAL_EVALUATION_MAX_S)


def _wait_for_evaluation(run: EvaluatedRun, evaluator: Evaluator, stopped: Callable[[], bool],
                         deadline: float) -> bool:
    """Wait until no evaluation is pending (its result taken); False where the wait ended otherwise."""
    while evaluator.pending is not None:
        if stopped() or not evaluator.process.is_alive() or time.monotonic() >= deadline:
            return False
        _receive_evaluation(run, evaluator)
        _kill_if_hung(run, evaluator)
        time.sleep(FINAL_EVALUATION_POLL_S)
    return evaluator.process.is_alive()


def stop_evaluator(run: EvaluatedRun) -> None:
    """Stop the evaluation process. An evaluation that finished is logged; one still playing is dropped
    (a full game can take minutes: shutdown does not wait for it). Killed: it ignores SIGTERM, and has
    nothing to save."""
    evaluator = run.evaluator
    if evaluator is None or evaluator.process is None:
        return
    process = evaluator.process
    try:
        if not evaluator.disabled:
            _receive_evaluation(run, evaluator)
    finally:
        _pipe(evaluator).close()
        if process.is_alive():
            process.kill()
        process.join(timeout=KILLED_JOIN_TIMEOUT_S)
        if process.is_alive():  # in the kernel's uninterruptible sleep: not waited on
            log.warning("The evaluation process (pid %d) did not end after SIGKILL; leaving it", process.pid)
        end_if_lost(evaluator.pidfd, process, "The evaluator", "killing it")
        _close_pidfd(evaluator)


def _close_pidfd(evaluator: Evaluator) -> None:
    if evaluator.pidfd is not None:
        os.close(evaluator.pidfd)
        evaluator.pidfd = None


