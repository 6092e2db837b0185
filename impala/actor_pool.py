"""Actor pools: who fills the slots. The learner only ever sees full slots (`SlotLedger.take_full`),
however they were filled; a pool owns the actors that fill them.

    pool.start()            every actor acting
    while training:
        pool.check()        replace actors that died or hung; TrainingError when they keep dying
        pool.publish(...)   (learner threads) new weights for the actors, with their policy version
    pool.request_stop()     actors finish their unroll or wait (shutdown, before the learners are joined)
    pool.stop(drain)        stop flag, join with a timeout, kill
    pool.close()            the channels and the fork server

`LocalActorPool` runs actors as processes of this machine, writing into shared memory. A pool of
actors on other machines implements the same `ActorPool` and writes the unrolls it receives into the
same slots and full queue.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import queue
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp

from impala.actor import ACTOR_PHASES, ActorChannels, phase_shares, run_actor
from impala.buffers import Buffers, usable_memory
from impala.channels import RecordQueue, SharedFloats, StopFlag, TracebackQueue
from impala.config import Config, TrainingError, own_cgroup_file
from impala.inference import InferenceServers
from impala.model import FlatWeights, Net
from impala.seeding import ActorLives
from impala.slots import SlotLedger
from impala.stopping import STOP_SIGNALS, ignore_stop_signals

log = logging.getLogger("impala")

# Actor processes come from a fork server: a clean process started before any learner thread or CUDA
# context exists, so (unlike plain fork) a restarted actor never inherits a held lock or a CUDA
# state, and (unlike spawn) it does not re-import torch for every actor.
START_METHOD = "forkserver"
FORK_SERVER_LOST_EXITCODE = 255  # multiprocessing's exit code for a child whose fork server is gone
ACTOR_JOIN_TIMEOUT_S = 5.0  # then kill: shutdown is bounded whatever an env does
FORK_SERVER_STOP_TIMEOUT_S = 10.0  # then kill it
RESTART_WINDOW_S = 600.0
ACTOR_NICENESS = 10


class RecentDeaths:
    """The crash limit (--max_actor_restarts) of local actors, of remote ones and of the evaluator: their deaths
    within the last RESTART_WINDOW_S, and their deaths in a row with no progress between them (no update learned,
    no evaluation finished). The second catches a slow crash loop: a few actors whose env hangs in every life,
    each killed after --actor_timeout_s, die too seldom for the window but never let the run learn again."""

    def __init__(self) -> None:
        self._times: list[float] = []
        self._in_a_row = 0
        self._progress: object = None  # the sign of progress at the last death (a policy version, a count)

    def add(self, progress: object = None) -> int:
        """Count a death now, `progress` the owner's sign of progress (a new value: progress since the last death);
        returns the deaths within the window, this one included, or the deaths in a row where they are more."""
        self._times.append(time.monotonic())
        if progress != self._progress:
            self._progress, self._in_a_row = progress, 0
        self._in_a_row += 1
        return self.recent()

    def recent(self) -> int:
        """What `add` returns, without counting a death."""
        return max(self._within_window(), self._in_a_row)

    def span(self) -> str:
        """What the count `add` and `recent` return counts, for a message."""
        if self._in_a_row > self._within_window():
            return "in a row, with no progress in between"
        return f"within {RESTART_WINDOW_S:.0f} s"

    def _within_window(self) -> int:
        now = time.monotonic()
        self._times = [t for t in self._times if now - t < RESTART_WINDOW_S]
        return len(self._times)


class ActorPool(Protocol):
    """The actors of a run, as the trainer sees them. Every method is called from the main thread only,
    except `publish`, which a learner thread calls while it holds the update lock."""

    slots: SlotLedger  # where the learners take full slots and give them back

    def start(self) -> None:
        """Start every actor."""

    def check(self) -> None:
        """Replace every actor that died or hung, returning the slots it held; raise TrainingError when
        actors die more than --max_actor_restarts times within RESTART_WINDOW_S, or in a row with no update
        learned in between (`RecentDeaths`)."""

    def publish(self, model: Net, version: int) -> None:
        """Make `model`'s weights, policy version `version`, the ones actors act with from now on."""

    def episodes(self) -> list[tuple[float, int]]:
        """(return, length) of every full game finished since the last call."""

    def scalars(self) -> dict[str, float]:
        """The pool's own TensorBoard scalars (name -> value) for the monitor's log line, if any."""

    def request_stop(self) -> None:
        """Tell every actor to stop, without waiting."""

    def stop(self, drain: Callable[[], None]) -> None:
        """Stop every actor, bounded in time; `drain` is called while waiting (an actor blocked on a full episode
        pipe sees the stop flag only once it is read)."""

    def close(self) -> None:
        """Release the channels, after `stop`."""


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def keep_freed_memory() -> None:
    """Let glibc's malloc reuse freed memory instead of returning it to the kernel.

    A CPU learner update allocates and frees tensors of tens of MB (the float copy of a [T+1, B]
    batch of frames alone is 73 MB). Above its mmap threshold glibc maps each one afresh and unmaps
    it on free, so every update page-faults its whole working set in again: measured here, a third of
    the learner's CPU time went to the kernel. Raising the thresholds keeps those pages in the heap,
    and one arena for all threads lets a learner thread's big blocks grow the main heap (a thread's
    own arena is capped at 64 MB and falls back to mmap). Call it before starting threads.
    A no-op where the C library is not glibc.
    """
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_ARENA_MAX, 1)
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)


def process_context() -> BaseContext:
    """The multiprocessing context of every child process of a run (see START_METHOD)."""
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(["impala.training"])  # what every actor imports, imported once
    return ctx


class LocalActorPool:
    """Actor processes on this machine: each fills its own slots in shared memory (`actor.run_actor`).

    Owns every channel between them and the main process (made here, the slots' pipes by its `slots.SlotLedger`)
    and the processes themselves: their start, their heartbeats, their restart with the slots they held, their
    stop. Only the main thread calls it, except `publish` (a learner thread, under the update lock).
    """

    def __init__(self, config: Config, ctx: BaseContext, buffers: Buffers, actor_model: Net, lives: ActorLives,
                 policy_version: int = 0, remote_slots: int = 0) -> None:
        """`remote_slots`: the last slots of `buffers` are not the actors' but one more writer's, index
        `config.num_actors` in `slots` (the receiver of remote unrolls, `ray_pool.py`)."""
        self.config = config
        self.ctx = ctx
        self.buffers = buffers
        self.actor_model = actor_model  # shared CPU copy the actors act with
        self.actor_weights = FlatWeights(actor_model)  # its parameters, views of one tensor in shared memory
        self.lives = lives  # numbers every actor start and hands it its seeds
        self.inference: InferenceServers | None = None  # --inference central: set before `start`
        # Slot numbers and episodes travel in RecordQueues, which survive an actor killed at any instant.
        # So do tracebacks, sent by an actor that is dying anyway.
        full_queue = RecordQueue(ctx, "q", capacity=len(buffers["slot_owner"]))
        self.slots = _ledger(ctx, buffers["slot_owner"], config.num_actors, full_queue, remote_slots)
        positions = None
        # What the pool itself reads and closes; the actors see them through `channels`.
        self._episodes = RecordQueue(ctx, "qdq", capacity=4096)  # (actor index, return, length)
        self._errors = TracebackQueue(ctx)  # (actor index, traceback text)
        self.heartbeats: SharedFloats = ctx.Array("d", config.num_actors, lock=False)  # each actor's last sign of progress
        # Each actor's seconds in each of ACTOR_PHASES, and their sums over the actors at the last `scalars`.
        self.phase_seconds: SharedFloats = ctx.Array("d", config.num_actors * len(ACTOR_PHASES), lock=False)
        self._phase_totals = [0.0] * len(ACTOR_PHASES)
        if config.inference == "central":
            positions = torch.full((config.num_actors * config.env_splits,
                                    config.envs_per_actor // config.env_splits + 1), -1).share_memory_()
        self.channels = ActorChannels(
            free_queue=None,  # per actor: slots.free_queue(actor_index)
            full_queue=full_queue,
            episode_queue=self._episodes, error_queue=self._errors,
            stop_event=StopFlag(ctx), policy_version=ctx.Value("q", policy_version, lock=False),
            heartbeats=self.heartbeats, phase_seconds=self.phase_seconds,
            inference_positions=positions,
        )
        self.processes: list[Any] = []  # multiprocessing.Process of each actor's current life
        self._pidfds: dict[int, int] = {}  # actor index -> a pidfd of its current life's process (Linux 5.3+)
        self._servers: dict[int, int | None] = {}  # actor index -> the pid of the fork server that started it
        self._lost_servers: set[int] = set()  # fork servers whose death was counted as a restart
        self.deaths = RecentDeaths()
        self.oom_kills = OomKills()  # tells an actor killed for want of memory from one killed otherwise
        self._unclaimed: dict[int, str] = {}  # tracebacks of actors not yet seen dead (still exiting)
        self.last_hang_check = time.monotonic()

    # ------------------------------------------------------------------------------------- start

    def start(self) -> None:
        self.processes = []
        for i in range(self.config.num_actors):  # one by one: where a start fails, `stop` still ends those begun
            self.processes.append(self.start_actor(i))

    def start_actor(self, actor_index: int) -> Any:
        """Start a new life of actor `actor_index`, with seeds no other life of the run had, and log its pid."""
        config = self.config
        seeds = self.lives.next_life(actor_index, config.envs_per_actor)
        pipes = [self.ctx.Pipe() for _ in range(config.env_splits)] if self.inference is not None else []
        self.heartbeats[actor_index] = time.monotonic()  # start-up counts as progress until it beats
        process = self.ctx.Process(  # type: ignore[attr-defined]
            target=_actor_process, name=f"actor-{actor_index}",
            args=(os.getpid(), actor_index, config, self.buffers, self.actor_model,
                  self.channels._replace(free_queue=self.slots.free_queue(actor_index)), seeds),
            kwargs={"inference_connections": [actor_end for _, actor_end in pipes] if pipes else None},
        )
        start_process(process)
        self._servers[actor_index] = fork_server_pid()
        self._close_pidfd(actor_index)
        pidfd = open_pidfd(process.pid)
        if pidfd is not None:
            self._pidfds[actor_index] = pidfd
        for split, (main_end, actor_end) in enumerate(pipes):
            actor_end.close()  # only the actor holds its end, so its death reads as end-of-file here
            assert self.inference is not None
            self.inference.connect(actor_index * config.env_splits + split, main_end)
        log.info("Actor %d started (pid %d); life %d, env seeds %s", actor_index, process.pid, seeds.life,
                 _seed_range(seeds.env_seeds))
        return process

    # ------------------------------------------------------------------------------------- learner side

    def publish(self, model: Net, version: int) -> None:
        """Copy the learner's weights into the actors' shared model (or into central inference's next snapshot)
        and count the new policy version."""
        if self.inference is None:
            self.actor_weights.load(model)
        else:
            self.inference.load_weights(model)
        self.channels.policy_version.value = version

    def episodes(self) -> list[tuple[float, int]]:
        finished: list[tuple[float, int]] = []
        while True:
            try:
                _, episode_return, episode_length = self._episodes.get_nowait()
            except queue.Empty:
                return finished
            finished.append((episode_return, episode_length))

    def scalars(self) -> dict[str, float]:
        """Where the actors' time went since the last call: each phase's share of it (`actor.ACTOR_PHASES`),
        over all actors; nothing when none acted."""
        phases = len(ACTOR_PHASES)
        totals = [sum(self.phase_seconds[a * phases + p] for a in range(self.config.num_actors))
                  for p in range(phases)]
        spent = [now - before for now, before in zip(totals, self._phase_totals, strict=True)]
        self._phase_totals = totals
        return {f"actors/{name}_share": share for name, share in phase_shares(spent).items()}

    # ------------------------------------------------------------------------------------- watch

    def check(self) -> None:
        """Replace every actor that died or hung: report it (with the traceback it sent, if any), give its
        slots to its replacement and start that. Too many deaths raise TrainingError instead."""
        self.kill_hung()
        self.oom_kills.look()  # each check: a kill is dated by the check after it, not by the next death
        dead = [(index, process) for index, process in enumerate(self.processes) if not process.is_alive()]
        if not dead:
            return
        for _, process in dead:
            process.join()
        lost = [index for index, process in dead if self._end_if_lost(index, process)]
        # Read after the join: an actor writes its traceback before it exits. One that failed at the same time
        # may have sent its own and not yet exited: kept for the check that sees it dead.
        self._unclaimed.update(self.tracebacks())
        for index, process in dead:
            # The fork server's death costs every actor at once: one restart counted for all it lost, whether this
            # check sees them all or a later one sees some.
            counted = index not in lost or self._first_loss_of_server(index)
            self._replace(index, process, self._unclaimed.pop(index, "").strip(), counted)

    def _first_loss_of_server(self, index: int) -> bool:
        """Whether actor `index`, lost with its fork server, is the first of that server's actors seen lost."""
        server = self._servers.get(index)
        if server is None:
            return True
        first = server not in self._lost_servers
        self._lost_servers.add(server)
        return first

    def _replace(self, index: int, process: BaseProcess, detail: str, counted: bool = True) -> None:
        how = exit_description(process.exitcode, self.oom_kills, process.pid)
        log.error("Actor %d (pid %d) died: %s%s", index, process.pid, how, f"\n{detail}" if detail else "")
        progress = self.channels.policy_version.value  # a new version: the learner updated since the last death
        deaths = self.deaths.add(progress) if counted else self.deaths.recent()
        limit = self.config.max_actor_restarts
        if deaths > limit:
            raise TrainingError(
                f"actors died {deaths} times {self.deaths.span()} "
                f"(--max_actor_restarts {limit}); last: actor {index}, {how}" + (f"\n{detail}" if detail else ""))
        returned = self.slots.reclaim(index)
        self.processes[index] = self.start_actor(index)
        log.warning("Restarted actor %d (%d slots returned; %d restarts %s, at most %d)", index,
                    returned, deaths, self.deaths.span(), limit)

    def _end_if_lost(self, index: int, process: BaseProcess) -> bool:
        """Kill actor `index` where its process still runs although `is_alive` says it ended (`end_if_lost`):
        its slots must not go to another life while it can still write them."""
        return end_if_lost(self._pidfds.get(index), process, f"Actor {index}",
                           "killing the actor before its slots go to its next life")

    def _close_pidfd(self, index: int) -> None:
        pidfd = self._pidfds.pop(index, None)
        if pidfd is not None:
            os.close(pidfd)

    def kill_hung(self) -> None:
        """Kill every actor that showed no progress for --actor_timeout_s (an env stuck in a step): `check`
        then replaces it like any actor that died."""
        timeout_s = self.config.actor_timeout_s
        if not timeout_s:
            return
        now = time.monotonic()
        monitor_gap_s, self.last_hang_check = now - self.last_hang_check, now
        heartbeats = self.heartbeats
        if monitor_gap_s > timeout_s / 2:
            # This process was not running either (Ctrl-Z, a stopped container): the actors' silence is not
            # theirs. Give every actor a new grace period instead.
            for index in range(len(self.processes)):
                heartbeats[index] = now
            return
        for index, process in enumerate(self.processes):
            silent_s = now - heartbeats[index]
            if silent_s > timeout_s and process.is_alive():
                log.error("Actor %d (pid %d) made no progress for %.0f s (--actor_timeout_s %g); killing it",
                          index, process.pid, silent_s, timeout_s)
                self.oom_kills.killed_here(process.pid)
                process.kill()
                process.join(timeout=5)
                heartbeats[index] = now  # one report per timeout if even SIGKILL does not end it

    def tracebacks(self) -> dict[int, str]:
        """actor index -> the traceback it sent before dying, for every one sent since the last call."""
        tracebacks: dict[int, str] = {}
        while True:
            try:
                index, text = self._errors.get_nowait()
            except (queue.Empty, OSError):
                return tracebacks
            tracebacks[index] = text

    # ------------------------------------------------------------------------------------- stop

    def request_stop(self) -> None:
        self.channels.stop_event.set()

    def stop(self, drain: Callable[[], None]) -> None:
        """Set the stop flag and wait for actors to see it, calling `drain` meanwhile (an actor blocked writing to
        a full episode pipe sees the flag only once it is read); then kill the stragglers (actors ignore SIGTERM)."""
        self.channels.stop_event.set()
        for index, text in sorted(self._unclaimed.items()):  # sent by actors not yet seen dead when the run stopped
            log.error("Actor %d failed:\n%s", index, text.strip())
        self._unclaimed.clear()
        deadline = time.monotonic() + ACTOR_JOIN_TIMEOUT_S
        while time.monotonic() < deadline and any(process.is_alive() for process in self.processes):
            drain()
            for text in self.tracebacks().values():
                log.error("An actor failed while stopping:\n%s", text.strip())
            time.sleep(0.02)
        for process in self.processes:
            if process.is_alive():
                log.warning("Actor %s (pid %d) did not stop in %.0f s; killing it", process.name, process.pid,
                            ACTOR_JOIN_TIMEOUT_S)
                process.kill()
            process.join(timeout=ACTOR_JOIN_TIMEOUT_S)  # a process in the kernel's uninterruptible sleep
            if process.is_alive():                      # outlives even SIGKILL for a while: not waited on
                log.warning("Actor %s (pid %d) did not end after SIGKILL; leaving it", process.name, process.pid)
        for index, process in enumerate(self.processes):
            self._end_if_lost(index, process)
            self._close_pidfd(index)

    def close(self) -> None:
        """Close every channel and stop the fork server; after `stop`."""
        for index in list(self._pidfds):
            self._close_pidfd(index)
        self.slots.close()
        self._episodes.close()
        self._errors.close()
        stop_fork_server()


def _ledger(ctx: BaseContext, slot_owner: torch.Tensor, num_actors: int, full_queue: RecordQueue,
            remote_slots: int) -> SlotLedger:
    """The slots of `num_actors` actors, round robin, then `remote_slots` of one more writer."""
    if not remote_slots:
        return SlotLedger(ctx, slot_owner, num_actors, full_queue)
    local_slots = len(slot_owner) - remote_slots
    homes = [slot % num_actors for slot in range(local_slots)] + [num_actors] * remote_slots
    return SlotLedger(ctx, slot_owner, num_actors + 1, full_queue, homes)


def _seed_range(seeds: tuple[int, ...]) -> str:
    return f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else str(seeds[0])


OOM_SCORE_ADJ = 500  # of actors and the evaluator: out of memory, the kernel kills one of them before the learner


def prefer_for_the_oom_killer() -> None:
    """Make this child process the out-of-memory killer's choice before the main process (which holds the learner
    and touches every slot, so would be chosen first): a child killed is replaced, and if the memory runs out
    again and again the run stops in order, with a final checkpoint, rather than losing everything since the
    last one. Raising one's own score needs no privilege; where /proc is not there, nothing changes."""
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
        f.write(str(OOM_SCORE_ADJ))


def _actor_process(main_pid: int, *actor_args: Any, **actor_kwargs: Any) -> None:
    """The body of an actor process: die with the run, report crashes, act (`actor.run_actor`)."""
    die_with_main_process(main_pid)
    leave_stop_signals_to_main_process()
    torch.set_num_threads(1)  # batched inference is cheapest per sample with one thread per actor
    faulthandler.enable()  # a segfault in an env prints the Python stack to stderr before the process dies
    # Actors run ahead of the learner until the free slots run out; on a machine with fewer cores than
    # processes the learner is the bottleneck, so it should win every contended core.
    with contextlib.suppress(OSError):
        os.nice(ACTOR_NICENESS)
    prefer_for_the_oom_killer()
    keep_freed_memory()
    # run_actor sends the traceback of whatever kills it to the main process, which logs it with the death. Printed
    # here too (multiprocessing's default for an exception), every death would show it twice on the console.
    try:
        run_actor(*actor_args, **actor_kwargs)
    except Exception:  # noqa: BLE001 - reported by run_actor, see above
        sys.exit(1)


def start_fork_server() -> None:
    """Start the fork server now rather than with the first actor: it imports torch and this package (2-3 s
    here), which then overlaps the rest of the run's build in this process (the optimiser's first parameter
    group alone imports torch._dynamo, about 2 s) instead of following it. Started with the stop signals
    blocked, as `start_process` would start it (see there). After `process_context`, which names what it
    preloads.

    The resource tracker (which the fork server requires; it unlinks what multiprocessing registered with it
    should the main process die) comes first, also
    started with the stop signals blocked: it ignores Ctrl-C and SIGTERM of its own accord but would die of a
    SIGHUP to the process group (a closed terminal), and keeps the block for good. Its start unblocks Ctrl-C and
    SIGTERM in this thread on its way out: so each start under its own block."""
    from multiprocessing import forkserver, resource_tracker

    with stop_signals_blocked():
        resource_tracker.ensure_running()
    if START_METHOD != "forkserver":
        return
    with stop_signals_blocked():
        forkserver.ensure_running()


def start_process(process: BaseProcess) -> None:
    """Start a child process of the run with the stop signals (Ctrl-C, SIGTERM, SIGHUP) blocked in this thread meanwhile.

    The fork server, started by the first child, inherits the block and keeps it for good, and every
    process it forks starts with it, until `leave_stop_signals_to_main_process` ignores both: so no child
    dies of a signal meant for the process group (`timeout`, `docker stop`, a terminal's Ctrl-C), not even
    in its first instant, and a fork server killed by one could not fail every actor's liveness check at
    once (its pipes carry their exit codes). Blocked here rather than ignored: a signal that comes
    meanwhile waits, or reaches another thread, and the main process still records it (`stopping.py`).
    """
    with stop_signals_blocked():
        process.start()


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block the stop signals (Ctrl-C, SIGTERM, SIGHUP) in this thread for the block, then restore the mask it had."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def leave_stop_signals_to_main_process() -> None:
    """In a child process of the run: ignore Ctrl-C, SIGTERM and SIGHUP, which reach the whole process group. The
    main process stops its children in order; an actor killed mid-unroll would read as a crash and be
    restarted during the stop. (The child started with both blocked: see `start_process`.)"""
    ignore_stop_signals()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def die_with_main_process(main_pid: int) -> None:
    """End this child process as soon as the main process is gone (a kill -9 of run.py runs no shutdown).

    Not left to the fork server: every process it starts inherits its "alive" pipe, so it outlives the
    main process for as long as any actor does. A pidfd turns readable when `main_pid` exits (Linux 5.3+);
    elsewhere the watch polls once a second.
    """
    try:
        pidfd: int | None = os.pidfd_open(main_pid)
    except ProcessLookupError:
        os._exit(1)  # gone already
    except (AttributeError, OSError):
        pidfd = None

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])
        else:
            while True:
                time.sleep(1.0)
                try:
                    os.kill(main_pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:
                    pass
        os._exit(1)

    threading.Thread(target=watch, name="main-process-watch", daemon=True).start()


def open_pidfd(pid: int) -> int | None:
    """A pidfd of process `pid` (Linux 5.3+), or None where it has gone already or pidfds are missing."""
    with contextlib.suppress(AttributeError, OSError):
        return os.pidfd_open(pid)
    return None


def end_if_lost(pidfd: int | None, process: BaseProcess, name: str, why: str) -> bool:
    """Kill `process` (`name` in the log, `why` its reason) where it still runs although `is_alive` says it
    ended: the fork server, through which this process learns its children's exit codes, has died (killed, or
    out of memory), and every child then reads as ended with exit code 255. Waits for its end (at most
    ACTOR_JOIN_TIMEOUT_S); without a pidfd, `is_alive` is believed. Returns whether it was lost so."""
    # Any other exit code is the child's own: it did end (a pid reused before its pidfd was opened is not it).
    if pidfd is None or process.exitcode != FORK_SERVER_LOST_EXITCODE or _ended(pidfd, 0):
        return False
    log.error("%s (pid %d) still runs though the fork server reported its end (%s): the fork server has died; %s",
              name, process.pid, exit_description(process.exitcode), why)
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    if not _ended(pidfd, ACTOR_JOIN_TIMEOUT_S):
        log.warning("%s (pid %d) did not end after SIGKILL", name, process.pid)
    with contextlib.suppress(OSError):  # reaped here where this process is pid 1 and so the orphan's parent
        os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
    return True


def _ended(pidfd: int, timeout_s: float) -> bool:
    """Whether the process of `pidfd` has ended (its pidfd reads as readable then), waiting up to `timeout_s`."""
    poller = select.poll()  # not select.select: a pidfd of a large pool may be numbered past 1023
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def exit_description(exitcode: int | None, oom_kills: OomKills | None = None, pid: int | None = None) -> str:
    """How child process `pid` ended, for the log; a SIGKILL soon after the kernel's OOM killer ended processes
    (`oom_kills`) is most likely one of them, unless this process killed it itself."""
    recent = oom_kills.recent(pid) if oom_kills is not None else 0  # asked at every death, so that it forgets `pid`
    if exitcode is not None and exitcode < 0:
        with contextlib.suppress(ValueError):
            killed = f"killed by {signal.Signals(-exitcode).name}"
            if exitcode != -signal.SIGKILL or not recent:
                return killed
            assert oom_kills is not None
            return (f"{killed}, most likely for want of memory (the kernel's OOM killer ended {recent} "
                    f"process{'es' if recent > 1 else ''} {oom_kills.where} in the last {OOM_WINDOW_S:g} s, and "
                    f"{usable_memory()})")
    return f"exit code {exitcode}"


# How long an OOM kill that the count shows stays a likely cause of a child's SIGKILL: the count rises as the kill is
# sent, and the child is seen dead at a later check, once it has exited (an actor freeing gigabytes takes a while).
OOM_WINDOW_S = 30.0


def oom_kill_count_file() -> tuple[Path, str]:
    """Where the kernel counts the processes its OOM killer ended, and whose they are: this process's own cgroup
    (v2's `memory.events`, v1's `memory.oom_control`: its children are there too, and nothing else), else the whole
    machine (/proc/vmstat, Linux 4.13+, where a container's kills are every other container's too)."""
    own = own_cgroup_file("memory.events", "memory", "memory.oom_control")
    return (own, "in this process's cgroup") if own is not None else (Path("/proc/vmstat"), "on this machine")


class OomKills:
    """The kernel's count of the processes its OOM killer ended (`oom_kill_count_file`), looked at on each check of
    the children to tell one killed for want of memory from one killed by a person or another program: both end by
    SIGKILL."""

    def __init__(self, count_file: tuple[Path, str] | None = None) -> None:
        self._file, self.where = count_file if count_file is not None else oom_kill_count_file()
        self._seen = self._count()
        self._rises: list[tuple[float, int]] = []  # (when a look saw the count rise, by how much), in the window
        self._killed_here: set[int] = set()  # pids this process killed itself (hung): not the OOM killer's

    def _count(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            for line in self._file.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
        return None

    def killed_here(self, pid: int | None) -> None:
        """Note that this process is about to kill `pid` itself: its SIGKILL is not the OOM killer's."""
        if pid is not None:
            self._killed_here.add(pid)

    def look(self) -> None:
        """Read the count (32 us from /proc/vmstat); a rise since the last look counts as kills of now."""
        count, now = self._count(), time.monotonic()
        if count is not None and self._seen is not None and count > self._seen:
            self._rises.append((now, count - self._seen))
        self._seen = count
        self._rises = [(when, rise) for when, rise in self._rises if now - when <= OOM_WINDOW_S]

    def recent(self, pid: int | None = None) -> int:
        """The OOM killer's kills in the last OOM_WINDOW_S, as far as the looks saw them (this one included); 0
        where the count is not readable, or for a `pid` this process killed itself."""
        self.look()
        if pid is not None and pid in self._killed_here:
            self._killed_here.discard(pid)
            return 0
        return sum(rise for _, rise in self._rises)


def finish_within(timeout_s: float, step: Callable[[], None], what: str) -> None:
    """Run `step` in a daemon thread and wait for it at most `timeout_s`; one still going then is logged
    and left behind (it ends with the process). For the end of a run after its final checkpoint, where
    nothing is worth a process that never exits (a CI job that hangs, a scheduler's slot held for good).
    An exception `step` ended with is raised here."""
    failures: list[BaseException] = []

    def target() -> None:
        try:
            step()
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            failures.append(exc)

    thread = threading.Thread(target=target, name=what, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():  # its stack names what it waits for
        frame = sys._current_frames().get(thread.ident or 0)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(ended meanwhile)\n"
        log.error("The end of the run left %s behind: it was still going after %.0f s, at\n%s", what, timeout_s,
                  stack.rstrip())
    elif failures:
        raise failures[0]


def fork_server_pid() -> int | None:
    """The pid of the fork server this process starts its children from, or None where there is none."""
    if START_METHOD != "forkserver":
        return None
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def stop_fork_server() -> None:
    """Stop the fork server once every actor is joined.

    It would otherwise live as long as this Python process: harmless for `run.py`, which exits next, but
    a long-lived caller (a notebook, a test session) would keep an idle, torch-importing process per run.
    The next run starts a fresh one. `_stop` is the multiprocessing internal its own tests use (Python 3.8+).
    The resource tracker is left running: it exits with this process.

    Killed, then reaped by `_stop`: left to exit by itself once its "alive" pipe closes, the server would
    first run its interpreter's exit with torch loaded (0.7 s of every run's end measured here), and a
    process it forked that still held the pipe would keep it for good. It serves nothing once every actor
    is joined, and holds nothing but its socket, which `_stop` unlinks. Bounded all the same: a server
    still there after FORK_SERVER_STOP_TIMEOUT_S is logged and left, so the end of a run never hangs on it.
    """
    pid = fork_server_pid()
    if pid is None:
        return
    from multiprocessing import forkserver

    server = forkserver._forkserver

    def stop() -> None:
        with contextlib.suppress(AttributeError, OSError, ChildProcessError):
            server._stop()  # type: ignore[attr-defined]

    # A pidfd names this server for good: once `_stop` has reaped it, its pid may be another process's, but
    # the pidfd still refers to the dead server, so the kill can never hit someone else. Opened while the
    # server is an unreaped child of this process (Linux 5.3+; else the pid, which is still the server's).
    pidfd = None
    with contextlib.suppress(AttributeError, OSError):
        pidfd = os.pidfd_open(pid)
    try:
        with contextlib.suppress(ProcessLookupError):
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        stopper = threading.Thread(target=stop, name="fork-server-stop", daemon=True)
        stopper.start()
        stopper.join(FORK_SERVER_STOP_TIMEOUT_S)
        if stopper.is_alive():
            log.warning("The fork server (pid %d) was killed but not reaped within %.0f s; left behind", pid,
                        FORK_SERVER_STOP_TIMEOUT_S)
    finally:
        if pidfd is not None:
            os.close(pidfd)
