"""The actor loop: step a batch of envs with one batched policy forward and write unrolls into slots.

`run_actor` is the body of an actor process; `actor_pool.py` creates the process and the queues and
passes them in, with the shared model `training.py` made. It can also be called inline for a fixed number of unrolls.
"""

from __future__ import annotations

import queue
import select
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import NamedTuple, Protocol

import numpy as np
import torch

from impala.buffers import Buffers, write_row
from impala.channels import (
    SLOT_WAIT_ROW,
    ErrorQueue,
    SharedFloats,
    SharedInt,
    SlotQueue,
    StopSignal,
    signal,
    take_signal,
)
from impala.config import Config
from impala.environment import EnvBatch, Step
from impala.model import CastTorso, Net, sample_actions, use_amp
from impala.seeding import LifeSeeds, first_life


class ActorChannels(NamedTuple):
    """What connects an actor to the main process (all created by `actor_pool.LocalActorPool`)."""

    free_queue: SlotQueue | None  # slot numbers this actor may fill (its own pipe, slots.py); None until assigned
    full_queue: SlotQueue  # slot numbers of finished unrolls, for the learner
    episode_queue: SlotQueue  # (actor_index, return, length) of every finished full game
    error_queue: ErrorQueue  # (actor_index, traceback text) when the actor dies of an exception
    stop_event: StopSignal  # set by the main process: finish and return
    policy_version: SharedInt  # learner updates applied to the shared model
    # --inference central: [num_actors x env_splits, envs per split + 1] int64, each split's slots and row
    inference_positions: torch.Tensor | None = None
    # [num_actors] float64: each actor's last sign of progress (time.monotonic, one clock for all processes)
    heartbeats: SharedFloats | None = None
    # [num_actors x len(ACTOR_PHASES)] float64: the seconds each actor spent in each phase (`PhaseClock`)
    phase_seconds: SharedFloats | None = None


# Where an actor's time goes, in the order of `ActorChannels.phase_seconds`: waiting for free slots, choosing
# actions (its own forward, or the round trip to central inference), its envs stepping, and writing rows and
# handing over slots.
ACTOR_PHASES = ("slot_wait", "policy", "env", "write")
SLOT_WAIT, POLICY, ENV, WRITE = range(len(ACTOR_PHASES))


def phase_shares(seconds: Sequence[float]) -> dict[str, float]:
    """Each phase's share of `seconds` (one figure per phase of ACTOR_PHASES); empty when no time was spent."""
    total = sum(seconds)
    return {name: spent / total for name, spent in zip(ACTOR_PHASES, seconds, strict=True)} if total > 0 else {}


class PhaseClock:
    """Adds actor `actor_index`'s time to its row of `ActorChannels.phase_seconds`: each `lap(phase)` gives
    `phase` the time since the previous lap, by any of the actor's env splits, so that the phases add up to
    the whole of the actor's time since the clock started. Nothing is kept without a `phase_seconds`."""

    def __init__(self, channels: ActorChannels, actor_index: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._seconds = channels.phase_seconds
        self._base = actor_index * len(ACTOR_PHASES)
        self._clock = clock
        self._last = clock()

    def start(self) -> None:
        """Count from now on."""
        self._last = self._clock()

    def lap(self, phase: int) -> None:
        if self._seconds is not None:
            now = self._clock()
            self._seconds[self._base + phase] += now - self._last
            self._last = now


class Heartbeat:
    """Marks that actor `actor_index` is making progress, for the main process's hung-actor watch."""

    def __init__(self, channels: ActorChannels, actor_index: int) -> None:
        self._heartbeats = channels.heartbeats
        self._index = actor_index

    def __call__(self) -> None:
        if self._heartbeats is not None:
            self._heartbeats[self._index] = time.monotonic()


class Policy(Protocol):
    """Chooses the actions at row t of the slots `index` and writes action, logits and baseline there.

    `final_values` values the observations that time limits cut episodes at, after the action at row t and
    before the next call (with an LSTM, from the state that action was chosen with, not yet reset).
    """

    core_state: tuple[torch.Tensor, ...]

    def __call__(self, buffers: Buffers, index: torch.Tensor, t: int, row: dict[str, torch.Tensor]
                 ) -> torch.Tensor: ...

    def final_values(self, buffers: Buffers, index: torch.Tensor, t: int, final_obs: torch.Tensor,
                     envs: torch.Tensor) -> torch.Tensor:
        """The values [K] of rows `envs` [K] of `final_obs` [N, ...]."""
        ...

    def waiting_for_slots(self, waiting: bool) -> None:
        """Called as the actor starts (True) and ends (False) a wait for free slots."""
        ...


class StopActing(Exception):
    """Raised inside the actor loop when the main process asks it to stop while it waits."""


class LocalPolicy:
    """Actions from the actor's own copy of the shared model: one batched forward for all its envs."""

    def __init__(self, model: Net, num_envs: int, amp: bool, generator: torch.Generator,
                 policy_version: SharedInt) -> None:
        self.model = model
        self.core_state = model.initial_state(num_envs)
        self.autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp)
        self.generator = generator
        # Under autocast, the torso's weights cast to bfloat16 once per policy version, not at every step.
        self.cast = CastTorso(model, torch.bfloat16) if amp else None
        self.policy_version = policy_version

    def net(self) -> Net:
        """The net to act with: the shared model, or its torso cast at the current policy version."""
        return self.cast.refresh(self.policy_version.value) if self.cast is not None else self.model

    def __call__(self, buffers: Buffers, index: torch.Tensor, t: int, row: dict[str, torch.Tensor]) -> torch.Tensor:
        """Choose actions at obs t of the slots `index`, write action/logits/baseline to row t, return actions."""
        with torch.no_grad(), self.autocast:
            output, self.core_state = self.net()(row["obs"][None], row["done"][None], self.core_state)
        logits = output.policy_logits[0]
        action = sample_actions(logits, self.generator)
        buffers["action"][index, t] = action
        buffers["policy_logits"][index, t] = logits
        buffers["baseline"][index, t] = output.baseline[0]
        return action

    def final_values(self, buffers: Buffers, index: torch.Tensor, t: int, final_obs: torch.Tensor,
                     envs: torch.Tensor) -> torch.Tensor:
        """One forward of the truncated envs' final observations; the core state is read, not advanced."""
        state = tuple(s[:, envs] for s in self.core_state)  # [layers, N, H] -> [layers, K, H]
        not_a_start = torch.zeros(1, len(envs), dtype=torch.bool)
        with torch.no_grad(), self.autocast:
            output, _ = self.net()(final_obs[envs][None], not_a_start, state)
        return output.baseline[0].float()

    def waiting_for_slots(self, waiting: bool) -> None:
        pass


class RemotePolicy:
    """Actions from the main process's inference thread (--inference central).

    The actor publishes where its observations are (slots and row) in `positions`, signals on `connection`
    and waits for the answer (`channels.signal`); by then the thread has written the actions into the slots.
    """

    core_state: tuple[torch.Tensor, ...] = ()  # central inference has no recurrent core

    def __init__(self, connection: Connection, positions: torch.Tensor, stop_event: StopSignal,
                 heartbeat: Callable[[], None] = lambda: None) -> None:
        self.connection = connection
        self.positions = positions
        self.stop_event = stop_event
        self.heartbeat = heartbeat  # waiting for the inference thread is not hanging
        # Kept for every wait: `Connection.poll` makes a new selector per call (5.8 against 1.1 us).
        self._answer = select.poll()
        self._answer.register(connection.fileno(), select.POLLIN)

    def __call__(self, buffers: Buffers, index: torch.Tensor, t: int, row: dict[str, torch.Tensor]) -> torch.Tensor:
        self.positions[:-1] = index
        self.positions[-1] = t
        signal(self.connection)
        while not self._answer.poll(200):
            if self.stop_event.is_set():
                raise StopActing()
            self.heartbeat()
        if not take_signal(self.connection):
            raise EOFError("the inference thread's end of the pipe was closed")
        return buffers["action"][index, t]

    def final_values(self, buffers: Buffers, index: torch.Tensor, t: int, final_obs: torch.Tensor,
                     envs: torch.Tensor) -> torch.Tensor:
        """An ordinary request for row t + 1 holding the final observations; the server's outputs there are
        read for their baselines and then overwritten, as the actor writes row t + 1 and acts on it next."""
        buffers["obs"][index, t + 1] = final_obs
        buffers["done"][index, t + 1] = False
        self(buffers, index, t + 1, {})
        return buffers["baseline"][index[envs], t + 1].clone()

    def waiting_for_slots(self, waiting: bool) -> None:
        """Tell the inference threads not to wait for this actor's requests meanwhile (channels.SLOT_WAIT_ROW)."""
        self.positions[-1] = SLOT_WAIT_ROW if waiting else -1


def _take_slots(free_queue: SlotQueue, count: int, stop_event: StopSignal,
                heartbeat: Callable[[], None] = lambda: None,
                waiting: Callable[[bool], None] = lambda waiting: None) -> list[int] | None:
    """`count` slot numbers from this actor's free pipe; None when stopped. `waiting(True)` is called before the
    first wait for a slot that is not there yet, and `waiting(False)` once they are all taken."""
    slots: list[int] = []
    waited = False
    while len(slots) < count:
        try:
            slots.append(free_queue.get(timeout=0.2) if waited else free_queue.get_nowait())
        except queue.Empty:
            if not waited:
                waiting(True)
                waited = True
            elif stop_event.is_set():
                return None
            else:
                heartbeat()  # waiting for the learner to free slots is not hanging
    if waited:
        waiting(False)
    return slots


def run_actor(actor_index: int, config: Config, buffers: Buffers, model: Net, channels: ActorChannels,
              seeds: LifeSeeds | None = None, max_unrolls: int | None = None,
              inference_connections: list[Connection] | None = None) -> None:
    """Fill slots until `channels.stop_event` is set (or `max_unrolls` unrolls per env are done).

    `seeds`: this life's env seeds and sampling seed (default: the actor's first life in a new run).
    `inference_connections`: with --inference central, one pipe to the inference thread per env split.
    Changes no process-wide state (signals, threads): the process that runs it sets those up.
    """
    seeds = seeds if seeds is not None else first_life(config.seed, actor_index, config.envs_per_actor)
    try:
        _act(actor_index, config, buffers, model, channels, seeds, max_unrolls, inference_connections)
    except (KeyboardInterrupt, StopActing):
        pass
    except Exception:
        channels.error_queue.put((actor_index, traceback.format_exc()))
        raise


def _act(actor_index: int, config: Config, buffers: Buffers, model: Net, channels: ActorChannels,
         seeds: LifeSeeds, max_unrolls: int | None, inference_connections: list[Connection] | None) -> None:
    """Run the actor's env splits in turn: each acts until it has sent actions to its envs, then the next
    one acts while those envs step (ale-py steps them in its own thread). One split acts and waits."""
    heartbeat = Heartbeat(channels, actor_index)
    heartbeat()
    generator = torch.Generator().manual_seed(seeds.sampling_seed)
    splits = config.env_splits
    per_split = config.envs_per_actor // splits
    envs = []
    clock = PhaseClock(channels, actor_index)
    try:
        loops = []
        for split in range(splits):
            split_seeds = seeds.env_seeds[split * per_split:(split + 1) * per_split]
            env = EnvBatch(config.env, per_split, split_seeds, episodic_life=config.episodic_life,
                           fire_on_life_loss=config.fire_on_life_loss)
            envs.append(env)
            policy: Policy
            if inference_connections is not None:
                assert channels.inference_positions is not None
                positions = channels.inference_positions[actor_index * splits + split]
                policy = RemotePolicy(inference_connections[split], positions, channels.stop_event, heartbeat)
            else:
                policy = LocalPolicy(model, per_split, use_amp(config.amp, torch.device("cpu"), model.model),
                                     generator, channels.policy_version)
            loops.append(_split_loop(actor_index, config.unroll_length, buffers, channels, env, policy, max_unrolls,
                                     heartbeat, clock))
        clock.start()  # from the first reset on: making the envs is start-up, not a phase
        while loops:
            for loop in list(loops):
                if next(loop, StopIteration) is StopIteration:
                    loops.remove(loop)
    finally:
        for env in envs:
            env.close()


def _split_loop(actor_index: int, T: int, buffers: Buffers, channels: ActorChannels, env: EnvBatch, policy: Policy,
                max_unrolls: int | None, heartbeat: Heartbeat, clock: PhaseClock) -> Iterator[None]:
    """One env split's acting, as a generator that yields while its envs step; ends when stopped. Its time goes
    to `clock`'s phases (the time another split spends while this one yields is that split's)."""
    n = env.num_envs
    # The current row of every env; it becomes row 0 of the next unroll.
    row = {
        "obs": torch.from_numpy(env.reset()),
        "done": torch.ones(n, dtype=torch.bool),
        "reward": torch.zeros(n),
        "truncated": torch.zeros(n, dtype=torch.bool),
        "truncation_value": torch.zeros(n),
        "episode_return": torch.zeros(n),
        "episode_step": torch.zeros(n, dtype=torch.int64),
        "game_over": torch.zeros(n, dtype=torch.bool),
    }
    clock.lap(ENV)
    unrolls = 0
    while not channels.stop_event.is_set() and (max_unrolls is None or unrolls < max_unrolls):
        assert channels.free_queue is not None, "each actor is given its own free pipe"
        slots = _take_slots(channels.free_queue, n, channels.stop_event, heartbeat, policy.waiting_for_slots)
        clock.lap(SLOT_WAIT)
        if slots is None:
            return
        index = torch.tensor(slots)
        buffers["policy_version"][index] = channels.policy_version.value
        for i, state in enumerate(policy.core_state):
            buffers[f"core_state_{i}"][index] = state.transpose(0, 1)  # [layers, N, H] -> [N, layers, H]
        for t in range(T + 1):
            write_row(buffers, slots, index, t, row)
            if t == T:
                break
            clock.lap(WRITE)
            action = policy(buffers, index, t, row)
            clock.lap(POLICY)
            env.send(action.numpy())
            yield  # the other splits act while these envs step
            step = env.recv()
            clock.lap(ENV)
            heartbeat()
            row = _row_from_step(step)
            if step.truncated.any():
                envs = torch.from_numpy(np.flatnonzero(step.truncated))
                clock.lap(WRITE)
                row["truncation_value"][envs] = policy.final_values(buffers, index, t,
                                                                    torch.from_numpy(step.final_obs), envs)
                clock.lap(POLICY)
            for game in np.flatnonzero(step.game_over):
                channels.episode_queue.put((actor_index, float(step.episode_return[game]),
                                            int(step.episode_step[game])))
        for slot in slots:  # the main process marks them as the learners' when it takes them (slots.py)
            channels.full_queue.put(slot)
        clock.lap(WRITE)
        unrolls += 1


def _row_from_step(step: Step) -> dict[str, torch.Tensor]:
    return {
        "obs": torch.from_numpy(step.obs),
        "done": torch.from_numpy(step.done),
        "reward": torch.from_numpy(step.reward),
        "truncated": torch.from_numpy(step.truncated),
        "truncation_value": torch.zeros(len(step.reward)),
        "episode_return": torch.from_numpy(step.episode_return.astype(np.float32)),
        "episode_step": torch.from_numpy(step.episode_step),
        "game_over": torch.from_numpy(step.game_over),
    }
