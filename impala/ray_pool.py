"""Remote actors through Ray (--ray): actors on other machines fill the same slots as the local ones.

    learner's machine (RayActorPool)                   any node of the Ray cluster (RemoteActor, one process)
    main thread: start, check (replace the dead), stop   acting thread: `actor.run_actor` into its own
    receiver thread: REQUESTS_IN_FLIGHT `unrolls`          small buffers, exactly as a local actor acts
      calls per remote actor, taken with `ray.wait`      unrolls(version, [weights]): newer weights loaded
      in completion order; each unroll copied into a       first, then whole unrolls of every env as numpy,
      free slot of the ledger's remote writer and          with the version it was acted with and the
      onto the full queue the local actors use             games finished meanwhile
    learner threads: `publish`: one `ray.put` per --ray_publish_every policy versions

So the learners, V-trace and the checkpoint never see Ray: they take full slots from `slots` as always,
and `stats/policy_lag` reads the version each remote unroll carries in its slot. Ray is imported only
here, and only when --ray is given; it is an optional extra (requirements-ray.txt).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import queue
import re
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from impala.actor import ActorChannels, run_actor
from impala.actor_pool import (
    ACTOR_NICENESS,
    LocalActorPool,
    RecentDeaths,
    stop_signals_blocked,
)
from impala.buffers import Buffers, BufferSpec, create_buffers, usable_memory
from impala.config import Config, TrainingError, UserError, first_line, is_head_address
from impala.environment import is_atari
from impala.learner import BATCH_KEYS
from impala.model import Net
from impala.seeding import ActorLives, LifeSeeds
from impala.stopping import Stopped, StopRequests

log = logging.getLogger("impala")

REQUESTS_IN_FLIGHT = 1  # per remote actor: its acting thread fills free slots meanwhile; more only adds lag
WAIT_S = 0.2  # every wait of the receiver is bounded: it sees the stop flag and dead actors this often
STOP_TIMEOUT_S = 5.0  # remote actors asked to stop get this long, then they are killed
REACH_TIMEOUT_S = 10.0  # a head node's address that accepts no connection in this long is refused
CONNECT_TIMEOUT_S = 60.0  # a cluster that has not answered ray.init in this long is refused
NAMES_GRACE_S = 10.0  # how long a start waits for a remote actor of its run to go before refusing to run
PLACEMENT_WARNING_S = 60.0  # a remote actor not acting after this long is reported (no resources for it?)
NAMESPACE = "impala"  # Ray namespace of the run's named actors
HEAD_PROBE_S = 5.0  # how often the learner's side asks Ray's head (its GCS) whether it is there, and how long it waits
HEAD_LOST_S = 20.0  # a head that answered none of the asks of this long is lost: the run ends, with its final checkpoint
# Ray ends a process whose GCS has been silent for 60 s (its gcs_rpc_server_reconnect_timeout_s), however far its final
# checkpoint has come; the run's own rule (HEAD_LOST_S) ends it first, and this leaves it time to save.
RAY_GCS_RECONNECT_TIMEOUT_S = 600
REPO_ROOT = Path(__file__).resolve().parent.parent


def require_ray() -> Any:
    """The `ray` module; UserError (one line, exit 2) when it is not installed."""
    try:
        import ray
    except ImportError:
        raise UserError("--ray needs Ray, which is not installed: pip install -r requirements-ray.txt") from None
    return ray


def shipped_keys(buffers: Buffers) -> tuple[str, ...]:
    """The fields of a slot a remote actor sends: what the learner reads, and the version it was acted with."""
    return (*BATCH_KEYS, "policy_version", *sorted(k for k in buffers if k.startswith("core_state_")))


def unroll_bytes(buffers: Buffers) -> int:
    """The bytes of one unroll a remote actor sends."""
    return sum(buffers[key][0].nbytes for key in shipped_keys(buffers))


def pack_frames(obs: np.ndarray) -> dict[str, np.ndarray]:
    """Atari's frame stacks of whole unrolls, [N, T + 1, C, H, W], as the least that rebuilds them exactly: every
    row's newest frame (`obs_newest`), and the C - 1 older frames (`obs_older`) only of the rows sent whole
    (`obs_whole`): row 0, and any row whose older frames are not the row before's newer ones (an env's reset).
    Checked row by row, so it is exact whatever the env did; about a quarter of the bytes. `write_unroll` rebuilds.
    """
    unrolls, rows = obs.shape[:2]
    continues = (obs[:, 1:, :-1] == obs[:, :-1, 1:]).reshape(unrolls, rows - 1, -1).all(axis=-1)
    whole = np.ones((unrolls, rows), dtype=bool)
    whole[:, 1:] = ~continues
    return {"obs_newest": np.ascontiguousarray(obs[:, :, -1]), "obs_whole": whole, "obs_older": obs[:, :, :-1][whole]}


def write_unroll(buffers: Buffers, keys: tuple[str, ...], fields: dict[str, np.ndarray], index: int, slot: int) -> None:
    """Unroll `index` of a remote actor's object into `slot`, its frame stacks rebuilt where they were packed."""
    for key in keys:
        target = buffers[key][slot].numpy()
        if key != "obs" or "obs_newest" not in fields:
            np.copyto(target, fields[key][index])  # from read-only object store memory
            continue
        whole = fields["obs_whole"]
        first = int(whole[:index].sum())  # rows of the unrolls before this one sent whole
        mine = whole[index]
        target[:, -1] = fields["obs_newest"][index]
        target[mine, :-1] = fields["obs_older"][first:first + int(mine.sum())]
        for t in np.flatnonzero(~mine):  # in order: row t - 1 is complete by then (row 0 is always whole)
            target[t, :-1] = target[t - 1, 1:]


# ----------------------------------------------------------------------------------------- remote side


class _Stopped(Exception):
    """A remote actor's `unrolls` was waiting for an unroll when `stop` came."""


class _Version:
    """The policy version the acting thread stamps on each unroll (`SharedInt` inside one process)."""

    value: int = -1


class RemoteActor:
    """The body of one remote actor process, made a Ray actor by `RayActorPool`.

    A thread runs `actor.run_actor` into slots of this process, exactly as a local actor fills shared memory;
    `unrolls` hands out `ray_unrolls_per_env` full unrolls of every env at a time (one Ray object) and gives
    their slots back. Calls from the learner's side: `unrolls` (one at a time) and `stop` (concurrently).
    """

    def __init__(self, actor_index: int, config: Config, observation_shape: tuple[int, ...],
                 observation_dtype: torch.dtype, num_actions: int, seeds: LifeSeeds) -> None:
        torch.set_num_threads(1)  # batched inference is cheapest per sample with one thread per actor
        # Ray starts workers at niceness 15 (its worker_niceness); on a node shared with a learner they would
        # then get a seventh of a local actor's share of a core. Take a local actor's niceness where allowed.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, ACTOR_NICENESS)
        self.actor_index, self.config, self.seeds = actor_index, config, seeds
        self.model = Net(observation_shape, num_actions, config.model, config.use_lstm, config.hidden_size).eval()
        self.num_envs = config.envs_per_actor
        self.per_object = self.num_envs * config.ray_unrolls_per_env  # unrolls in one object
        slots = self.per_object + self.num_envs  # while an object is packed, every env acts its next unroll
        spec = BufferSpec(slots, config.unroll_length, observation_shape, observation_dtype,
                          num_actions, self.model.core_state_shapes())
        self.buffers = create_buffers(spec, shared=False)
        self.keys = shipped_keys(self.buffers)
        # Atari's frame stacks, [C > 1, H, W]: about a quarter of the bytes on the wire (`pack_frames`).
        self.pack_frames = is_atari(config.env) and len(observation_shape) == 3 and observation_shape[0] > 1
        free: queue.Queue[int] = queue.Queue()
        for slot in range(slots):
            free.put(slot)
        self.full: queue.Queue[int] = queue.Queue()
        self.games: queue.Queue[tuple[int, float, int]] = queue.Queue()
        self.errors: queue.Queue[tuple[int, str]] = queue.Queue()
        self.channels = ActorChannels(free_queue=free, full_queue=self.full, episode_queue=self.games,
                                      error_queue=self.errors, stop_event=threading.Event(),
                                      policy_version=_Version())
        self.thread: threading.Thread | None = None  # started by the first `unrolls`, once weights are in
        self.node, self.node_id = _node_address(), _node_id()

    def unrolls(self, version: int, weights: list[Any]) -> dict[str, Any]:
        """`ray_unrolls_per_env` unrolls of every env (at least --ray_steps_per_request agent steps), acted with
        weights of `version` or older: between two calls the acting thread goes on acting, up to a whole object's
        unrolls and one more of each env, so where calls come slower than it acts (the learner is the limit) the
        object this call returns was acted with the weights of the call before (each unroll is stamped with
        its version, `stats/policy_lag`). `weights`: [ObjectRef of a state dict], inside a list so that Ray
        passes the reference and this call fetches the weights only when they are newer than its own."""
        if version > self.channels.policy_version.value:
            import ray

            state = ray.get(weights[0])
            self.model.load_state_dict({name: torch.from_numpy(np.array(value)) for name, value in state.items()})
            self.channels.policy_version.value = version
        if self.thread is None:
            self.thread = threading.Thread(target=run_actor, name="acting", daemon=True,
                                           args=(self.actor_index, self.config, self.buffers, self.model,
                                                 self.channels, self.seeds))
            self.thread.start()
        start = time.perf_counter()
        try:
            slots = [self._next_full_slot() for _ in range(self.per_object)]
        except _Stopped:  # `stop` came while this request waited: an answer, not an error Ray would print
            return {"stopped": True}
        acting_s = time.perf_counter() - start
        fields = {key: self.buffers[key][slots].numpy() for key in self.keys}  # indexing copies
        if self.pack_frames:
            fields.update(pack_frames(fields.pop("obs")))
        for slot in slots:
            self.channels.free_queue.put(slot)  # type: ignore[union-attr]
        games = []
        while not self.games.empty():
            _, episode_return, length = self.games.get_nowait()
            games.append((episode_return, length))
        return {"fields": fields, "games": games, "pid": os.getpid(), "node": self.node, "node_id": self.node_id,
                "waited_s": acting_s,
                "pack_s": time.perf_counter() - start - acting_s}

    def _next_full_slot(self) -> int:
        while True:
            try:
                return self.full.get(timeout=WAIT_S)
            except queue.Empty:
                if self.channels.stop_event.is_set():  # asked to stop: its acting thread ends too
                    raise _Stopped from None
                if self.thread is not None and not self.thread.is_alive():
                    detail = self.errors.get_nowait()[1] if not self.errors.empty() else "the acting thread ended"
                    raise RuntimeError(f"remote actor {self.actor_index} stopped acting:\n{detail}") from None

    def stop(self) -> None:
        """Stop acting and close the envs (bounded), so the process can be killed cleanly."""
        self.channels.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=STOP_TIMEOUT_S)

    def pid(self) -> int:
        return os.getpid()


def _node_id() -> str | None:
    """The id of the Ray node this process runs on (None outside Ray)."""
    try:
        import ray

        if not ray.is_initialized():  # get_runtime_context would start a Ray of its own
            return None
        return str(ray.get_runtime_context().get_node_id())
    except Exception:  # noqa: BLE001 - only to count a lost node's actors once
        return None


def _node_address() -> str:
    """The address of the Ray node this process runs on ("" outside Ray)."""
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # noqa: BLE001 - only for the log line
        return ""


# ----------------------------------------------------------------------------------------- learner side


@dataclasses.dataclass(eq=False)
class RemoteLife:
    """One life of one remote actor, as the learner's side sees it."""

    index: int  # remote actor index, 0..ray_actors-1
    life: int  # run-wide life number (seeding.ActorLives)
    handle: Any  # the Ray actor handle
    made: Any = None  # ObjectRef of its pid, answered once the actor is placed on a node and made
    started: float = dataclasses.field(default_factory=time.monotonic)
    placed: float | None = None  # monotonic time `made` was seen answered; None while it waits for a node
    last_result: float | None = None  # monotonic time of its last unrolls; None until it acts
    pid: int | None = None  # its process, once it reported it
    node_id: str | None = None  # the Ray node it runs on, once it reported it
    in_flight: int = 0  # requests submitted and not yet received
    dead: bool = False  # reported to the main thread, which replaces it
    warned: bool = False  # reported as not placed yet


@dataclasses.dataclass
class RayStats:
    """Counters of the receiver thread (written only there, read as a snapshot by the monitor)."""

    unrolls: int = 0  # unrolls copied into slots
    dropped: int = 0  # unrolls older than --ray_max_policy_lag versions
    bytes: int = 0  # numpy bytes received
    steps: int = 0  # agent steps received
    receive_s: float = 0.0  # receiver time in ray.get and copying into slots
    restarts: int = 0  # remote actor lives replaced


class HeadWatch:
    """Whether Ray's head (its GCS) still answers, asked every HEAD_PROBE_S in a thread of its own: without it no
    remote actor can be made, killed or found dead, and Ray ends the process before long (RAY_GCS_RECONNECT_TIMEOUT_S).
    Only asks that went unanswered count, so a process paused meanwhile (Ctrl-Z) does not read as a lost head."""

    def __init__(self, ray: Any) -> None:
        # Ray's client of the GCS, which takes a timeout (ray.nodes() would wait out Ray's own 60 s); None where
        # this Ray has none (then Ray's own rule stands).
        self.client: Any = None
        with contextlib.suppress(AttributeError):
            self.client = ray._private.worker.global_worker.gcs_client
        self.address = ""
        with contextlib.suppress(Exception):
            self.address = str(ray.get_runtime_context().gcs_address)
        self.unanswered = 0  # asks in a row that went unanswered
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="ray-head-watch", daemon=True)

    def start(self) -> None:
        if self.client is not None:
            self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()

    def _watch(self) -> None:
        assert self.client is not None  # started only with one
        wait_s = HEAD_PROBE_S
        while not self.stop_event.wait(wait_s):
            asked = time.monotonic()
            try:
                self.client.internal_kv_get(b"impala-head-watch", NAMESPACE.encode(), timeout=HEAD_PROBE_S)
            except Exception:  # noqa: BLE001 - Ray's RpcError: no answer within the timeout, or none to be had
                self.unanswered += 1
                wait_s = max(0.0, HEAD_PROBE_S - (time.monotonic() - asked))  # the next ask HEAD_PROBE_S after
            else:
                self.unanswered, wait_s = 0, HEAD_PROBE_S

    def lost(self) -> bool:
        return self.unanswered * HEAD_PROBE_S >= HEAD_LOST_S


class RayActorPool:
    """Local actors (a `LocalActorPool`, possibly of none) plus `config.ray_actors` remote actors on a Ray
    cluster, behind the `ActorPool` interface. Only the main thread calls it, except `publish` (a learner
    thread, under the update lock); the receiver thread is its own.
    """

    def __init__(self, config: Config, local: LocalActorPool, buffers: Buffers, lives: ActorLives, model: Net,
                 policy_version: int, run_name: str, connection: tuple[Any, bool | None]) -> None:
        """`model`: the learner's, whose weights (version `policy_version`) the remote actors start with;
        `connection`: what `connect` returned, made before the run's files were written."""
        self.config, self.local, self.buffers, self.lives = config, local, buffers, lives
        self.slots = local.slots
        self.writer = config.num_actors  # the ledger's index of the receiver's slots (actor_pool._ledger)
        self.net_args = (model.observation_shape, buffers["obs"].dtype, model.num_actions)
        self.run_name = run_name
        self.keys = shipped_keys(buffers)
        self.ray, self.started_ray = connection
        # One unroll request at a time; `stop` in a group of its own, so it runs while a request waits. No task events:
        # each worker would send a record of every request to the GCS every second, which keeps up to 100,000 of them
        # for Ray's state API (the GCS grew 3.7 MiB a minute with 2 remote CartPole actors; BENCHMARKS.md).
        self.remote_class = self.ray.remote(concurrency_groups={"control": 1}, enable_task_events=False)(RemoteActor)
        self.remotes: list[RemoteLife] = []
        self._last_watch = time.monotonic()  # `_watch_silence`'s last look
        self.warned_slow_object = False  # `slow_object_warning`, once a run
        self.death_reports: queue.Queue[tuple[RemoteLife, str]] = queue.Queue()  # receiver -> main thread
        self.stats = RayStats()
        self.games: collections.deque[tuple[float, int]] = collections.deque()
        self.weights: tuple[int, Any] | None = None  # (version, ObjectRef of the numpy state dict)
        self.version = policy_version
        self._put_weights(model, policy_version)
        self.deaths = RecentDeaths()
        self._lost_nodes: set[str] = set()  # Ray nodes whose loss was counted as one restart
        self.stop_event = threading.Event()
        self.receiver = threading.Thread(target=self._receive, name="ray-receiver", daemon=True)
        self.error: BaseException | None = None  # why the receiver thread died
        self.head = HeadWatch(self.ray)

    # The attributes training.py reaches through the pool (central inference serves the local actors only).
    @property
    def channels(self) -> ActorChannels:
        return self.local.channels

    @property
    def inference(self) -> Any:
        return self.local.inference

    @inference.setter
    def inference(self, server: Any) -> None:
        self.local.inference = server

    # ------------------------------------------------------------------------------------- start

    def start(self) -> None:
        self.local.start()
        for index in range(self.config.ray_actors):  # one by one: `stop` ends those started before a failure
            self.remotes.append(self._start_remote(index))
        self.receiver.start()
        self.head.start()

    def _start_remote(self, index: int) -> RemoteLife:
        """A new life of remote actor `index`: seeds no other life had, a name the run can be found by."""
        config = self.config
        actor_config = dataclasses.replace(config, envs_per_actor=config.ray_envs_per_actor, inference="actor")
        seeds = self.lives.next_life(config.num_actors + index, config.ray_envs_per_actor)
        resources = {config.ray_actor_resource: 1} if config.ray_actor_resource else None
        name = f"{self.run_name}.remote-{index}.life-{seeds.life}"
        try:
            handle = self.remote_class.options(name=name, namespace=NAMESPACE, num_cpus=1, resources=resources,
                                               max_restarts=0).remote(config.num_actors + index, actor_config,
                                                                      *self.net_args, seeds)
        except self.ray.exceptions.ActorAlreadyExistsError:  # made since `check_names_free`
            raise UserError(f"--ray {config.ray}: the cluster already has an actor named {name}: another run with "
                            f"this --xpid is using it; pass another --xpid") from None
        log.info("Remote actor %d starting (life %d, env seeds %d-%d)", index, seeds.life, seeds.env_seeds[0],
                 seeds.env_seeds[-1])
        # In the control group, so it answers once the actor is made, not after its first unrolls.
        return RemoteLife(index, seeds.life, handle, handle.pid.options(concurrency_group="control").remote())

    # ------------------------------------------------------------------------------------- learner side

    def publish(self, model: Net, version: int) -> None:
        """The local actors' weights at once; the remote actors' every --ray_publish_every versions."""
        self.local.publish(model, version)
        self.version = version
        if self.weights is None or version - self.weights[0] >= self.config.ray_publish_every:
            self._put_weights(model, version)

    def _put_weights(self, model: Net, version: int) -> None:
        state = {name: value.detach().cpu().numpy() for name, value in model.state_dict().items()}
        self.weights = (version, self.ray.put(state))

    def episodes(self) -> list[tuple[float, int]]:
        games = self.local.episodes()
        while self.games:
            games.append(self.games.popleft())
        return games

    def scalars(self) -> dict[str, float]:
        stats = self.stats
        scalars: dict[str, float] = {  # the local actors' own, then the remote ones'
            **self.local.scalars(), "ray/unrolls": stats.unrolls, "ray/dropped_unrolls": stats.dropped,
            "ray/restarts": stats.restarts,
            "ray/actors_acting": sum(r.last_result is not None and not r.dead for r in self.remotes)}
        if stats.steps:
            scalars["ray/bytes_per_step"] = stats.bytes / stats.steps
            scalars["ray/receive_ms_per_unroll"] = 1000 * stats.receive_s / max(1, stats.unrolls + stats.dropped)
        return scalars

    # ------------------------------------------------------------------------------------- receiver thread

    def _receive(self) -> None:
        try:
            in_flight: dict[Any, RemoteLife] = {}
            while not self.stop_event.is_set():
                self._top_up(in_flight)
                if not in_flight:
                    time.sleep(WAIT_S)
                    continue
                ready, _ = self.ray.wait(list(in_flight), num_returns=1, timeout=WAIT_S)
                for ref in ready:
                    remote = in_flight.pop(ref)
                    if not self._take(ref, remote):
                        in_flight[ref] = remote  # done, but not here yet: waited for again
                self._watch_silence(in_flight)
        except BaseException as exc:  # the monitor raises it (`check`)
            log.exception("The Ray receiver thread failed")
            self.error = exc

    def _top_up(self, in_flight: dict[Any, RemoteLife]) -> None:
        """Keep REQUESTS_IN_FLIGHT requests at every live remote actor, each with the newest weights."""
        assert self.weights is not None
        version, weights = self.weights
        for remote in list(self.remotes):
            while not remote.dead and remote.in_flight < REQUESTS_IN_FLIGHT:
                in_flight[remote.handle.unrolls.remote(version, [weights])] = remote
                remote.in_flight += 1

    def _take(self, ref: Any, remote: RemoteLife) -> bool:
        """Copy the unrolls of one finished request into slots, or report its actor dead; False where the result
        could not be read within WAIT_S (restored from disk where the object store spilled it, fetched again where it
        was evicted): not a death, and still the actor's request in flight."""
        start = time.perf_counter()
        try:
            result = self.ray.get(ref, timeout=WAIT_S)
        except self.ray.exceptions.GetTimeoutError:
            return False
        except self.ray.exceptions.RayError as exc:  # an actor or node gone (RayActorError), it raised (RayTaskError)
            remote.in_flight -= 1
            self._report_dead(remote, _describe(exc))
            return True
        remote.in_flight -= 1
        if remote.dead or result.get("stopped"):
            return True  # a result that arrived after its actor was reported (it is being replaced), or stopped
        if remote.last_result is None:
            remote.pid, remote.node_id = result["pid"], result.get("node_id")
            log.info("Remote actor %d acting (pid %d on %s, life %d)", remote.index, remote.pid, result["node"],
                     remote.life)
        elif (warning := slow_object_warning(self.config, remote.index, result.get("waited_s", 0.0))) \
                and not self.warned_slow_object:  # not its first object: that one's wait includes making its envs
            self.warned_slow_object = True
            log.warning(warning)
        self.games.extend(result["games"])
        waited_s = self._write(result["fields"])
        remote.last_result = time.monotonic()  # after the write: a wait for the learners there is not its silence
        self.stats.receive_s += time.perf_counter() - start - waited_s  # the learners' holding every slot is theirs
        self._last_watch += waited_s  # not a pause of this process: `_watch_silence` renews no actor for it
        return True

    def _write(self, fields: dict[str, np.ndarray]) -> float:
        """Each unroll into a free slot of the receiver's and onto the full queue; stale ones are dropped. Returns
        the seconds it waited for free slots."""
        waited_s = 0.0
        count = len(fields["policy_version"])
        self.stats.bytes += sum(array.nbytes for array in fields.values())
        self.stats.steps += count * self.config.unroll_length
        for i in range(count):
            if self.config.ray_max_policy_lag and \
                    self.version - int(fields["policy_version"][i]) > self.config.ray_max_policy_lag:
                self.stats.dropped += 1
                continue
            wait_start = time.perf_counter()
            slot = self._free_slot()
            waited_s += time.perf_counter() - wait_start
            if slot is None:
                return waited_s
            write_unroll(self.buffers, self.keys, fields, i, slot)
            self.slots.full_queue.put(slot)
            self.stats.unrolls += 1
        return waited_s

    def _free_slot(self) -> int | None:
        """A slot of the receiver's, waiting while the learners hold them all; None when stopping. Meanwhile the
        actors' results wait unread: `_watch_silence` does not take that for their silence."""
        while not self.stop_event.is_set():
            try:
                slot: int = self.slots.free_queue(self.writer).get(timeout=WAIT_S)
            except queue.Empty:
                continue
            return slot
        return None

    def _new_grace_period(self, now: float, remotes: list[RemoteLife] | None = None) -> None:
        """Start the silence of every placed actor (of `remotes`) afresh (results waiting unread are not its
        silence)."""
        for remote in self.remotes if remotes is None else remotes:
            if remote.last_result is not None:
                remote.last_result = now
            elif remote.placed is not None:
                remote.placed = now

    def _watch_silence(self, in_flight: dict[Any, RemoteLife]) -> None:
        """Report an actor that stopped sending, or that was placed and never sent (--actor_timeout_s: a hung env),
        and warn of one not placed yet (no resources: it may yet be, so it is not a death). An actor with a result
        done but not yet read (`in_flight`: the receiver was behind, waiting for the learners to free a slot) is
        not silent, however long ago its last one was read."""
        now = time.monotonic()
        timeout_s = self.config.actor_timeout_s
        watch_gap_s, self._last_watch = now - self._last_watch, now
        if timeout_s and watch_gap_s > timeout_s / 2:
            # This process was not running (Ctrl-Z, a paused container): the results waiting unread are not the
            # actors' silence. Every placed actor gets a new grace period, as local actors do (`kill_hung`).
            self._new_grace_period(now)
            return
        for remote in self.remotes:
            if remote.dead:
                continue
            if remote.last_result is not None:
                silent_s, since = now - remote.last_result, ""
            elif remote.placed is not None:
                silent_s, since = now - remote.placed, " since it was made"
            elif remote.made is not None and self.ray.wait([remote.made], timeout=0)[0]:
                remote.placed = now  # made, or failed to be: its unrolls request then reports the failure
                continue
            else:
                if not remote.warned and now - remote.started > PLACEMENT_WARNING_S:
                    remote.warned = True
                    log.warning("Remote actor %d has not acted for %.0f s since it was started: is there a node "
                                "with a free CPU%s for it?", remote.index, now - remote.started,
                                f" and {self.config.ray_actor_resource}" if self.config.ray_actor_resource else "")
                continue
            if timeout_s and silent_s > timeout_s:
                if self._has_unread_result(remote, in_flight):
                    self._new_grace_period(now, [remote])
                    continue
                self._report_dead(remote, f"no unroll for {silent_s:.0f} s{since} (--actor_timeout_s {timeout_s:g})")

    def _has_unread_result(self, remote: RemoteLife, in_flight: dict[Any, RemoteLife]) -> bool:
        refs = [ref for ref, owner in in_flight.items() if owner is remote]
        # fetch_local=False: a result done on another node is done, though not yet fetched to this one
        return bool(refs) and bool(self.ray.wait(refs, num_returns=1, timeout=0, fetch_local=False)[0])

    def _report_dead(self, remote: RemoteLife, detail: str) -> None:
        if not remote.dead:
            remote.dead = True
            self.death_reports.put((remote, detail))

    # ------------------------------------------------------------------------------------- watch

    def check(self) -> None:
        """The local actors' check, then: raise what killed the receiver; replace every remote actor that died,
        within the same limit of restarts (--max_actor_restarts within RESTART_WINDOW_S, or in a row with no update
        learned in between)."""
        self.local.check()
        if self.error is not None:
            raise TrainingError(f"the Ray receiver thread failed: {self.error!r}") from self.error
        if self.head.lost():
            raise TrainingError(f"Ray's head (its GCS at {self.head.address or '?'}) has not answered for "
                                f"{HEAD_LOST_S:.0f} s: it was stopped, or its machine lost; no remote actor can be "
                                "replaced without it. Run the same --xpid again once the cluster is back, to resume")
        while True:
            try:
                remote, detail = self.death_reports.get_nowait()
            except queue.Empty:
                return
            self._replace(remote, detail)

    def _first_loss_of_node(self, remote: RemoteLife) -> bool:
        """Whether `remote` died as any other actor does, or is the first seen lost with its node, which Ray now
        counts dead: False for the other actors of a node counted already."""
        if remote.node_id is None:  # it never acted: no node known
            return True
        if remote.node_id in self._lost_nodes:
            return False
        with contextlib.suppress(self.ray.exceptions.RayError):
            if not {node["NodeID"]: node["Alive"] for node in self.ray.nodes()}.get(remote.node_id, True):
                self._lost_nodes.add(remote.node_id)
        return True

    def _replace(self, remote: RemoteLife, detail: str) -> None:
        pid = f"pid {remote.pid}" if remote.pid is not None else "never acted"
        log.error("Remote actor %d (%s, life %d) died: %s", remote.index, pid, remote.life, detail)
        # A lost node costs every actor on it at once (16 on a machine of 16 cores): one restart counted for them all.
        counted = self._first_loss_of_node(remote)
        deaths = self.deaths.add(self.version) if counted else self.deaths.recent()
        limit = self.config.max_actor_restarts
        if deaths > limit:
            raise TrainingError(f"actors died {deaths} times {self.deaths.span()} "
                                f"(--max_actor_restarts {limit}); last: remote actor {remote.index}: {detail}")
        self.ray.kill(remote.handle, no_restart=True)  # it may still live (a hang, an exception in it)
        self.remotes[remote.index] = self._start_remote(remote.index)
        self.stats.restarts += 1
        log.warning("Replaced remote actor %d (%d restarts %s, at most %d)", remote.index, deaths,
                    self.deaths.span(), limit)

    # ------------------------------------------------------------------------------------- stop

    def request_stop(self) -> None:
        self.local.request_stop()
        self.stop_event.set()

    def stop(self, drain: Callable[[], None]) -> None:
        """Local actors first (as `LocalActorPool.stop`), then the receiver, then every remote actor: asked to
        stop, given STOP_TIMEOUT_S, then killed, so none of the run's is left in the cluster."""
        self.stop_event.set()
        self.head.stop()
        self.local.stop(drain)
        if self.receiver.ident is not None:  # started (a failed start may stop a pool before it)
            self.receiver.join(timeout=STOP_TIMEOUT_S)
        stopping = [remote.handle.stop.options(concurrency_group="control").remote() for remote in self.remotes]
        if stopping:
            self.ray.wait(stopping, num_returns=len(stopping), timeout=STOP_TIMEOUT_S)
        for remote in self.remotes:
            self.ray.kill(remote.handle, no_restart=True)
        log.info("Stopped %d remote actors", len(self.remotes))

    def close(self) -> None:
        """The local pool's channels; then disconnect from Ray, which stops it only with --ray local."""
        self.local.close()
        self.weights = None
        disconnect((self.ray, self.started_ray))


_COLOURS = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the names in its messages for a terminal
# Ray's account of a worker process that ended: its kind and the first sentence of the detail.
_WORKER_EXIT = re.compile(r"Worker exit type: (\S+) Worker exit detail: ([^.]*\.?)")


def _describe(exc: BaseException) -> str:
    """One line for a lost actor, with its cause where Ray gives one (the exception its constructor raised, how
    its worker process ended), or the remote traceback for an exception raised in it."""
    text = _COLOURS.sub("", str(exc)).strip()
    if type(exc).__name__ in ("ActorDiedError", "RayActorError", "ActorUnavailableError"):
        lines = text.splitlines()
        if not lines:
            return f"{type(exc).__name__}: the actor process is gone"
        line = lines[0]
        exit_detail = _WORKER_EXIT.search(text)
        if "creation task" in line and len(lines) > 1:  # the traceback of the constructor's exception follows
            line += f"; {lines[-1].strip()}"
        elif exit_detail:
            line += f" ({exit_detail[1]}: {exit_detail[2]})"
        return f"{type(exc).__name__}: {line}"
    return text or "".join(traceback.format_exception_only(type(exc), exc)).strip()


# ----------------------------------------------------------------------------------------- connecting


def connect(config: Config, unroll_bytes: int, stop: StopRequests | None = None) -> tuple[Any, bool | None]:
    """Connect this process to Ray as --ray says; returns (the ray module, whether to shut Ray down at the
    end: True when this run started it, False when it only connected, None when it was already connected
    by the caller, who keeps it). Bad addresses are UserErrors, and so is a cluster that has not answered within
    CONNECT_TIMEOUT_S; a stop asked for (`stop`) while it is waited for raises Stopped. `disconnect` undoes it."""
    ray = require_ray()
    if ray.is_initialized():
        return ray, None
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", str(RAY_GCS_RECONNECT_TIMEOUT_S))
    # Workers import impala from where this copy lives (one image, one path on every node).
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, (str(REPO_ROOT),
                                                                            os.environ.get("PYTHONPATH"))))}}
    options: dict[str, Any] = {"namespace": NAMESPACE, "runtime_env": runtime_env, "log_to_driver": False}
    if config.ray and is_head_address(config.ray):
        check_reachable(config.ray)
    if config.ray == "local":
        store_bytes = local_object_store_bytes(config, unroll_bytes)
        check_local_store_fits(config, store_bytes, unroll_bytes)
        options.update(address="local", include_dashboard=False, num_cpus=max(os.cpu_count() or 1, config.ray_actors),
                       object_store_memory=store_bytes)
    else:
        options["address"] = config.ray
    if config.ray != "local":
        try:
            _init_within(ray, options, config.ray or "auto", stop)
        except (ConnectionError, ValueError, RuntimeError, ray.exceptions.RayError) as exc:  # RayError: no auth token
            raise _cannot_connect(config, exc) from None
        return ray, False
    previous = signal.getsignal(signal.SIGTERM)
    # The stop signals blocked while Ray starts: the processes of --ray local (its GCS, its raylet and, through
    # that, its workers) keep them blocked, as Ray itself blocks Ctrl-C there. Else SIGTERM or SIGHUP to the process
    # group (`timeout`, a job scheduler, a closed terminal) ends Ray under the run, and Ray then ends this process
    # before its final checkpoint. The run stops them itself (`disconnect`). A signal that comes meanwhile waits for
    # the run's handler, put back first.
    try:
        with stop_signals_blocked():
            try:
                ray.init(**options)
            finally:
                _put_back_sigterm(previous)  # ray.init installs its own; the run's stops in order
    except SystemExit as exc:  # ray.init's own SIGTERM handler, run for a signal another thread took: code 15
        _put_back_sigterm(previous)  # where it came before the line above
        if exc.code != signal.SIGTERM:
            raise
        # The SIGTERM is the run's: undo the connection, then hand the signal to the run's handler.
        with contextlib.suppress(Exception):
            ray.shutdown()
        signal.raise_signal(signal.SIGTERM)
        raise Stopped("terminated", signal.SIGTERM) from None
    except (ConnectionError, ValueError, RuntimeError, ray.exceptions.RayError) as exc:  # RayError: no auth token
        raise _cannot_connect(config, exc) from None
    return ray, config.ray == "local"


def _cannot_connect(config: Config, exc: BaseException) -> UserError:
    if config.ray == "local":
        return UserError(f"--ray local: could not start Ray on this machine: {first_line(exc)}")
    return UserError(f"--ray {config.ray}: could not connect to Ray: {first_line(exc)} (start a cluster with "
                     "`ray start --head`, or use --ray local)")


def _init_within(ray: Any, options: dict[str, Any], address: str, stop: StopRequests | None) -> None:
    """`ray.init` to a running cluster, in a thread of its own, waited for CONNECT_TIMEOUT_S at most and while no
    stop comes: at an address that takes connections but is not a cluster's (another port of the head, a stale
    RAY_ADDRESS) it retries for good, and Ctrl-C does not reach it. Left behind, the thread ends with the process."""
    outcome: list[BaseException | None] = []

    def init() -> None:
        try:
            ray.init(**options)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 (raised again in the caller's thread)
            outcome.append(exc)

    # Ray says so when it is not in the main thread: this run's own handler stops it in order (`disconnect`).
    no_sigterm_warning = _DropMessage("SIGTERM handler is not set")
    logging.getLogger("ray._private.worker").addFilter(no_sigterm_warning)
    thread = threading.Thread(target=init, name="ray-connect", daemon=True)
    thread.start()
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    try:
        while thread.is_alive() and time.monotonic() < deadline:
            if stop is not None:
                stop.check()
            thread.join(timeout=0.2)
    finally:
        logging.getLogger("ray._private.worker").removeFilter(no_sigterm_warning)
    if thread.is_alive():
        raise UserError(f"--ray {address}: no Ray cluster answered within {CONNECT_TIMEOUT_S:g} s (is it the address "
                        "of a head node's GCS, port 6379 by default, as `ray start --head` prints it?)")
    if outcome and outcome[0] is not None:
        raise outcome[0]


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _put_back_sigterm(handler: Any) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def warn_of_missing_resource(config: Config, ray: Any) -> None:
    """A warning at once where no node offers --ray_actor_resource now (misspelled? its nodes not yet joined?): the
    remote actors wait for one, which the run would otherwise say only after PLACEMENT_WARNING_S."""
    resource = config.ray_actor_resource
    if not resource:
        return
    try:
        offered = ray.cluster_resources()
    except Exception:  # noqa: BLE001 - a cluster that cannot say: the later warning stands
        return
    if offered.get(resource, 0) < 1:
        custom = sorted(name for name in offered if name not in ("CPU", "GPU", "memory", "object_store_memory")
                        and not name.startswith(("node:", "accelerator_type:")))
        log.warning("--ray_actor_resource %s: no node of the cluster offers it now (its custom resources: %s); the "
                    "remote actors wait until one does", resource, ", ".join(custom) or "none")


def check_names_free(config: Config, ray: Any, xpid: str) -> None:
    """UserError where the cluster has a live remote actor of run `xpid`, a plain run's or any torchrun rank's
    (another training of this --xpid uses the cluster), for NAMES_GRACE_S: a session of this run that has just
    ended may leave its actors for the seconds Ray takes to remove them. Checked before the run's files are written,
    by every rank before any starts its actors; `_start_remote` still refuses a name taken later."""
    run_actor = re.compile(rf"{re.escape(xpid)}(\.rank-\d+)?\.remote-")
    deadline = time.monotonic() + NAMES_GRACE_S
    while True:
        try:
            named = ray.util.list_named_actors(all_namespaces=True)
        except ray.exceptions.RayError as exc:
            raise UserError(f"--ray {config.ray}: could not list the cluster's actors: {first_line(exc)}") from None
        taken = sorted(actor["name"] for actor in named
                       if actor["namespace"] == NAMESPACE and run_actor.match(actor["name"]))
        if not taken:
            return
        if time.monotonic() > deadline:
            raise UserError(f"--ray {config.ray}: the cluster already has an actor named {taken[0]}: another run "
                            "with this --xpid is using it (or one that ended moments ago, whose actors Ray has not "
                            "yet removed); pass another --xpid, or try again in a minute")
        time.sleep(1.0)


def check_reachable(address: str) -> None:
    """UserError unless something accepts a TCP connection at HOST:PORT within REACH_TIMEOUT_S: `ray.init` waits
    for a head node that is not there for good, retrying and logging every 40 s."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as exc:
        raise UserError(f"--ray {address}: could not connect to Ray: nothing answers there "
                        f"({exc.strerror or exc}); start a cluster with `ray start --head` and pass its address, "
                        "or use --ray local") from None


def disconnect(connection: tuple[Any, bool | None]) -> None:
    """Undo `connect`: disconnect from Ray, which stops it only with --ray local; nothing where the caller had
    connected before."""
    ray, started = connection
    if started is not None:
        ray.shutdown()


# Of the memory the run may use, the most --ray local's object store may take: the remote actors, the learner and its
# slots need the rest, and Ray refuses a store that leaves its tasks less than 5%.
MAX_LOCAL_STORE_SHARE = 0.5


def check_local_store_fits(config: Config, store_bytes: int, unroll_bytes: int) -> None:
    """UserError where --ray local's object store (`local_object_store_bytes`) would take more than
    MAX_LOCAL_STORE_SHARE of the memory the run may use (`usable_memory`): a --ray_steps_per_request of hundreds of
    thousands of steps."""
    memory = usable_memory()
    if store_bytes > MAX_LOCAL_STORE_SHARE * memory.bytes:
        raise UserError(f"--ray local: each remote actor's object holds {config.ray_unrolls_per_object:,} unrolls of "
                        f"{unroll_bytes / 2**20:.2f} MiB (--ray_steps_per_request {config.ray_steps_per_request:,}), "
                        f"and the objects in flight of {config.ray_actors} remote actor(s) need an object store of "
                        f"{store_bytes / 2**30:.1f} GiB where {memory}: lower "
                        "--ray_steps_per_request or --ray_actors")


def slow_object_warning(config: Config, index: int, acting_s: float) -> str | None:
    """A warning where remote actor `index` took `acting_s` (what its `unrolls` call waited for its acting thread)
    for one object, more than half --actor_timeout_s: a few more envs' steps, or a slower node, and its silence
    would be taken for a hang (`_watch_silence`), every life of it."""
    timeout_s = config.actor_timeout_s
    if not timeout_s or acting_s <= timeout_s / 2:
        return None
    steps = config.ray_unrolls_per_object * config.unroll_length
    return (f"Remote actor {index} took {acting_s:.0f} s to act one object of {steps:,} agent steps, more than half "
            f"--actor_timeout_s {timeout_s:g}: an actor silent for longer is taken for hung and replaced; lower "
            f"--ray_steps_per_request ({config.ray_steps_per_request:,}) or raise --actor_timeout_s")


def local_object_store_bytes(config: Config, unroll_bytes: int) -> int:
    """--ray local: room for every request in flight four times over (at least 256 MiB), not Ray's 30% of RAM."""
    in_flight_bytes = REQUESTS_IN_FLIGHT * config.ray_actors * config.ray_unrolls_per_object * unroll_bytes
    return max(256 * 2**20, 4 * in_flight_bytes)
