"""Central inference (--inference central): one thread in the main process (or one per share of the actors,
`--inference_threads`, `InferenceServers`) batches the observations of the waiting actors on the learner's
device, SEED RL / PolyBeast style.

Actors only step envs. Each writes its observations into its slots as usual, publishes where they are
(slots and row) in a shared `positions` tensor and sends one byte on its pipe. The server reads the
observations straight out of shared memory, runs one forward for all the actors it serves, writes
actions, logits and baselines back into the slots and answers each actor with one byte.

How long to wait for a fuller batch is `--inference_wait_ms`: 0 serves whoever is ready; a longer
wait trades actor idle time for bigger, cheaper batches, and ends once no actor can ask any more (each has a request
in a server's batch, or waits for free slots). `training.py` runs `serve` in a thread, or with
--inference_threads K each of K servers (`InferenceServers`) in a thread of its own, every one answering its share
of the actors' env splits.

On a GPU with --cuda_graph (the default) the forward and the sampling are replayed as CUDA graphs, one per batch
size served (the clients' count rounded up to a power of two) and weight copy, captured when first needed. Eagerly
the host dispatches some 30 operations a batch from Python (26 in the bfloat16 forward and sampling) while every
actor waits: 1.46 against 0.95 ms per batch of 28 env splits on an H200 machine (BENCHMARKS.md).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import selectors
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from impala import cudagraphs
from impala.buffers import Buffers
from impala.channels import SLOT_WAIT_ROW, signal, take_signal
from impala.config import first_line
from impala.model import Net, actions_from_noise

log = logging.getLogger(__name__)

# How often a server waiting for more actors looks whether they can still ask (`InferenceServer._none_can_ask`)
ASKING_POLL_S = 0.001  # epoll waits whole milliseconds (selectors rounds a shorter timeout up)


class InferenceServer:
    """Serves actions to actors; `serve` is the body of the inference thread.

    It acts with a snapshot of the learner's weights, not with the weights the learner is changing: a forward
    never mixes two versions. `load_weights` (the learner's publish) fills a second copy, which the server
    takes at its next batch. On a GPU it runs on a CUDA stream of its own, of high priority, so its small forwards
    do not queue behind the learner's kernels.
    """

    def __init__(self, model: Net, buffers: Buffers, positions: torch.Tensor, device: torch.device, amp: bool,
                 wait_s: float, seed: int, graphed: bool = False, max_clients: int | None = None,
                 splits: int = 1, asking: np.ndarray | None = None) -> None:
        self.model = copy.deepcopy(model).requires_grad_(False)  # what the forwards use
        self._next_model = copy.deepcopy(self.model)  # where the next published weights go
        if amp:  # the torsos' weights held in bfloat16: cast once as they are published (`load_weights` copies
            # into them), not by autocast at every forward, to the same bits (model.CastTorso does this for actors)
            for snapshot in (self.model, self._next_model):
                snapshot.torso.to(torch.bfloat16)
        self._next_ready: torch.cuda.Event | None = None  # recorded after they were copied, on CUDA
        self._has_next = False
        # A high-priority stream: the GPU's scheduler starts its small forwards' blocks ahead of the learner's queued
        # ones, so that an actor waiting for actions does not wait out a whole update replaying on the other stream.
        self._stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self.buffers = buffers
        self.positions = positions  # [clients, envs per client + 1]: slots..., row
        # the most clients this server answers at once: all of `positions`, or its share (`InferenceServers`)
        self.max_clients = positions.shape[0] if max_clients is None else max_clients
        # client (actor index x env_splits + split) -> the main process's end of its pipe
        self.connections: dict[int, Connection] = {}
        self.device = device
        self.amp = amp
        self.wait_s = wait_s
        # Clients per actor (--env_splits; client c is actor c // splits's split c % splits). An actor asks for one of
        # its splits at a time, so a batch has all it can get once each actor served has a request in it.
        self.splits = splits
        # Who can still ask, for a wait for more actors: not an actor with a request in a server's batch (it asks
        # one server at a time, and cannot ask again before that one answers), nor one waiting for free slots (one
        # of its splits' rows is SLOT_WAIT_ROW; it asks again only once the learner frees some). `InferenceServers`
        # shares `asking` among its servers: two servers waiting for each other's actors would both wait out
        # --inference_wait_ms at every batch.
        self._asking = np.zeros(positions.shape[0] // splits, dtype=bool) if asking is None else asking
        self._rows = positions.numpy()[:, -1].reshape(-1, splits)  # [actors, splits], a view of the shared memory
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # (id of the weight copy acted with, rows) -> its captured forward; {} and False off a GPU, or after a
        # capture failed (then every batch is eager, as without --cuda_graph)
        self._graphs: dict[tuple[int, int], _GraphedForward] = {}
        self._graphed = graphed and device.type == "cuda"
        self._graph_pool = torch.cuda.graph_pool_handle() if self._graphed else None
        # Observations are gathered by one index_select of (slot, row) pairs, into host tensors pinned for
        # CUDA so their copy to the device is asynchronous; the next gather waits for this forward's results.
        obs, done = buffers["obs"], buffers["done"]
        self._rows_per_slot = obs.shape[1]
        self._flat = {"obs": obs.view(-1, *obs.shape[2:]), "done": done.view(-1)}
        # The answers' fields viewed the same way, [slots x rows, ...]: written by one index_copy_ each
        self._flat_out = {key: buffers[key].view(-1, *buffers[key].shape[2:])
                          for key in ("policy_logits", "baseline", "action")}
        most = self.max_clients * (positions.shape[1] - 1)
        self._staging = {key: torch.empty((most, *flat.shape[1:]), dtype=flat.dtype) for key, flat in self._flat.items()}
        if device.type == "cuda":
            self._staging = {key: tensor.pin_memory() for key, tensor in self._staging.items()}
        self._lock = threading.Lock()
        self._replaced: list[Connection] = []  # pipes of dead actors, for the serving thread to close
        # The serving thread's copy of `connections`, taken again only after `connect` changed them (a dead
        # client's pipe is dropped from both at once, by that thread)
        self._snapshot: dict[int, Connection] = {}
        self._connected = 0  # calls of `connect`
        self._snapshot_at = 0  # the `_connected` of the snapshot
        # What the serving thread waits on: its pipes registered once with epoll, not once per batch as
        # `multiprocessing.connection.wait` does (53 against 3 us a call for 28 pipes, BENCHMARKS.md). Only that
        # thread touches it: `_watch` brings it up to date with each new snapshot of `connections`.
        self._selector = selectors.DefaultSelector()
        self._watched: dict[int, Connection] = {}  # client -> the pipe registered for it
        self.batches = 0  # forwards run
        self.served = 0  # client requests answered
        self.busy_s = 0.0  # spent serving: from a batch's first request read to its last answer sent
        self.slots_s = 0.0  # of it, gathering observations from the slots and writing the answers into them
        self.forward_s = 0.0  # of it, the forward and sampling: inputs to the device, results back on the host
        self.serving_since: float | None = None  # when the batch being served began (--learner_timeout_s)
        self._taken = (time.monotonic(), 0, 0, 0.0, 0.0, 0.0)  # (time, batches, served, busy_s, slots_s, forward_s)
        if self._stream is not None:  # the snapshots' copies and casts above ran on this thread's stream
            self._stream.wait_stream(torch.cuda.current_stream(device))

    def connect(self, client: int, connection: Connection) -> None:
        """Serve `client` (one env split of one actor) on `connection`. A restarted actor gets new pipes: a
        request its predecessor left unanswered goes away with the old one.

        The old pipe is closed by the serving thread at its next snapshot, not here: `serve_once` may be
        waiting on it right now in its selector, and a closed Connection cannot be unregistered from it (OSError).
        """
        with self._lock:
            old = self.connections.get(client)
            self.connections[client] = connection
            self._connected += 1
            if old is not None:
                self._replaced.append(old)

    def load_weights(self, model: Net) -> None:
        """Make `model`'s weights the ones the next batch acts with (a learner thread, after an update)."""
        with self._lock, torch.no_grad():
            for target, source in zip(self._next_model.parameters(), model.parameters(), strict=True):
                target.copy_(source)
            if self._stream is not None:  # the server's stream waits for these copies before it reads them
                self._next_ready = torch.cuda.Event()
                # On the copies' stream, named: a learner thread's current device is GPU 0 whatever its rank's is.
                self._next_ready.record(torch.cuda.current_stream(self.device))
            self._has_next = True

    def _take_new_weights(self) -> None:
        """At the start of a batch: the newest published weights, if any came. The copy being replaced was last
        read by the previous batch, which has finished (its results were copied to the host)."""
        with self._lock:
            if not self._has_next:
                return
            self.model, self._next_model = self._next_model, self.model
            if self._next_ready is not None and self._stream is not None:
                self._stream.wait_event(self._next_ready)
            self._has_next = False

    def serve(self, stop: threading.Event) -> None:
        """Answer requests until `stop` is set."""
        try:
            while not stop.is_set():
                self.serve_once(timeout_s=0.1, stop=stop)
        finally:
            self._selector.close()

    def serve_once(self, timeout_s: float, stop: threading.Event | None = None) -> int:
        """Wait up to `timeout_s` for a request, gather more for up to `wait_s` (less once no actor it serves can ask
        any more, `_none_can_ask`, or once `stop` is set), answer them all.

        Returns the number of clients (actor env splits) served.
        """
        with self._lock:
            if self._snapshot_at != self._connected:
                self._snapshot, self._snapshot_at = dict(self.connections), self._connected
                self._watch(self._snapshot)
            replaced, self._replaced = self._replaced, []
        connections = self._snapshot
        for connection in replaced:  # no snapshot holds them any more
            connection.close()
        if not connections:
            time.sleep(timeout_s)
            return 0
        pending: list[int] = []
        ready = self._ready(timeout_s)
        start = time.monotonic()
        self._receive(ready, pending, connections)
        if not pending:
            return 0
        deadline = start + self.wait_s
        if self.wait_s > 0:
            actors = self._actors_of(connections)
            while not self._none_can_ask(actors):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (stop is not None and stop.is_set()):
                    break
                # The pending clients' pipes were drained and stay quiet until answered, unless their actor died.
                # Polled: another server's requests, and an actor's wait for slots, come by no pipe of this one's.
                served = len(connections)
                self._receive(self._ready(min(remaining, ASKING_POLL_S)), pending, connections)
                if len(connections) < served:  # an actor died (its pipes dropped): not waited for any more; its
                    actors = self._actors_of(connections)  # replacement asks on new pipes, in a later batch
        if not pending:  # the one client that asked died meanwhile
            return 0
        # The hung-thread watch's clock: the batch's work, not the wait for more actors (--inference_wait_ms may
        # be longer than --learner_timeout_s, and an actor still starting may not ask for all of it).
        self.serving_since = time.monotonic()
        try:
            slots_s, forward_s = self._act(pending)
            for client in pending:
                self._asking[client // self.splits] = False  # before its answer: then it may ask any server again
                try:
                    signal(connections[client])
                except OSError:
                    pass  # the actor died; the monitor restarts it with a new pipe
        finally:
            self.serving_since = None
        with self._lock:  # one consistent set for `take_stats`
            self.batches += 1
            self.served += len(pending)
            self.busy_s += time.monotonic() - start
            self.slots_s += slots_s
            self.forward_s += forward_s
        return len(pending)

    def take_stats(self) -> dict[str, float]:
        """Since the last call (or the start): actors (env splits) served per forward, ms per batch (from its first
        request read to its last answer sent, the wait for a fuller batch included) and two parts of it (the slots'
        gather and writes; the forward, from the inputs' copy to the device to the results on the host), and the
        share of the time spent serving. Near 1, the server is what the actors wait for; well below, its batches'
        latency is (the GPU's queue, a small batch's fixed cost). What the parts leave of a batch is its pipes and
        its Python, and the wait for a fuller batch. Empty when no batch was served."""
        return _stats([self.take_totals()])

    def take_totals(self) -> tuple[float, int, int, float, float, float]:
        """Since the last call: (seconds, batches, clients served, busy_s, slots_s, forward_s)."""
        now = time.monotonic()
        with self._lock:
            then, *before = self._taken
            after = (self.batches, self.served, self.busy_s, self.slots_s, self.forward_s)
            self._taken = (now, *after)
        batches, served, busy_s, slots_s, forward_s = (a - b for a, b in zip(after, before, strict=True))
        return now - then, int(batches), int(served), busy_s, slots_s, forward_s

    def _actors_of(self, connections: dict[int, Connection]) -> np.ndarray:
        return np.array(sorted({client // self.splits for client in connections}), dtype=np.int64)

    def _none_can_ask(self, actors: np.ndarray) -> bool:
        """Whether every actor of `actors` has a request in a server's batch or waits for free slots."""
        return bool((self._asking[actors] | (self._rows[actors] == SLOT_WAIT_ROW).any(axis=1)).all())

    def _watch(self, connections: dict[int, Connection]) -> None:
        """Wait on exactly the pipes of `connections` from now on: those replaced or gone out, the new in."""
        for client, connection in list(self._watched.items()):
            if connections.get(client) is not connection:
                self._selector.unregister(connection)
                del self._watched[client]
        for client, connection in connections.items():
            if client not in self._watched:
                self._selector.register(connection, selectors.EVENT_READ, client)
                self._watched[client] = connection

    def _ready(self, timeout_s: float) -> list[tuple[int, Connection]]:
        """The clients whose pipes can be read (a request, or the end of a dead actor's pipe), waiting up to
        `timeout_s` for one."""
        return [(key.data, self._watched[key.data]) for key, _ in self._selector.select(timeout_s)]

    def _receive(self, ready: list[tuple[int, Connection]], pending: list[int],
                 connections: dict[int, Connection]) -> None:
        for client, connection in ready:
            try:
                asked = take_signal(connection)
            except OSError:
                asked = False
            if not asked:
                self._drop(client, connection, connections)  # the actor died
                if client in pending:  # it asked, then died before the batch was served: nobody to answer
                    pending.remove(client)
                    self._asking[client // self.splits] = False
                continue
            pending.append(client)
            self._asking[client // self.splits] = True

    def _drop(self, client: int, connection: Connection, connections: dict[int, Connection]) -> None:
        """Stop waiting on a dead actor's pipe, in this batch's snapshot (`connections`) and in the server's.

        A pipe whose other end is closed is always ready to read: left in, the selector returns it at once, every
        time, and this thread spins a core until the actor's replacement connects (or forever, if none does).
        """
        del connections[client]
        if self._watched.get(client) is connection:
            self._selector.unregister(connection)
            del self._watched[client]
        with self._lock:
            if self.connections.get(client) is connection:  # not already replaced by `connect`
                del self.connections[client]
        connection.close()

    def _act(self, clients: list[int]) -> tuple[float, float]:
        """Act for `clients`; returns the seconds spent on their slots (gather and writes) and on the forward."""
        self._take_new_weights()
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            return self._act_on(clients)

    def _act_on(self, clients: list[int]) -> tuple[float, float]:
        start = time.monotonic()
        positions = torch.index_select(self.positions, 0, torch.tensor(clients))  # [M, envs + 1]: slots..., row
        flat_index = (positions[:, :-1] * self._rows_per_slot + positions[:, -1:]).view(-1)
        staged = {key: torch.index_select(flat, 0, flat_index, out=self._staging[key][:len(flat_index)])
                  for key, flat in self._flat.items()}
        gathered = time.monotonic()
        graph = self._graph_for(len(clients)) if self._graphed else None
        if graph is not None:
            result = graph(staged, self.generator)
        else:
            inputs = {key: value.to(self.device, non_blocking=True) for key, value in staged.items()}
            with torch.no_grad():
                noise = torch.empty((len(flat_index), self.num_actions), device=self.device)
                noise.exponential_(generator=self.generator)
                result = _outputs(self.model, inputs["obs"], inputs["done"], noise, self.amp).cpu()
        answered = time.monotonic()
        num_actions = self.num_actions
        self._flat_out["policy_logits"].index_copy_(0, flat_index, result[:, :num_actions])
        self._flat_out["baseline"].index_copy_(0, flat_index, result[:, num_actions])
        self._flat_out["action"].index_copy_(0, flat_index, result[:, num_actions + 1].long())
        return gathered - start + time.monotonic() - answered, answered - gathered

    @property
    def graphed(self) -> bool:
        """Whether batches are replayed as CUDA graphs (a GPU, --cuda_graph, no capture failed)."""
        return self._graphed

    @property
    def num_actions(self) -> int:
        return self.buffers["policy_logits"].shape[-1]

    def _graph_for(self, clients: int) -> _GraphedForward | None:
        """The captured forward that serves `clients` with the current weights, captured now if it is the first
        such batch; None, and eager batches from now on, if the capture failed."""
        envs = self.positions.shape[1] - 1
        rows = min(1 << (clients - 1).bit_length(), self.max_clients) * envs
        key = (id(self.model), rows)
        if key not in self._graphs:
            # Another thread capturing (the learner's first update, a minute with --compile's warm-up): this batch
            # eagerly, the capture at a later one, rather than every actor waiting meanwhile.
            if not cudagraphs.CAPTURE_LOCK.acquire(blocking=False):
                return None
            try:
                self._graphs[key] = _GraphedForward(self.model, rows, self._flat, self.num_actions, self.amp,
                                                    self._stream, self._graph_pool)
            except RuntimeError as exc:  # nothing depends on it: the eager forward computes the same
                log.warning("Could not capture central inference's forward as a CUDA graph (%s); serving without one",
                            first_line(exc))
                self._graphed = False
                self._graphs.clear()
                return None
            finally:
                cudagraphs.CAPTURE_LOCK.release()
        return self._graphs[key]


class InferenceServers:
    """--inference_threads K: K servers, each the body of a thread of its own; client c (actor a's env split s,
    c = a x env_splits + s) is answered by server c mod K.

    Each server has its own weight snapshots (every publish is copied into each), its own high-priority CUDA stream,
    graphs and sampling stream, so up to K batches are in flight at once. An actor asks for one split at a time, so
    with one server the actors fall into two halves, each waiting out the other's batch before its own; with two
    servers and two splits each split has a server and the halves alternate between them (scripts/central_model.py).
    Where a batch's time goes to waiting (on the GPU's queue behind the learner's kernels, on a copy engine) rather
    than to the host, K threads answer up to K times the requests. They share the process's interpreter: where a
    batch is host work (its Python, the slots' copies), more threads add nothing, and each one's batches are smaller
    than one thread's would be.
    """

    def __init__(self, model: Net, buffers: Buffers, positions: torch.Tensor, device: torch.device, amp: bool,
                 wait_s: float, seeds: list[int], graphed: bool = False, splits: int = 1) -> None:
        clients, threads = positions.shape[0], len(seeds)
        asking = np.zeros(clients // splits, dtype=bool)  # which actors have a request in any server's batch
        self.servers = [InferenceServer(model, buffers, positions, device, amp, wait_s, seed, graphed,
                                        max_clients=len(range(k, clients, threads)), splits=splits, asking=asking)
                        for k, seed in enumerate(seeds)]

    def connect(self, client: int, connection: Connection) -> None:
        """Serve `client` on `connection` by its server (InferenceServer.connect)."""
        self.servers[client % len(self.servers)].connect(client, connection)

    def load_weights(self, model: Net) -> None:
        """Make `model`'s weights the ones every server's next batch acts with."""
        for server in self.servers:
            server.load_weights(model)

    def take_stats(self) -> dict[str, float]:
        """InferenceServer.take_stats over all the servers' batches; the busy share is their mean."""
        return _stats([server.take_totals() for server in self.servers])


def _stats(totals: list[tuple[float, int, int, float, float, float]]) -> dict[str, float]:
    """The scalars of `InferenceServer.take_stats` from the `take_totals` of one server or several."""
    seconds, batches, served, busy_s, slots_s, forward_s = (sum(column) for column in zip(*totals, strict=True))
    if not batches:
        return {}
    # A batch counts where it ended, so a share over a short interval can pass 1 by part of one batch.
    share = min(1.0, busy_s / seconds) if seconds > 0 else 0.0
    return {"stats/inference_actors_per_batch": served / batches, "timing/inference_batch_ms": 1000 * busy_s / batches,
            "timing/inference_slots_ms": 1000 * slots_s / batches,
            "timing/inference_forward_ms": 1000 * forward_s / batches, "stats/inference_busy_share": share}


def _outputs(model: Net, obs: torch.Tensor, done: torch.Tensor, noise: torch.Tensor, amp: bool) -> torch.Tensor:
    """The forward of N observations and actions drawn with `noise`: [N, actions + 2], the policy logits, the
    baseline and the action side by side (float32), so that one copy brings them to the host."""
    with torch.autocast(obs.device.type, dtype=torch.bfloat16, enabled=amp, cache_enabled=False):
        output, _ = model(obs[None], done[None])
    logits = output.policy_logits[0].float()
    action = actions_from_noise(logits, noise)
    return torch.cat([logits, output.baseline[0].float()[:, None], action.float()[:, None]], dim=1)


class _GraphedForward:
    """`_outputs` for up to `rows` observations as one CUDA graph, acting with `model`'s weights where they are.

    Called with the staged (page-locked) observations of a batch: they are copied into the graph's inputs, its
    draws made, the graph replayed and the batch's rows of the results copied back. The rows past the batch's
    hold an earlier batch's inputs; their results are computed and ignored.
    """

    def __init__(self, model: Net, rows: int, flat: dict[str, torch.Tensor], num_actions: int, amp: bool,
                 stream: torch.cuda.Stream | None, pool: Any) -> None:
        device = next(model.parameters()).device
        self.obs = torch.zeros((rows, *flat["obs"].shape[1:]), dtype=flat["obs"].dtype, device=device)
        self.done = torch.zeros((rows,), dtype=torch.bool, device=device)
        self.noise = torch.ones((rows, num_actions), device=device)
        with torch.no_grad():  # the caller holds cudagraphs.CAPTURE_LOCK: one capture at a time in the process
            for _ in range(2):  # kernels chosen and workspaces allocated outside the capture
                _outputs(model, self.obs, self.done, self.noise, amp)
            self.graph = torch.cuda.CUDAGraph()
            with cudagraphs.capture(self.graph, pool=pool, stream=stream):
                self.result = _outputs(model, self.obs, self.done, self.noise, amp)

    def __call__(self, staged: dict[str, torch.Tensor], generator: torch.Generator) -> torch.Tensor:
        n = len(staged["done"])
        self.obs[:n].copy_(staged["obs"], non_blocking=True)
        self.done[:n].copy_(staged["done"], non_blocking=True)
        self.noise.exponential_(generator=generator)
        self.graph.replay()
        return self.result[:n].cpu()
