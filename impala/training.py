"""A training run: build, start, monitor, shut down. The actor processes are made in `actor_pool.py`, the
evaluation process in `evaluator.py`, the learner threads in `learners.py`; the central inference threads here.

    main thread: build() -> start_inference() -> start_actors() -> start_learners() -> start_evaluator()
                 -> monitor() -> shutdown()   (central inference serves before the first actor asks)
    actor processes (actor_pool.py): actor.run_actor(), filling slots from their own free pipe into the full queue
    learner threads: take batch_size full slots, update, publish weights through the actor pool
    evaluation process (--eval_interval_s, evaluator.py): full games with a weights snapshot

Ctrl-C, SIGTERM and SIGHUP are recorded (`stopping.py`), never raised: `train` and the monitor read them and stop
in order through `shutdown`; children ignore them (`actor_pool.start_process`). Under torchrun every rank
runs all of this, in lockstep with the others (`distributed.py`); rank 0 alone writes the run directory.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import resource
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any, NoReturn

import torch

from impala import distributed, learner, ray_pool
from impala.actor_pool import (
    LocalActorPool,
    finish_within,
    keep_freed_memory,
    process_context,
    start_fork_server,
    stop_fork_server,
)
from impala.buffers import (
    LOWER_LOCAL_SLOTS,
    LOWER_REMOTE_SLOTS,
    Buffers,
    BufferSpec,
    create_buffers,
    usable_memory,
)
from impala.checkpoint import (
    BEST_CHECKPOINT_NAME,
    CHECKPOINT_NAME,
    best_checkpoint,
    header,
    keep_step_copy,
    save_checkpoint,
)
from impala.config import (
    Config,
    TrainingError,
    UserError,
    changed_flags,
    cpu_quota,
    first_line,
    usable_cores,
)
from impala.distributed import Coordinator
from impala.environment import is_atari, probe_env
from impala.evaluator import (
    Evaluator,
    check_evaluator,
    evaluate_final_weights,
    make_evaluator,
    start_evaluator,
    stop_evaluator,
)
from impala.inference import InferenceServer, InferenceServers
from impala.learner import LearnerState
from impala.learners import Learners, learner_torch_threads, select_device
from impala.metrics import (
    STATUS,
    IntervalStats,
    RecentRate,
    RunLog,
    close_console,
    progress_line,
    setup_console,
)
from impala.model import Net, use_amp
from impala.ray_pool import RayActorPool, require_ray
from impala.rundir import (
    LOG_NAME,
    DirectoryLock,
    NameTaken,
    finish_run_files,
    is_own_checkpoint,
    keep_replaced_checkpoint,
    open_run,
    prepare_run_directory,
    record_checkpoint,
    record_start,
    remake_run_directory,
    remove_if_empty,
    replaces_own_checkpoint,
    write_run_files,
)
from impala.seeding import INFERENCE_STREAM, ActorLives, sampling_seed
from impala.slots import check_pipes_hold
from impala.stopping import StopRequests, stop_requests

log = logging.getLogger("impala")

LEARNER_JOIN_TIMEOUT_S = 10.0  # a learner in the middle of an update finishes it; the checkpoint waits for it
END_CLOSE_TIMEOUT_S = 30.0  # each close after the final checkpoint (the fork server's stop alone may take 20 s)
# The policy lag (stats/policy_lag) at which the defaults learned Pong: 3.5 with 14 actors x 8 envs, B=32, on 16
# cores (2.0 on 2); at 4.9 an earlier rule did not (RESULTS.md). More is untried, so a run set up for more is told.
MEASURED_POLICY_LAG = 3.5
NAME_ATTEMPTS = 10  # builds of a run named by default, each under the next free name, before giving up


@dataclass
class CentralInference:
    """--inference central: the servers, the threads that run them (one each, --inference_threads) and why the
    first of them to die died (the monitor reads `error` and stops the run)."""

    servers: InferenceServers
    threads: list[threading.Thread] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


@dataclass
class Run:
    """Everything the stages of a run share. Set by `build` and never replaced, except where a field says so."""

    config: Config
    run_dir: Path
    device: torch.device
    state: LearnerState  # model, optimiser, schedule, counters: learners change it under `update_lock`
    buffers: Buffers  # the shared-memory slots
    pool: LocalActorPool | RayActorPool  # the actors; learners take full slots from `pool.slots`, publish through it
    runlog: RunLog  # TensorBoard and CSV; the monitor's alone
    learners: Learners  # the learner threads
    amp: bool = False  # bfloat16 autocast in the learner and central inference
    inference: CentralInference | None = None  # --inference central
    evaluator: Evaluator | None = None  # --eval_interval_s > 0; the monitor's alone
    resumed_from: Path | None = None  # the checkpoint this session started from
    changed_flags: tuple[str, ...] = ()  # flags of this session other than those of the checkpoint it resumes
    saved_step: int | None = None  # the step of the newest checkpoint on disk; written by whoever saves
    # The step a resumed run's session started from: the earlier sessions' logs at that step are kept, so this one
    # logs no progress row and asks for no evaluation there (the same weights), only once its learner moved on.
    resumed_step: int | None = None
    stats: IntervalStats = field(default_factory=IntervalStats)  # learners add under `update_lock`
    update_lock: threading.Lock = field(default_factory=threading.Lock)  # one update, or one copy of the weights
    coordinator: Coordinator | None = None  # under torchrun: this rank among the learner processes
    stop: StopRequests = field(default_factory=StopRequests)  # a Ctrl-C or SIGTERM; the monitor reads it
    # When the program started (time.monotonic(), given to `train` by run.py): the progress line's elapsed time
    # counts from it, start-up included; None, from the monitor's start.
    started_s: float | None = None
    lock: DirectoryLock | None = None  # the training's hold on `run_dir`, taken again on a directory made again

    @property
    def writes_files(self) -> bool:
        """Whether this process writes the run directory, TensorBoard and checkpoints: rank 0 under torchrun."""
        return self.coordinator is None or self.coordinator.rank == 0


# ----------------------------------------------------------------------------------------- build


def build(config: Config, coordinator: Coordinator | None = None, stop: StopRequests | None = None,
          lock: DirectoryLock | None = None) -> Run:
    """Everything a run needs, with no actor or thread started yet: only the fork server, which `train` stops
    again when the build fails.

    Every check a user can fail (env id, model, checkpoint, shared memory, savedir) comes before the
    first file is written, so a refused run leaves an existing run directory exactly as it was; so does
    a Ctrl-C or SIGTERM that came before then (`Stopped`). Under torchrun only rank 0 opens the run
    directory; the others take its state (`Coordinator.share_state`). `lock` is taken on the run directory
    before its checkpoint is read (or once it is made), for the caller to release when the run has ended.
    """
    stop = stop if stop is not None else StopRequests()
    if config.ray:
        require_ray()  # before anything is written
    check_actors_fit(config)
    if config.compile:
        learner.check_compiler(coordinator.ranks.device if coordinator is not None else select_device(config))
    allow_process_limits(config)  # before the fork server: the actors' processes inherit the limits
    observation_shape, observation_dtype, num_actions = probe_env(config.env, config.seed)
    torch.manual_seed(config.seed)
    try:
        with torch.device("meta"):  # its shapes alone: no memory, no draw from torch's generator
            check_model_fits(Net(observation_shape, num_actions, config.model, config.use_lstm, config.hidden_size))
        model = Net(observation_shape, num_actions, config.model, config.use_lstm, config.hidden_size)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    writes_files = coordinator is None or coordinator.rank == 0
    if writes_files:
        run_dir, resuming, checkpoint_path, checkpoint = open_run(config, model.model, observation_shape,
                                                                  num_actions, lock)
    else:
        run_dir, resuming, checkpoint_path, checkpoint = distributed.rank_run_dir(config), False, None, None
    ctx = process_context()
    if config.num_actors or (config.eval_interval_s and writes_files):  # local actors or the evaluator
        start_fork_server()  # the checks a user fails most are behind; its imports overlap the rest of the build
    # Made here, before anything else draws from torch's generator, so their initial draws stay the same.
    actor_model = Net(observation_shape, num_actions, config.model, config.use_lstm, config.hidden_size)
    evaluator = make_evaluator(config, run_dir, observation_shape, num_actions, ctx) if writes_files else None
    device = coordinator.ranks.device if coordinator is not None else select_device(config)
    world_size = coordinator.ranks.world_size if coordinator is not None else 1
    # On a GPU too (one thread): torch's default of one per core takes cores from the actors.
    local_ranks = coordinator.ranks.local_world_size if coordinator is not None else 1
    torch.set_num_threads(learner_torch_threads(config, device, local_ranks))
    optimizer, scheduler = learner.make_optimizer(model.to(device), config, world_size)
    state = LearnerState(model, optimizer, scheduler, ActorLives(config.seed, session=0), world_size=world_size)
    if checkpoint is not None:
        assert checkpoint_path is not None
        state.load_state_dict(checkpoint, config, checkpoint_path)
    local_slots = config.resolved_num_buffers(learner_keeps_up=learner.uses_cuda_graph(config, device, world_size))
    check_pipes_hold(local_slots, config.num_actors, config.remote_slots)
    spec = BufferSpec(local_slots + config.remote_slots, config.unroll_length, observation_shape, observation_dtype,
                      num_actions, model.core_state_shapes())
    buffers = create_buffers(spec, lower=LOWER_REMOTE_SLOTS if config.remote_slots > local_slots else LOWER_LOCAL_SLOTS)
    # Remote actors are named by run; under torchrun every rank owns a pool, so the names differ by rank too.
    pool_name = run_dir.name if coordinator is None else f"{run_dir.name}.rank-{coordinator.rank}"
    # Connected before anything is written: a bad or unreachable address, or another training of this --xpid on the
    # cluster, leaves the run directory as it was.
    ray_connection = ray_pool.connect(config, ray_pool.unroll_bytes(buffers), stop) if config.ray else None
    runlog: RunLog = distributed.NoRunLog()  # rank > 0 under torchrun: it writes nothing
    session, started_session, made_run_dir = 0, False, False
    try:
        if ray_connection is not None:
            ray_pool.check_names_free(config, ray_connection[0], run_dir.name)
            ray_pool.warn_of_missing_resource(config, ray_connection[0])
        stop.check()  # the last moment at which stopping changes nothing
        if coordinator is not None:
            coordinator.ready()  # another rank's refusal ends the job here, before rank 0 writes anything
        resumed_step = state.step if resuming and checkpoint is not None else None  # None: a new run, or step 0
        if writes_files:
            made_run_dir = prepare_run_directory(run_dir, lock, claim=config.xpid is None)  # nothing changed before
            rewinds = replaces_own_checkpoint(run_dir, checkpoint_path)
            keep_replaced_checkpoint(run_dir, checkpoint_path)
            session, started_session = write_run_files(config, run_dir, resuming, world_size), True
            if rewinds:  # model.tar at once the step that the logs are about to be cut back to, whatever comes next
                assert checkpoint is not None
                _save_start(run_dir, config, state, checkpoint.get("recent_returns", []))
            if checkpoint_path is not None and not is_own_checkpoint(run_dir, checkpoint_path):
                _record_start(run_dir, checkpoint_path, state.step)
            purge_step = _purge_step(resuming, resumed_step)
            runlog = RunLog(run_dir, purge_step=purge_step)
            # At the purge's step: where a session ends before its first checkpoint, the next one drops them with the
            # rest of what it logged, rather than adding a second entry at the checkpoint's step.
            runlog.flags({**config.to_dict(), "world_size": world_size},  # and the ranks that trained
                         state.step if purge_step is None else purge_step)
        if coordinator is not None:
            session = coordinator.share_state(state, session, config)  # every rank starts from rank 0's weights
        state.lives.session = session
        pool = _actor_pool(config, ctx, buffers, state, actor_model, pool_name, ray_connection)
        amp, stats, update_lock = use_amp(config.amp, device, model.model), IntervalStats(), threading.Lock()
        if checkpoint is not None:  # the last 100 games go on across a resume: the mean's curve has no jump there
            stats.episode_returns.extend(float(r) for r in checkpoint.get("recent_returns", []))
        learners = Learners(config, state, buffers, pool, device, amp, stats, update_lock, coordinator)
        run = Run(config, run_dir, device, state, buffers, pool, runlog, learners, amp=amp, evaluator=evaluator,
                  resumed_from=checkpoint_path, saved_step=_saved_step(run_dir, checkpoint_path, state.step),
                  resumed_step=resumed_step, stats=stats,
                  update_lock=update_lock, coordinator=coordinator, stop=stop, lock=lock,
                  changed_flags=tuple(changed_flags(checkpoint["flags"], config)) if checkpoint is not None else ())
        if config.inference == "central":
            servers = _inference_servers(run, session)
            run.inference, run.pool.inference = CentralInference(servers), servers
        return run
    except BaseException:
        # What the failure leaves written (a rank lost while sharing rank 0's state, the GPU out of memory for
        # central inference): the logs closed, and this session's end in meta.json, which would read as a kill.
        runlog.close()
        if started_session:
            _record_end(run_dir, "error", state.step)
        elif made_run_dir:  # a new run that wrote nothing (a full disk): no empty directory left behind
            remove_if_empty(run_dir)
        if ray_connection is not None:
            ray_pool.disconnect(ray_connection)
        raise


def _purge_step(resuming: bool, resumed_step: int | None) -> int | None:
    """Where a resumed run's logs are cut (TensorBoard's `purge_step`: that step and later ones go): after the
    checkpoint's step, so that what its session logged there stays (the games that ended while it stopped, its last
    progress row); all of them for a run restarted from step 0 because it saved no checkpoint; None for a new run."""
    if not resuming:
        return None
    return resumed_step + 1 if resumed_step is not None else 0


def _inference_servers(run: Run, session: int) -> InferenceServers:
    """--inference central: the servers of the run's actors, on its learner's device, acting with the learner's
    model as last published."""
    config, positions = run.config, run.pool.channels.inference_positions
    assert positions is not None, "made by the pool for --inference central"
    # Server k's sampling stream is the "life" k of the inference stream: with one server, life 0.
    seeds = [sampling_seed(config.seed, session, INFERENCE_STREAM, k) for k in range(config.inference_threads)]
    graphed = config.cuda_graph and not learner.compiles_cuda_graphs(config, run.device, run.state.world_size)
    return InferenceServers(run.state.model, run.buffers, positions, run.device, run.amp,
                            config.inference_wait_ms / 1000, seeds, graphed=graphed, splits=config.env_splits)


TRAINING_COPIES = 4  # of the weights, at the least: themselves, their gradients, Adam's two moments


# What an actor process holds of its own, at the least: a CartPole actor's private memory (smaps_rollup), 13-14 MiB;
# a remote one of --ray local (a Ray worker, on this machine too), 176 MiB.
ACTOR_OWN_BYTES = 12 * 2**20
RAY_ACTOR_OWN_BYTES = 160 * 2**20


def check_actors_fit(config: Config) -> None:
    """Raise UserError where the actor processes (with --ray local, the remote ones too) could not all live in the
    memory the run may use (`usable_memory`): started anyway, they filled it before the first of them acted (5,000 on
    24 GB)."""
    remote = config.ray_actors if config.ray == "local" else 0
    needed = config.num_actors * ACTOR_OWN_BYTES + remote * RAY_ACTOR_OWN_BYTES
    memory = usable_memory()
    if needed <= memory.bytes:
        return
    filling = math.ceil(config.batch_size / config.envs_per_actor)  # auto's least: a batch's worth of unrolls at once
    if not remote and config.num_actors == filling:  # auto, most likely: --batch_size is what to lower
        raise UserError(f"--num_actors {config.num_actors} (auto is never fewer than --batch_size "
                        f"{config.batch_size} / --envs_per_actor {config.envs_per_actor}): each actor process holds "
                        f"at least {ACTOR_OWN_BYTES // 2**20} MiB of its own ({needed / 2**30:.1f} GiB in all) where "
                        f"{memory}: lower --batch_size, or raise --envs_per_actor")
    if not remote:
        raise UserError(f"--num_actors {config.num_actors}: each actor process holds at least "
                        f"{ACTOR_OWN_BYTES // 2**20} MiB of its own ({needed / 2**30:.1f} GiB in all) where "
                        f"{memory}: lower --num_actors, or pass auto (one per core)")
    raise UserError(f"--num_actors {config.num_actors} and --ray_actors {remote} (--ray local: on this machine too): "
                    f"each actor process holds at least {ACTOR_OWN_BYTES // 2**20} MiB of its own and each remote "
                    f"one {RAY_ACTOR_OWN_BYTES // 2**20} MiB ({needed / 2**30:.1f} GiB in all) where "
                    f"{memory}: lower --ray_actors or --num_actors, or use a cluster "
                    "(--ray auto|HOST:PORT)")


# The files run.py holds open (/proc/PID/fd, measured with 2 to 32 CartPole actors): 32 + 5 per actor; with
# --inference central, S more per actor for its S env splits (34 + 9 per actor with 4), 47 + 7 with 2 and two
# inference threads and the evaluator; with --ray local, 61 + 1 per remote actor.
OPEN_FILES_BASE = 48


def open_files_needed(config: Config) -> int:
    """The files run.py holds open once every actor runs, at the least (`OPEN_FILES_BASE` for the rest)."""
    per_actor = 5 + (config.env_splits if config.inference == "central" else 0)
    return OPEN_FILES_BASE + per_actor * config.num_actors + (config.ray_actors if config.ray else 0)


# The threads of a run's processes (/proc/PID/task of each): run.py 5-6, the fork server and the resource tracker 1
# each, an actor 2 (CartPole) or 3 (Atari: ale-py's stepping thread), measured with 4 actors. With --ray, run.py
# has 31; --ray local's own processes (raylet, GCS, agents) 133, and each remote actor 26 (measured with 2).
THREADS_BASE, THREADS_PER_ACTOR = 12, 3
RAY_DRIVER_THREADS, RAY_LOCAL_THREADS, RAY_ACTOR_THREADS = 26, 120, 24


def allow_process_limits(config: Config) -> None:
    """Make room for the run's actors in this process's limits (`_allow`): its open files (`open_files_needed`)
    and, for a user other than root, its user's processes and threads, which the kernel counts together (the
    run's and the rest)."""
    remote = config.ray_actors if config.ray else 0
    actors = f"the actors of --num_actors {config.num_actors}" + (f" and --ray_actors {remote}" if remote else "")
    _allow(resource.RLIMIT_NOFILE, open_files_needed(config), "open files", "this process may open", "n", actors)
    threads = THREADS_BASE + THREADS_PER_ACTOR * config.num_actors
    if config.ray:
        threads += RAY_DRIVER_THREADS + (RAY_LOCAL_THREADS + RAY_ACTOR_THREADS * remote if config.ray == "local" else 0)
    if os.getuid() != 0:  # the kernel holds root to no such limit (its user namespace's root aside)
        _allow(resource.RLIMIT_NPROC, threads, "processes and threads", "this user may run", "u", actors)


RAISED_LIMIT = 65_536  # the most a soft limit is raised to: some programs go through every file number up to it


def _allow(limit: int, needed: int, what: str, may: str, letter: str, actors: str) -> None:
    """Raise the soft `limit` towards the hard one (up to RAISED_LIMIT, or twice `needed` where that is more) where
    `needed` is more than half of it: room for what is opened or started later, and for the user's other processes
    where it counts them. UserError where even the hard limit is below `needed`: the start would otherwise fail in
    the middle ("Too many open files", "can't start new thread", with tracebacks from the actors)."""
    soft, hard = resource.getrlimit(limit)
    unlimited = resource.RLIM_INFINITY
    if hard != unlimited and hard < needed:
        raise UserError(f"{actors} need at least {needed} {what}, and {may} {hard} at most (`ulimit -H{letter}`): "
                        "raise that limit, or lower the number of actors")
    raised = max(RAISED_LIMIT, 2 * needed) if hard == unlimited else min(hard, max(RAISED_LIMIT, 2 * needed))
    if soft != unlimited and soft < 2 * needed and raised > soft:
        resource.setrlimit(limit, (raised, hard))
        log.info("Raised the limit of %s from %d to %d: %s need at least %d", what, soft, raised, actors, needed)


def check_model_fits(model: Net) -> None:
    """Raise UserError where `model` (made on the meta device: no memory of its own) could not be trained in the
    memory the run may use (`usable_memory`): --hidden_size of an MLP grows it as its square (65,536: 4.3 billion
    weights, 17 GB a copy)."""
    weights = sum(p.numel() for p in model.parameters())
    needed = TRAINING_COPIES * 4 * weights  # float32
    memory = usable_memory()
    if needed > memory.bytes:
        raise UserError(f"the {model.model} net has {weights:,} weights, and training holds at least "
                        f"{TRAINING_COPIES} float32 copies of them ({needed / 2**30:.1f} GiB) where "
                        f"{memory}: lower --hidden_size")


def _actor_pool(config: Config, ctx: BaseContext, buffers: Buffers, state: LearnerState, actor_model: Net,
                run_name: str, ray_connection: tuple[Any, bool | None] | None) -> LocalActorPool | RayActorPool:
    """The local actors, acting with `actor_model`, a shared CPU copy of the learner's weights, at its version;
    with --ray, inside a pool that adds the remote actors."""
    actor_model.load_state_dict(state.model.state_dict())
    actor_model.eval()
    local = LocalActorPool(config, ctx, buffers, actor_model, state.lives, policy_version=state.updates,
                           remote_slots=config.remote_slots)
    if ray_connection is None:
        return local
    return RayActorPool(config, local, buffers, state.lives, state.model, state.updates, run_name, ray_connection)


# ----------------------------------------------------------------------------------------- start


def start_actors(run: Run) -> None:
    run.pool.start()


def start_inference(run: Run) -> None:
    """--inference central: the threads that answer actors' requests for actions, one per server."""
    if run.inference is None:
        return
    servers = run.inference.servers.servers
    if len(servers) > 1:
        log.info("Central inference: %d threads serving %s of the %d env splits", len(servers),
                 " + ".join(str(server.max_clients) for server in servers),
                 sum(server.max_clients for server in servers))
    for k, server in enumerate(servers):
        name = "inference" if len(servers) == 1 else f"inference-{k}"
        thread = threading.Thread(target=_inference_thread, args=(run.inference, server), name=name, daemon=True)
        run.inference.threads.append(thread)
        thread.start()


def _inference_thread(inference: CentralInference, server: InferenceServer) -> None:
    try:
        server.serve(inference.stop)
    except BaseException as exc:  # logged here with its traceback; the monitor stops the run (SystemExit too)
        log.exception("The inference thread %s failed", threading.current_thread().name)
        if inference.error is None:
            inference.error = exc


def start_learners(run: Run) -> None:
    run.learners.start()
    if run.config.learner_timeout_s > 0:
        threading.Thread(target=_watch_learners, args=(run,), name="learner-watch", daemon=True).start()


def _watch_learners(run: Run) -> None:
    """--learner_timeout_s: while learner threads run, end the process when one, or the central inference thread,
    has spent that long on one batch.

    A learner stuck in a CUDA call (a hung GPU or driver) or a deadlock would otherwise stall the run for good
    without a word; stuck inside an update, it holds `update_lock`, on which the monitor, the checkpoints and the
    shutdown wait, so no Ctrl-C or SIGTERM could end it either. A stuck inference thread stalls it as surely: its
    actors wait for actions, which counts as progress for them. So this thread does not stop the run in order: it
    logs the stuck thread's stack and ends the process as a kill -9 would. Actors and the fork server leave with
    it, nothing is saved (the weights may be half updated; the last checkpoint stays), and the run resumes from
    that checkpoint when started again.

    Time counts in this thread's own steps of at most two check intervals each: a process stopped for a while
    (Ctrl-Z, SIGSTOP) resumes with none of that time held against a batch it was working on.
    """
    timeout_s = run.config.learner_timeout_s
    interval_s = min(5.0, timeout_s / 4)
    seen_s: dict[tuple[threading.Thread, float], float] = {}  # (thread, when it took its batch) -> time seen on it
    last = time.monotonic()
    while any(thread.is_alive() for thread in run.learners.threads):
        now = time.monotonic()
        step_s, last = min(now - last, 2 * interval_s), now
        busy = dict(run.learners.busy_since)
        if run.inference is not None:  # threads are started one by one: zip stops at the last one started
            for thread, server in zip(run.inference.threads, run.inference.servers.servers, strict=False):
                since = server.serving_since
                if since is not None and thread.is_alive():
                    busy[thread] = since
        seen_s = {batch: seen_s.get(batch, 0.0) + step_s for batch in busy.items()}
        for (thread, _), busy_s in seen_s.items():
            if busy_s > timeout_s:
                _end_hung_process(run, thread, busy_s)
        if run.learners.stop_event.wait(interval_s):
            time.sleep(0.05)  # stopping: the threads end within moments, or one is still inside its update


def _end_hung_process(run: Run, thread: threading.Thread, busy_s: float) -> NoReturn:
    frame = sys._current_frames().get(thread.ident or -1)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack: it has just ended)\n"
    log.error("The %s thread has spent %.0f s on one batch (--learner_timeout_s %g): a hung GPU or driver, or a "
              "deadlock. Ending the process now, without a final checkpoint (%s); run it again to resume. Where "
              "the thread is:\n%s", thread.name, busy_s, run.config.learner_timeout_s, _last_saved(run),
              stack.rstrip())
    if run.writes_files:  # else the next start takes the session for killed; bounded, as the disk may hang too
        finish_within(HUNG_RECORD_TIMEOUT_S, lambda: _record_end(run.run_dir, "hung", run.state.step),
                      "the record of the hung session's end")
    os._exit(1)


HUNG_RECORD_TIMEOUT_S = 5.0  # how long a process ending for a hung thread waits for meta.json's record of it


# --------------------------------------------------------------------------------------- monitor


def monitor(run: Run) -> str:
    """Watch the run until it is done or a Ctrl-C or SIGTERM came; returns why it ended. Raises TrainingError
    on a fault."""
    config, state = run.config, run.state
    last_log_time = last_checkpoint_time = time.monotonic()
    remake_tried = False  # the run directory was found gone at the last look, and a checkpoint tried to make it again
    resave_tried = False  # so was model.tar alone, and a checkpoint tried to save it again
    start_time = run.started_s if run.started_s is not None else last_log_time
    last_log_step = state.step
    console_rate = RecentRate(last_log_time - start_time, state.step)
    while True:
        # A learner's failure that came before the signal is why the run ends: under torchrun, a rank whose learner
        # lost another rank is then sent SIGTERM by torchrun, which must not make the fault read as a stop.
        if run.stop.reason is not None and not run.learners.failed_before(run.stop.at):
            log.info(run.stop.log_line)
            return run.stop.reason
        _check_threads(run)
        if run.coordinator is not None and run.coordinator.stopped_by is not None:
            return f"stopped by rank {run.coordinator.stopped_by}"  # it says why in its own log
        if state.step >= config.total_steps:
            _drain_episodes(run)  # the last games and a 100% progress line, at total_steps
            if state.step != last_log_step:  # not where the row of this same pass already is
                _log_progress(run, last_log_time, last_log_step, start_time, console_rate)
            return "finished"
        _drain_episodes(run)
        run.pool.check()
        check_evaluator(run)
        now = time.monotonic()
        if now - last_log_time >= config.log_interval_s:
            dir_gone = run.writes_files and not run.run_dir.is_dir()
            if dir_gone and not remake_tried:  # made again with a checkpoint, before anything is logged into it
                _periodic_checkpoint(run)  # and if that fails, with each periodic one
                last_checkpoint_time = now
            remake_tried = dir_gone
            model_gone = not dir_gone and _checkpoint_gone(run)
            if model_gone and not resave_tried:  # a checkpoint at once, not at the next interval's
                log.warning("%s went while the run went on (deleted, or moved away): saving a checkpoint now",
                            run.run_dir / CHECKPOINT_NAME)
                _periodic_checkpoint(run)
                last_checkpoint_time = now
            resave_tried = model_gone
            last_log_step, last_log_time = _log_progress(run, last_log_time, last_log_step, start_time, console_rate)
        if now - last_checkpoint_time >= config.checkpoint_interval_s:
            _periodic_checkpoint(run)
            last_checkpoint_time = now
        time.sleep(0.05)


def _checkpoint_gone(run: Run) -> bool:
    """Whether the model.tar this run saved is gone from its directory: a run killed before the next periodic
    checkpoint would then be refused (meta.json records a checkpoint), its training since the last one lost."""
    return run.writes_files and run.saved_step is not None and not os.path.lexists(run.run_dir / CHECKPOINT_NAME)


def _check_threads(run: Run) -> None:
    """Raise TrainingError when a learner or the inference thread died: without them actors wait forever
    (and keep beating their heartbeat while they wait for actions)."""
    if run.learners.errors:
        error = run.learners.errors[0]
        if isinstance(error, TrainingError):
            raise error
        raise TrainingError(f"learner thread failed: {error!r}") from error
    if run.inference is not None and run.inference.error is not None:
        error = run.inference.error
        raise TrainingError(f"the central inference thread failed: {type(error).__name__}: {first_line(error)}"
                            ) from error


def _drain_episodes(run: Run) -> None:
    games, unlisted = run.pool.episodes(), 0
    if run.coordinator is not None:  # every rank's games go to rank 0's log with the votes
        games, unlisted = run.coordinator.games(games)
    run.state.episodes += unlisted  # counted, but not one by one in the log (distributed.MAX_GAMES_PER_VOTE)
    for episode_return, _ in games:
        run.stats.add_episode(episode_return)
        run.state.episodes += 1
    run.runlog.games(games, run.state.step)


def _log_progress(run: Run, last_time: float, last_step: int, start_time: float, console_rate: RecentRate
                  ) -> tuple[int, float]:
    """Average what the learners recorded since the last call (at monotonic `last_time`, step `last_step`), write
    it against agent steps, print progress (its SPS and time left from `console_rate`, over the last minute);
    returns the step it logged and its time, from which the next interval counts.

    Called by the monitor every `log_interval_s`. The step and the sums are read together under `update_lock`,
    which can wait for a whole update, and the interval's end is taken after that wait: an update that ended
    meanwhile counts its steps, its losses and its time in the same row (its steps used to go to the next row,
    whose interval could be a few ms long: the last row's SPS jumped several times over, with no losses in it).
    """
    with run.update_lock:
        step, episodes = run.state.step, run.state.episodes  # learners keep stepping: one value for every scalar
        update_scalars, timing_scalars = run.stats.take()
    now = time.monotonic()
    sps = (step - last_step) / max(now - last_time, 1e-3)
    mean_return = run.stats.mean_return_100()
    scalars = {"charts/SPS": sps, "charts/frames": step * _frames_per_step(run.config.env),
               "charts/episodes": episodes}
    if run.stats.episode_returns:
        scalars["charts/mean_return_100"] = mean_return
    scalars.update(update_scalars)
    scalars["stats/skipped_updates"] = run.state.skipped_updates
    scalars["stats/full_queue_size"] = run.pool.slots.full_size()  # slots waiting for a learner
    scalars["stats/free_queue_size"] = run.pool.slots.free_size()  # and for an actor: which is the bottleneck
    if run.inference is not None:  # actors served per forward (1: no batching across them), its ms, its busy share
        scalars.update(run.inference.servers.take_stats())
    scalars.update(timing_scalars)
    scalars.update(run.pool.scalars())
    if step != run.resumed_step:  # a resumed session that has not learned yet: the last session's row stays alone
        run.runlog.scalars(step, scalars)
    elapsed_s = now - start_time
    log.info(progress_line(step, run.config.total_steps, console_rate.add(elapsed_s, step), elapsed_s, mean_return,
                           episodes), extra=STATUS)
    return step, now


@functools.cache
def _frames_per_step(env_id: str) -> int:
    """Env frames per agent step: the frame skip, 4 for Atari (see `environment.EnvBatch`), 1 otherwise."""
    return 4 if is_atari(env_id) else 1


def _save_start(run_dir: Path, config: Config, state: LearnerState, recent_returns: list[float]) -> None:
    """A rewind's start (`--checkpoint best|PATH` into the run's own directory) saved as model.tar before the
    logs past it are dropped: a run killed before its first checkpoint then resumes where its logs end, not at
    the later step it was rewound from (kept as model_replaced_step_N.tar)."""
    try:
        save_checkpoint(run_dir / CHECKPOINT_NAME, {**state.state_dict(), **header(config, state.model),
                                                    "recent_returns": list(recent_returns)})
    except OSError as exc:
        raise UserError(f"cannot save the rewound checkpoint to {run_dir / CHECKPOINT_NAME}: {exc.strerror or exc}; "
                        "free space there (its model.tar and logs are as they were)") from None
    log.info("Saved the start at step %d as %s", state.step, run_dir / CHECKPOINT_NAME)
    _record_checkpoint(run_dir, state.step)


def _saved_step(run_dir: Path, start: Path | None, step: int) -> int | None:
    """The step of the run's model.tar as a session begins from checkpoint `start`: `step` where that is model.tar
    or was saved as it (`_save_start`); None for a start from another run's checkpoint, not yet saved here."""
    own = run_dir / CHECKPOINT_NAME
    return step if start is not None and (is_own_checkpoint(run_dir, start) or own.is_file()) else None


def _record_start(run_dir: Path, start: Path, step: int) -> None:
    """The session's start from `start` in meta.json (`rundir.repeated_start`); a failed write is reported."""
    try:
        record_start(run_dir, start, step)
    except OSError as exc:
        log.error("Could not record the start from %s in %s: %s (a run of the same command again goes back to it)",
                  start, run_dir / "meta.json", exc)


def _record_checkpoint(run_dir: Path, step: int) -> None:
    """model.tar's step in meta.json; a failed write is reported (model.tar is saved all the same)."""
    try:
        record_checkpoint(run_dir, step)
    except OSError as exc:
        log.error("Could not record the checkpoint in %s: %s (model.tar is saved)", run_dir / "meta.json", exc)


def checkpoint(run: Run) -> None:
    """Save the learner state with the flags and shapes; the copy is taken between two updates. Under
    torchrun rank 0 saves (every rank holds the same state)."""
    if not run.writes_files:
        return
    if not run.run_dir.is_dir():  # deleted or moved away while the run went on
        _remake_run_directory(run)
    with run.update_lock:
        if not run.learners.weights_whole():  # a learner failed, perhaps inside the update this waited for
            log.error("Not saving a checkpoint: a learner thread failed, and its weights may be torn (%s)",
                      _last_saved(run))
            return
        state = run.state.state_dict()
    if run.coordinator is not None:  # the other ranks' actor lives too
        state = run.coordinator.run_wide_lives(state)
    state.update(header(run.config, run.state.model), recent_returns=list(run.stats.episode_returns))
    save_checkpoint(run.run_dir / CHECKPOINT_NAME, state)
    run.saved_step = state["step"]
    log.info("Saved checkpoint at step %d to %s", state["step"], run.run_dir / CHECKPOINT_NAME)
    _record_checkpoint(run.run_dir, state["step"])
    _keep_step_copy(run, state["step"])


def _remake_run_directory(run: Run) -> None:
    """The run directory went while the run went on (a deletion by mistake, a move): made again with the run's flags
    and a new record, for a checkpoint there, and out.log, logs.csv and TensorBoard begun again in it. What it held
    is not brought back, but the run, whose state is in memory, can still be resumed. Raises OSError."""
    remake_run_directory(run.config, run.run_dir, run.state.world_size)
    log.warning("The run directory %s went while the run went on (deleted, or moved away); made again, with the "
                "run's flags, a checkpoint now and its logs from step %d on: nothing it held before is in it (its "
                "checkpoints, event files, logs.csv and out.log)", run.run_dir, run.state.step)
    run.saved_step = None
    if run.evaluator is not None:  # model_best.tar went too: the next evaluation's agent is the best in the directory
        run.evaluator.best = run.evaluator.best_actions = None
    run.runlog.begin_anew()
    if run.lock is not None:  # held on the directory that went
        run.lock.release()
        with contextlib.suppress(OSError, UserError):
            run.lock.hold(run.run_dir)


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
                  run.state.step, exc, _last_saved(run), run.config.checkpoint_interval_s)


def _last_saved(run: Run) -> str:
    if run.saved_step is None:
        return "no checkpoint saved yet"
    if run.writes_files and not run.run_dir.is_dir():
        return f"the one at step {run.saved_step} went with the run directory"
    return f"the one at step {run.saved_step} is intact"


def _log_start(run: Run) -> None:
    config = run.config
    log.info("Run %s: %s, %d actors x %d envs, %d slots, T=%d, B=%d, device %s%s", run.run_dir, config.env,
             config.num_actors, config.envs_per_actor, run.buffers["slot_owner"].numel(), config.unroll_length,
             config.batch_size, run.device, ", bfloat16 autocast" if run.amp else "")
    if run.device.type == "cpu" and not config.disable_cuda and torch.version.cuda is not None:
        # A container started without --gpus, a driver too old for the build: "device cpu" above is easy to miss.
        log.warning("This PyTorch is built for CUDA %s but sees no GPU, so the learner runs on the CPU, many times "
                    "slower (in Docker, pass --gpus all; check nvidia-smi and the driver); --disable_cuda chooses the "
                    "CPU and silences this", torch.version.cuda)
    quota, cores = cpu_quota(), len(os.sched_getaffinity(0))
    if quota is not None and quota < cores:
        log.info("This process's cgroup caps its CPU time at %.3g cores' worth, of the %d cores it may run on: "
                 "--num_actors auto and the learner's threads count %d", quota, cores, usable_cores())
    memory = usable_memory()
    if memory.limit is not None:
        log.info("This process's cgroup limits the memory of the run's processes to %.1f GiB of the machine's %.1f: "
                 "past it, the kernel kills one of them", memory.limit / 2**30, memory.physical / 2**30)
    if run.coordinator is not None:
        ranks = run.coordinator.ranks
        log.info("%d learner ranks (torchrun, %s): each with these actors and batch; this one, rank 0, "
                 "writes the run", ranks.world_size, "NCCL" if ranks.device.type == "cuda" else "gloo")
    if config.ray:
        log.info("Remote actors: %d x %d envs on Ray (%s)", config.ray_actors, config.ray_envs_per_actor, config.ray)
    unrolls = config.num_actors * config.envs_per_actor  # acted at once, each learned from once, B at a time
    if unrolls > MEASURED_POLICY_LAG * config.batch_size:  # --num_actors auto on many more than 16 cores, say
        log.warning("%d actors x %d envs act %d unrolls at once for batches of %d: each is learned from at least %.1f "
                    "updates after its first action (stats/policy_lag), more than the %.1f at which the defaults were "
                    "measured to learn Pong; --batch_size %d would keep it there (README: Speed)", config.num_actors,
                    config.envs_per_actor, unrolls, config.batch_size, unrolls / config.batch_size, MEASURED_POLICY_LAG,
                    math.ceil(unrolls / MEASURED_POLICY_LAG))
    per_update, left = config.steps_per_update * run.state.world_size, config.total_steps - run.state.step
    if 0 < left < per_update:  # a smoke test with the flags of a long run, say: it learns far past the mark
        log.warning("One update learns from %s agent steps (--unroll_length %d x --batch_size %d%s), more than the "
                    "%s left to --total_steps: the run ends after its first update, at step %s",
                    f"{per_update:,}", config.unroll_length, config.batch_size,
                    f" x {run.state.world_size} ranks" if run.state.world_size > 1 else "", f"{left:,}",
                    f"{run.state.step + per_update:,}")
    if run.state.step:
        log.info("Resuming from step %d (update %d)", run.state.step, run.state.updates)
    if run.resumed_from is not None and not is_own_checkpoint(run.run_dir, run.resumed_from):
        log.info("Resumed from %s%s", run.resumed_from, "" if run.state.optimizer.state else
                 " (it holds no optimiser state: the optimiser starts afresh)")
    if run.changed_flags:
        log.warning("Flags other than the checkpoint's (a flag not given takes its default, not the run's value): %s",
                    ", ".join(run.changed_flags))
    if run.state.optimizer_trained_with:
        log.warning("The checkpoint was trained with --optimizer %s, this run uses %s: the optimiser starts afresh",
                    run.state.optimizer_trained_with, config.optimizer)
    if run.evaluator is not None:
        _log_best(run.run_dir, run.evaluator, config.eval_actions)


def _log_best(run_dir: Path, evaluator: Evaluator, actions: str) -> None:
    """Which best this session's evaluations must beat (`best_checkpoint`), and where a best of the other
    --eval_actions stays."""
    other = evaluator.best_actions not in (None, actions)
    if evaluator.best is not None:
        log.info("Best %sevaluation so far: mean return %.2f at step %d (%s); only a better one replaces it",
                 f"{actions} " if other else "", *evaluator.best, best_checkpoint(run_dir, actions).name)
    if other:
        log.info("%s holds the best of %s evaluations; this session's take %s actions, whose means are compared "
                 "only with each other: a new best of them takes its place, and it is kept as model_best_%s.tar",
                 BEST_CHECKPOINT_NAME, evaluator.best_actions, actions, evaluator.best_actions)


# -------------------------------------------------------------------------------------- shutdown


def shutdown(run: Run, save: bool, finished: bool = False) -> OSError | None:
    """Stop acting and learning, save, close: the one ordered path for every way a run ends. Returns why
    the final checkpoint could not be written, if it could not. A run that `finished` (reached --total_steps)
    has its final weights evaluated where it evaluates while training (`evaluate_final_weights`), between two saves of
    its final checkpoint: a kill while those games play (up to `evaluator.FINAL_EVALUATION_MAX_S`) costs no training.

    Bounded in time (learners LEARNER_JOIN_TIMEOUT_S, actors actor_pool.ACTOR_JOIN_TIMEOUT_S, then killed,
    each close after the checkpoint END_CLOSE_TIMEOUT_S); on return no actor process, fork server or queue
    thread of the run is left, unless a close had to be left behind (logged).
    """
    run.pool.request_stop()
    run.learners.stop(LEARNER_JOIN_TIMEOUT_S)
    save_error = None
    try:
        # A fault in stopping the actors (a lost Ray connection) or the evaluator must not cost the final checkpoint:
        # raised after it.
        stop_error: Exception | None = None
        try:
            run.pool.stop(functools.partial(_drain_episodes, run))
        except Exception as exc:  # noqa: BLE001 - raised below
            stop_error = exc
        if save and not run.learners.weights_whole():  # a learner failed while it was being stopped
            log.error("Not saving a final checkpoint: a learner thread failed while stopping (%s)", _last_saved(run))
            save = False
        evaluating = finished and run.evaluator is not None and not run.evaluator.disabled
        if save and evaluating:  # the training kept before its final evaluation, which may take many minutes
            save_error = _save_final(run)
        try:
            if finished:
                evaluate_final_weights(run, lambda: run.stop.reason is not None)
            stop_evaluator(run)  # logs the last evaluation's result
        except Exception as exc:  # noqa: BLE001 - raised below
            stop_error = stop_error or exc
        if run.inference is not None:
            run.inference.stop.set()
            deadline = time.monotonic() + LEARNER_JOIN_TIMEOUT_S
            for thread in run.inference.threads:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if save:  # again after a final evaluation: the evaluations and their seeds counted
            save_error = _save_final(run)
        if stop_error is not None:
            raise stop_error
    finally:
        finish_within(END_CLOSE_TIMEOUT_S, run.runlog.close, "closing the TensorBoard and CSV logs")
        finish_within(END_CLOSE_TIMEOUT_S, run.pool.close, "closing the actors' channels and the fork server")
    return save_error


def _save_final(run: Run) -> OSError | None:
    """`checkpoint` at the run's end; returns why it could not be written, if it could not (logged)."""
    try:
        checkpoint(run)  # waits for a learner still inside an update: it holds update_lock
    except OSError as exc:
        log.error("Could not save the final checkpoint at step %d: %s (%s)", run.state.step, exc, _last_saved(run))
        return exc
    return None


def train(config: Config, started_s: float | None = None) -> Path:
    """Train until `total_steps`; every ending goes through `shutdown`. Call from the main thread. `started_s`: when
    the program started (time.monotonic()), for the progress line's elapsed time (`Run.started_s`).

    Returns the run directory when the run finished. Raises `Stopped` after an orderly stop on Ctrl-C or
    SIGTERM (a final checkpoint written; before anything started, nothing written), `TrainingError` when
    the run itself failed (actors dying too often, non-finite updates; the last good checkpoint kept), and
    `UserError` for bad input, before anything in the run directory has changed.
    """
    keep_freed_memory()
    coordinator = None
    with stop_requests() as stop:
        try:
            config, coordinator = distributed.join(config)  # under torchrun; else (config, None)
            stop.check()
            if coordinator is None or coordinator.rank == 0:  # what building says, on the console and in out.log
                setup_console(keep_for_log_file=True)
            with DirectoryLock() as lock:  # one training per run directory, until this one has ended
                for attempt in range(1, NAME_ATTEMPTS + 1):
                    try:
                        run = build(config, coordinator, stop, lock)
                        run.started_s = started_s
                        break
                    except NameTaken as taken:  # trainings started together: the next free name
                        if attempt == NAME_ATTEMPTS:
                            stop_fork_server()
                            close_console()
                            raise UserError(f"run names like {taken} in {config.savedir} were taken {attempt} times "
                                            "by other trainings; pass --xpid NAME") from None
                    except BaseException:
                        stop_fork_server()  # started during the build; nothing else of the run was
                        close_console()
                        raise
                return _run(run)
        finally:
            if coordinator is not None:  # bounded too: a rank that cannot leave its group must still exit
                finish_within(END_CLOSE_TIMEOUT_S, functools.partial(distributed.leave, coordinator),
                              "leaving the learner ranks' process group")


def _run(run: Run) -> Path:
    setup_console(run.run_dir / LOG_NAME if run.writes_files else None)
    if run.coordinator is not None and not run.writes_files:
        distributed.rank_console(run.coordinator.rank)
    reason, started = "error", False
    try:
        _log_start(run)
        if run.stop.reason is not None:  # it came while building: nothing is started, nothing learned to save
            log.info(run.stop.log_line)
            reason = run.stop.reason
        else:
            started = True
            reason = _start_and_monitor(run)
    except BaseException as exc:
        log.error("Stopping: %s", first_line(exc))
        raise
    finally:
        # A learner's fault that ended the run says so itself; one after a stop or the end is `shutdown`'s to tell.
        save_error = _end(run, reason, save=started and (reason != "error" or run.learners.weights_whole()))
    if save_error is not None:
        raise TrainingError(f"could not save the final checkpoint to {run.run_dir / CHECKPOINT_NAME}: "
                            f"{save_error} ({_last_saved(run)})")
    if reason == run.stop.reason:
        run.stop.check()  # raises Stopped
    return run.run_dir


def _start_and_monitor(run: Run) -> str:
    start_inference(run)
    start_actors(run)
    start_learners(run)
    start_evaluator(run)
    return monitor(run)


def _record_end(run_dir: Path, reason: str, step: int) -> None:
    """The session's end in meta.json; a failed write is reported, not raised (the run has ended either way)."""
    try:
        finish_run_files(run_dir, reason, step)
    except OSError as exc:
        log.error("Could not record the end of the run in %s: %s", run_dir, exc)


def _end(run: Run, reason: str, save: bool) -> OSError | None:
    """Shut down and record the end; returns the final save's error. A Ctrl-C or SIGTERM meanwhile changes
    nothing (`stopping.py`). `save`: False after a numerical failure (the last good checkpoint stays) and
    for a run stopped before it started (nothing learned)."""
    failure: Exception | None = None
    save_error = None
    try:
        try:
            save_error = shutdown(run, save=save, finished=reason == "finished")
        except Exception as exc:  # noqa: BLE001 - a fault while stopping (the evaluator's): recorded, raised below
            failure, reason = exc, "error"
        if run.writes_files:
            _record_end(run.run_dir, reason, run.state.step)
        log.info("Run ended (%s) at step %d in %s", reason, run.state.step, run.run_dir)
        if failure is not None:
            raise failure
    finally:
        close_console()
    return save_error
