"""The learner threads of a run: take `batch_size` full slots, stage them on the device, update
(`learner.update`), publish the weights through the actor pool, count. The process shell around
`learner.py`'s algorithm; `training.py` starts and stops them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from impala import learner
from impala.actor_pool import ActorPool
from impala.buffers import Buffers, pin_observations, unpin_observations
from impala.config import Config, TrainingError, first_line, usable_cores
from impala.learner import LearnerState
from impala.metrics import IntervalStats

if TYPE_CHECKING:
    from impala.distributed import Coordinator

log = logging.getLogger("impala")


def select_device(config: Config) -> torch.device:
    if not config.disable_cuda and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def learner_torch_threads(config: Config, device: torch.device, local_ranks: int = 1) -> int:
    """Torch threads of the learner's process. On the CPU, the cores the actors leave (of this process's share when
    `local_ranks` learner processes share the machine): extra torch threads on busy cores cost more CPU per update
    than they save (measured in BENCHMARKS.md). With a GPU, one: the process's CPU work is then small copies
    (stacking a batch's small tensors, central inference's gathers), and OpenMP's workers spin for a while after
    each parallel copy, on cores the actors need (2 threads on 2 cores: 2.5 ms of CPU per 0.3-ms gather where 1
    thread takes 0.4; measured in BENCHMARKS.md, "The trainer's torch threads on a GPU machine")."""
    if device.type != "cpu":
        return 1
    # --ray local: the remote actors are processes of this machine too.
    actors_here = config.num_actors + (config.ray_actors if config.ray == "local" else 0)
    return max(1, usable_cores() // local_ranks - actors_here)


class OutOfDeviceMemory(TrainingError):
    """A learner ran out of device memory: the run's sizes need more than the device has. Not a bug, and the weights
    are whole: an allocation fails between the in-place writes of a gradient step's weights, not among them. An
    update cut short may have applied some of its gradient steps (and RMSprop may have moved its averages for the
    step that failed) without being counted: a final checkpoint then holds a few steps more than its counters say,
    a state training could have reached, not a corrupt one."""


def out_of_memory(exc: torch.OutOfMemoryError, device: torch.device) -> OutOfDeviceMemory:
    """The one line a learner that ran out of device memory ends the run with: the allocator's first two sentences
    (what ran out, what it tried to allocate) and the flags that make an update smaller."""
    first = ". ".join(first_line(exc).split(". ")[:2])
    return OutOfDeviceMemory(f"the learner ran out of memory on {device} ({first}): a smaller update fits, "
                             "with a lower --batch_size or --unroll_length, or more --minibatches")


class Learners:
    """`config.num_learner_threads` threads updating `state` from the slots `pool` fills.

    Every update, and every copy of the weights that must not fall inside one (a checkpoint, an
    evaluation), holds `update_lock`. A thread that fails, or `max_bad_updates` skipped updates in a row,
    put the reason in `errors` and set `stop_event`; the monitor raises it.

    Under torchrun (`coordinator`), every update starts with a vote of all ranks (`distributed.py`): a thread
    told to stop while it waits for slots still votes, so that no other rank waits for it in vain.
    """

    def __init__(self, config: Config, state: LearnerState, buffers: Buffers, pool: ActorPool, device: torch.device,
                 amp: bool, stats: IntervalStats, update_lock: threading.Lock,
                 coordinator: Coordinator | None = None) -> None:
        self.config = config
        self.state = state
        self.buffers = buffers
        self.pool = pool
        self.device = device
        self.loss_fn = learner.loss_function(config, device, state.world_size)  # compiled with --compile
        self.update = learner.update_function(config, device, state.world_size)  # one CUDA graph per batch on a GPU
        self.amp = amp  # bfloat16 autocast
        self.stats = stats
        self.update_lock = update_lock
        self.coordinator = coordinator
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self.failed_at: float | None = None  # when the first of them came (time.monotonic())
        # An update that raised (other than for want of device memory), said under `update_lock` before it is let
        # go: whoever takes the lock next (a checkpoint, an evaluation's copy) finds the weights it may have torn.
        self.torn = False
        self.pinned = False  # the slots' observations page-locked for the GPU (`buffers.pin_observations`)
        # When each thread took the batch it is working on (absent while it waits for slots): --learner_timeout_s.
        self.busy_since: dict[threading.Thread, float] = {}

    def weights_whole(self) -> bool:
        """Whether a final checkpoint may save the weights: no thread failed, or only for want of device memory.
        After a bug or `max_bad_updates` non-finite updates the last checkpoint is the one to keep."""
        return not self.torn and all(isinstance(error, OutOfDeviceMemory) for error in self.errors)

    def start(self) -> None:
        """Start the threads; on a GPU, first page-lock the slots' observations for them (`--pin_slots`)."""
        if self.device.type == "cuda" and self.config.pin_slots:
            self.pinned = pin_observations(self.buffers, self.device)
        for i in range(self.config.num_learner_threads):
            thread = threading.Thread(target=self._thread, name=f"learner-{i}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def stop(self, timeout_s: float) -> None:
        """Ask every thread to stop and wait up to `timeout_s` in all; one inside an update finishes it. The slots
        are unlocked once no thread is left that could be copying from them."""
        self.stop_event.set()
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.pinned and not any(thread.is_alive() for thread in self.threads):
            unpin_observations(self.buffers, self.device)
            self.pinned = False

    def _thread(self) -> None:
        try:
            self._learn()
        except TrainingError as exc:  # not a bug: another learner process (torchrun) is gone; one line
            log.error("Learner thread %s stopped: %s", threading.current_thread().name, exc)
            self._fail(exc)
        except torch.OutOfMemoryError as exc:  # not a bug either: the run's sizes need more than the device has
            error = out_of_memory(exc, self.device)
            log.error("Learner thread %s stopped: %s", threading.current_thread().name, error)
            self._fail(error)
        # Logged here with its traceback; the monitor stops the run. A library's SystemExit too: a thread gone
        # without a word would stall the run for good.
        except BaseException as exc:
            log.exception("Learner thread %s failed", threading.current_thread().name)
            self._fail(exc)
        finally:
            self.busy_since.pop(threading.current_thread(), None)

    def _take_full_slots(self) -> list[int] | None:
        slots: list[int] = []
        while len(slots) < self.config.batch_size:
            slot = self.pool.slots.take_full(timeout_s=0.2)
            if slot is not None:
                slots.append(slot)
            elif self.stop_event.is_set():
                for slot in slots:  # give them back so a later run of this process could use them
                    self.pool.slots.give_back(slot)
                return None
        return slots

    def _learn(self) -> None:
        config, state = self.config, self.state
        staging = learner.BatchStaging(self.buffers, config.batch_size, pin=self.device.type == "cuda")
        reducer = self.coordinator.step_reducer if self.coordinator is not None else None
        this_thread = threading.current_thread()
        while self.coordinator is not None or not self.stop_event.is_set():
            self.busy_since.pop(this_thread, None)  # waiting for the actors is not the learner's time
            wait_start = time.perf_counter()
            slots = self._take_full_slots()
            if slots is None and self.coordinator is None:
                return
            self.busy_since[this_thread] = time.monotonic()
            copy_start = stack_end = time.perf_counter()
            if slots is not None:
                staging.fill(slots)
                stack_end = time.perf_counter()
                versions = self.buffers["policy_version"][slots]  # a copy: indexed by a list
                batch, core_state = staging.to(self.device)
                for slot in slots:  # nothing reads them any more
                    self.pool.slots.give_back(slot)
            copy_end = time.perf_counter()
            self.busy_since.pop(this_thread, None)  # another thread's update (or vote, under torchrun) is not ours
            with self.update_lock:
                self.busy_since[this_thread] = time.monotonic()
                locked = time.perf_counter()
                steps = self._steps_of_update(stop=slots is None)
                if not steps:
                    return
                update_start = time.perf_counter()
                try:
                    stats = self.update(state.model, state.optimizer, state.scheduler, batch, core_state, config,
                                        self.amp, reducer, self.loss_fn)
                    # update() ends by reading its stats as floats, which waits for the device: on CUDA this phase
                    # also holds the tail of the non-blocking host-to-device copy.
                    publish_start = time.perf_counter()
                    self.pool.publish(state.model, state.updates + 1)
                except torch.OutOfMemoryError:
                    raise  # an allocation that failed: `weights_whole` takes the weights for whole, as it did
                except BaseException:
                    self.torn = True  # `_thread` says why, once the lock is let go
                    raise
                publish_end = time.perf_counter()
                state.step += steps
                state.updates += 1
                timings_s = {"wait_batch": copy_start - wait_start, "host_to_device": copy_end - copy_start,
                             "stack": stack_end - copy_start,  # the part of host_to_device that stacks the slots
                             "update_lock_wait": locked - copy_end,
                             "forward_backward": publish_start - update_start,
                             "publish": publish_end - publish_start}
                if self.coordinator is not None:  # waiting in the vote for every rank to agree on this update
                    timings_s["vote"] = update_start - locked
                self.record(stats, float((state.updates - 1 - versions).float().mean()), timings_s)

    def _steps_of_update(self, stop: bool) -> int:
        """The agent steps the coming update adds to the run (those of every rank under torchrun), or 0 when
        it must not happen: the run is done or stopping (on any rank). Caller holds `update_lock`."""
        stop = stop or self.state.step >= self.config.total_steps or self.stop_event.is_set()
        if self.coordinator is None:
            return 0 if stop else self.config.steps_per_update
        # Waiting for the other ranks (their actors may be slow) is not this learner hanging: --learner_timeout_s does
        # not count it; a rank that never votes ends the collective after COLLECTIVE_TIMEOUT_S.
        this_thread = threading.current_thread()
        self.busy_since.pop(this_thread, None)
        steps = self.coordinator.vote(stop, self.config.steps_per_update)
        self.busy_since[this_thread] = time.monotonic()
        if not steps:
            self.stop_event.set()  # this rank's other learner threads, waiting for slots, stop too
        return steps

    def record(self, stats: dict[str, float], policy_lag: float, timings_s: dict[str, float] | None = None) -> None:
        """Count one update in the interval stats, or as skipped. Caller holds `update_lock`."""
        self.stats.add_timings(timings_s or {})  # skipped updates took time too
        state = self.state
        if not stats["skipped"]:
            state.bad_updates_in_a_row = 0
            self.stats.add_update(stats, policy_lag)
            return
        state.skipped_updates += 1
        state.bad_updates_in_a_row += 1
        log.warning("Skipped a non-finite gradient step in the update at step %d (loss %s, grad norm %s)",
                    state.step, stats["total_loss"], stats["grad_norm"])
        if state.bad_updates_in_a_row >= self.config.max_bad_updates:
            self._fail(TrainingError(
                f"{state.bad_updates_in_a_row} non-finite updates in a row; stopping with the last good "
                "checkpoint (try a lower --learning_rate or --grad_norm_clipping)"))

    def _fail(self, error: BaseException) -> None:
        """Record why learning stopped, and stop every learner thread; the monitor ends the run with it."""
        if self.failed_at is None:
            self.failed_at = time.monotonic()
        self.errors.append(error)
        self.stop_event.set()

    def failed_before(self, at: float | None) -> bool:
        """Whether a learner thread failed before `at` (time.monotonic())."""
        return self.failed_at is not None and at is not None and self.failed_at < at
