"""Several learner processes under torchrun: one run, G ranks, the update one learner would make with G x B unrolls.

    torchrun --nproc_per_node G run.py ...     every rank is a whole trainer: its own actors, slots, learner threads

- `join` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); without it a run is a plain one and
  nothing here is used. NCCL joins the ranks' GPUs, gloo their CPUs; a gloo group (`control`) carries the
  small messages below on every backend.
- Replicas never drift: rank 0 sends its weights, optimiser state and counters to every rank before the
  actors start (`Coordinator.share_state`), and every gradient step sums or averages the gradients of all
  ranks before clipping and the optimiser step (`GradientReducer`), so every rank applies the same step.
- Lockstep: every update of every rank starts with a vote (`Coordinator.vote`) that carries each rank's
  agent steps, whether it stops, and the games it finished. Every rank votes once per update, in the same
  order, so all of them run the same number of updates and gradient steps; when any rank votes to stop,
  all stop at that same update and none is left waiting in a collective.
- One run: rank 0 alone writes the run directory, TensorBoard, CSV, checkpoints and the console (the other
  ranks log warnings and errors only, marked with their rank). The step counter counts the agent steps of
  every rank, and every rank's games reach rank 0's log through the votes.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from impala.config import (
    LATEST_NAME,
    MAX_ENV_NAME_CHARS,
    MAX_XPID_CHARS,
    Config,
    TrainingError,
    UserError,
    env_int,
    first_line,
    plain_name,
    run_path,
    torchrun_run_id,
)
from impala.learner import LearnerState
from impala.metrics import ConsoleHandler, RunLog
from impala.model import Net
from impala.seeding import SEED_LIMIT, ActorLives

log = logging.getLogger("impala")

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# A rank that does not answer a collective for this long ends the job. One that died is noticed at once
# (its sockets close); this bounds a hung one (an update of the deep ResNet on a CPU takes seconds).
COLLECTIVE_TIMEOUT_S = 300.0
VOTE_HEADER = 3 + len(ActorLives.KEYS)  # stop, agent steps, games finished, the rank's actor-life counters
MAX_GAMES_PER_VOTE = 32  # games a rank reports one by one per update; of more, the newest, and how many the others are


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def check_launch(rank: int, world_size: int, local_rank: int, local_world_size: int) -> None:
    """Raise UserError, before the rendezvous waits for ranks that may never come, for a launch that torchrun would
    not make: the variables set by hand, or left over in a shell."""
    problem = None
    if world_size < 1 or not 0 <= rank < world_size:
        problem = f"RANK {rank} of WORLD_SIZE {world_size} (0 <= RANK < WORLD_SIZE)"
    elif local_world_size < 1 or not 0 <= local_rank < local_world_size:
        problem = f"LOCAL_RANK {local_rank} of LOCAL_WORLD_SIZE {local_world_size} (0 <= LOCAL_RANK < LOCAL_WORLD_SIZE)"
    elif not os.environ.get("MASTER_ADDR"):
        problem = "no MASTER_ADDR"
    elif not os.environ.get("MASTER_PORT", "").isascii() or not os.environ["MASTER_PORT"].isdecimal() \
            or not 0 < int(os.environ["MASTER_PORT"]) < 65536:
        problem = f"MASTER_PORT {os.environ.get('MASTER_PORT')!r} (a port number)"
    if problem is not None:
        raise UserError(f"the torchrun environment is not one torchrun sets: {problem}; launch with torchrun, or "
                        f"unset {', '.join(TORCHRUN_VARIABLES)} for a run of one process")


def default_xpid(config: Config) -> str:
    """The run name under torchrun when --xpid is not given: ENV-RUN_ID, torchrun's rendezvous id (a fresh
    one per launch with --standalone), the same on every rank and in every restart of one launch
    (--max-restarts), so a restarted job continues its run from its checkpoint."""
    run_id = torchrun_run_id()
    if run_id is None:
        raise UserError("under torchrun without --standalone or --rdzv-id, pass --xpid NAME: every rank and every "
                        "restart of the job must name the same run")
    name = f"{plain_name(config.env)[:MAX_ENV_NAME_CHARS]}-{plain_name(run_id)}"
    if len(name) > MAX_XPID_CHARS:
        raise UserError(f"under torchrun, the rendezvous id makes the run's default name {len(name)} characters long, "
                        f"more than a run's name can be ({MAX_XPID_CHARS}); pass --xpid NAME")
    return name


def rank_seed(seed: int, rank: int) -> int:
    """--seed of rank `rank`: rank 0 keeps the run's own, so its actors act as in a one-process run; the
    others get their own, so no two ranks play the same games."""
    if rank == 0:
        return seed
    return int(np.random.SeedSequence(seed, spawn_key=(rank,)).generate_state(1, np.uint32)[0]) % SEED_LIMIT


@dataclasses.dataclass
class Ranks:
    """Where this process stands among the learner processes of the job."""

    rank: int
    world_size: int
    local_rank: int  # on this machine
    local_world_size: int  # ranks on this machine, sharing its cores
    device: torch.device  # the learner's: cuda:LOCAL_RANK, or the CPU
    control: Any = None  # the gloo process group of votes and broadcasts (the default group on the CPU)


def join(config: Config) -> tuple[Config, Coordinator | None]:
    """Under torchrun: join the job's process group; returns this rank's config (the run's xpid, its own
    seed) and its coordinator. Otherwise `(config, None)` and nothing happens. Raises UserError, before
    joining, for a run that has no name every rank agrees on and for --ray local with several ranks."""
    if not launched_by_torchrun():
        return config, None
    xpid = config.xpid or default_xpid(config)
    rank, world_size = env_int("RANK"), env_int("WORLD_SIZE")
    if config.ray == "local" and world_size > 1:
        raise UserError("--ray local starts a private Ray in every learner process; under torchrun start one "
                        "cluster (ray start --head) and pass --ray auto or --ray HOST:PORT")
    local_rank = env_int("LOCAL_RANK")
    local_world_size = env_int("LOCAL_WORLD_SIZE", world_size)
    check_launch(rank, world_size, local_rank, local_world_size)
    backend = "nccl" if not config.disable_cuda and torch.cuda.is_available() else "gloo"
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
    gpu = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    try:
        store = _attempt_store(rank, world_size, timeout)
        xpid = _agree(store, rank, world_size, config, xpid, gpu)
        if backend == "nccl":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, timeout=timeout,
                                    device_id=device)
            control = dist.new_group(backend="gloo", timeout=timeout)
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
            control = dist.group.WORLD
    except RuntimeError as exc:  # torch.distributed's errors: an address that cannot be bound or reached, a timeout
        raise TrainingError(f"the learner processes could not join each other ({first_line(exc)[:200]}); where "
                            "a machine's name does not resolve to the address the others reach it at, give torchrun "
                            "--local-addr ADDRESS (gloo: GLOO_SOCKET_IFNAME names the interface)") from exc
    ranks = Ranks(rank, world_size, local_rank, local_world_size, device, control)
    config = dataclasses.replace(config, xpid=xpid, seed=rank_seed(config.seed, rank))
    return config, Coordinator(ranks, summed_loss=config.policy_loss == "impala")


# Flags a rank may set for itself: its machine's actors, devices and patience, and what rank 0 alone uses (logs,
# checkpoints, evaluations). Every other flag shapes the shared update or the run, and must be the same on every rank.
RANK_OWN_FLAGS = frozenset({
    "savedir", "num_actors", "envs_per_actor", "env_splits", "num_buffers", "inference", "inference_wait_ms",
    "inference_threads", "ray", "ray_actors", "ray_envs_per_actor", "ray_steps_per_request", "ray_actor_resource",
    "ray_publish_every", "ray_max_policy_lag", "num_learner_threads", "disable_cuda", "amp", "compile", "cuda_graph",
    "pin_slots", "max_actor_restarts", "actor_timeout_s", "max_bad_updates", "learner_timeout_s", "log_interval_s",
    "checkpoint_interval_s", "keep_checkpoints", "eval_interval_s", "eval_episodes", "eval_actions", "eval_max_steps",
    "test_episodes", "video", "plot_out", "plot_xpids", "plot_x"})
MAX_FLAGS_NAMED = 4  # of the flags the ranks disagree on, the message names this many


def _agree(store: dist.Store, rank: int, world_size: int, config: Config, xpid: str, gpu: str | None) -> str:
    """Every rank's flags and learner GPU (its UUID; None: the CPU) through torchrun's store, before any process
    group: returns the run's name, rank 0's (`--xpid latest` read there: the other machines need no copy of the
    run directory). Raises UserError on every rank where rank 0 cannot name the run, where the ranks were started
    with different flags (other than RANK_OWN_FLAGS: their updates would drift apart, or fail), where some learn on
    a GPU and others on the CPU (NCCL and gloo do not meet), or where two would share a GPU (NCCL refuses)."""
    mine: dict[str, Any] = {"flags": config.to_dict(), "gpu": gpu, "xpid": xpid}
    if rank == 0 and xpid == LATEST_NAME:
        try:
            mine["xpid"] = run_path(config.savedir, xpid).name
        except UserError as exc:
            mine["problem"] = str(exc)
    store.set(f"flags/{rank}", json.dumps(mine))
    hands = [mine if other == rank else json.loads(store.get(f"flags/{other}")) for other in range(world_size)]
    first = hands[0]
    if "problem" in first:
        raise UserError(first["problem"] if rank == 0 else f"rank 0 cannot name the run: {first['problem']}")
    differ = [(other, name, value) for other, hand in enumerate(hands) for name, value in hand["flags"].items()
              if name not in RANK_OWN_FLAGS and value != first["flags"].get(name)]
    if differ:
        named = "; ".join(f"--{name} {first['flags'].get(name)!r} on rank 0, {value!r} on rank {other}"
                          for other, name, value in differ[:MAX_FLAGS_NAMED])
        more = f" and {len(differ) - MAX_FLAGS_NAMED} more" if len(differ) > MAX_FLAGS_NAMED else ""
        raise UserError(f"the learner processes were started with different flags: {named}{more}; give every rank "
                        "the same command line")
    on_gpus = [other for other, hand in enumerate(hands) if hand["gpu"] is not None]
    if 0 < len(on_gpus) < world_size:
        raise UserError(f"rank(s) {', '.join(map(str, on_gpus))} learn on a GPU and the others on the CPU: give every "
                        "rank a GPU, or pass --disable_cuda to every rank")
    sharing = [other for other in on_gpus if [hand["gpu"] for hand in hands].count(hands[other]["gpu"]) > 1]
    if sharing:
        raise UserError(f"ranks {', '.join(map(str, sharing))} would share a GPU, which NCCL refuses: start as many "
                        "learner processes on a machine as it has GPUs (--nproc_per_node), or pass --disable_cuda")
    return str(first["xpid"])


def _attempt_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """torchrun's store (env://), its keys kept apart per restart (--max-restarts): measured with torch 2.13 and
    --standalone, the ranks of a restart otherwise read the addresses of the previous attempt's ranks from it
    and fail to connect to the dead."""
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    return dist.PrefixStore(f"impala/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def leave(coordinator: Coordinator | None) -> None:
    """Leave the process group, dropping this module's references to it first, so that its sockets and
    threads go now rather than at interpreter exit."""
    if coordinator is None:
        return
    coordinator.ranks.control = coordinator.reducer.group = None
    if dist.is_initialized():
        dist.destroy_process_group()


def _lost(what: str, exc: Exception) -> TrainingError:
    """The one line a rank ends with when a collective fails: another rank died, hung or was stopped."""
    return TrainingError(f"another learner process stopped answering ({what}: {_lost_text(exc)}): it died or was "
                         "stopped, see its own output")


def _lost_text(exc: Exception) -> str:
    """What a failed collective says, in short: gloo's "[file:line] Read error ...: reason. Hint" as its reason."""
    return re.sub(r"^\[[^\]]*\] ", "", first_line(exc)).split(". ")[0][:160]


class GradientReducer:
    """Makes every rank's gradients those of the whole batch of all ranks, in place, before clipping.

    `--policy_loss impala` sums its losses over the batch ([T, B]): the whole batch's gradient is the sum
    of the ranks' gradients. `ppo` averages them: the ranks' minibatches are the same size, so it is their
    mean. One all-reduce of one flat tensor per gradient step, with a flag appended that any rank whose
    loss is not finite raises: then every rank's gradient is NaN and every rank skips the step, so the
    replicas make the same choice.
    """

    def __init__(self, world_size: int, summed_loss: bool, group: Any = None) -> None:
        self.world_size = world_size
        self.summed_loss = summed_loss
        self.group = group  # None: the default group (NCCL or gloo)
        self.failed = False  # a collective failed: the group is broken, no rank votes again

    def reduce(self, model: Net, loss: torch.Tensor) -> None:
        parameters = [p for p in model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        not_finite = (~torch.isfinite(loss.detach())).to(grads[0].dtype).reshape(1)
        flat = torch.cat([g.reshape(-1) for g in grads] + [not_finite])
        try:
            dist.all_reduce(flat, group=self.group)
        except RuntimeError as exc:
            self.failed = True
            raise _lost("gradient all-reduce", exc) from exc
        if not self.summed_loss:
            flat /= self.world_size
        flat = torch.where(flat[-1] > 0, torch.full_like(flat, math.nan), flat)
        offset = 0
        for parameter, grad in zip(parameters, grads):
            parameter.grad = flat[offset:offset + grad.numel()].view_as(grad)
            offset += grad.numel()

    @torch.compiler.disable  # run as written under --compile: traced, its collectives bypassed the except below
    def moments(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and (unbiased) standard deviation of `values` over every rank's values, as `Tensor.mean()` and
        `Tensor.std()` of them all: PPO normalises its advantages with these over the whole minibatch."""
        values = values.detach().float()
        total = torch.stack([values.sum(), torch.tensor(float(values.numel()), device=values.device)])
        self._all_reduce(total)
        mean = total[0] / total[1]
        squares = ((values - mean) ** 2).sum()
        self._all_reduce(squares)
        return mean, (squares / (total[1] - 1)).sqrt()

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        try:
            dist.all_reduce(tensor, group=self.group)
        except RuntimeError as exc:
            self.failed = True
            raise _lost("advantage normalisation", exc) from exc


class Coordinator:
    """The per-update vote of every rank, the games every rank finished on their way to rank 0, and the
    state rank 0 shares at the start. `vote` is the learner threads' (under the update lock), `games` the
    monitor's."""

    def __init__(self, ranks: Ranks, summed_loss: bool) -> None:
        self.ranks = ranks
        self.reducer = GradientReducer(ranks.world_size, summed_loss)
        self.stopped = False  # a vote said stop: every later vote is 0 at once, without a collective
        self.stopped_by: int | None = None  # the first rank that voted to stop when this one did not
        self._outbox: collections.deque[tuple[float, int]] = collections.deque()  # this rank's games, not yet sent
        self._inbox: collections.deque[tuple[float, int]] = collections.deque()  # rank 0: every rank's, not yet logged
        self._unlisted: collections.deque[int] = collections.deque()  # rank 0: the number of every rank's other games
        self.lives: ActorLives | None = None  # this rank's, from `share_state` on: each vote reports its counters
        self.peak_lives = dict.fromkeys(ActorLives.KEYS, 0)  # rank 0: the highest each counter of any rank was

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def step_reducer(self) -> GradientReducer | None:
        """What each gradient step reduces through, or None for a job of one rank: its gradients and advantage
        moments are already the whole batch's, and without a reducer its update can be one CUDA graph
        (`learner.uses_cuda_graph`), as a plain run's is."""
        return self.reducer if self.ranks.world_size > 1 else None

    def vote(self, stop: bool, steps: int) -> int:
        """One update's vote: this rank adds `steps` agent steps, or wants to stop. Returns the agent steps of
        every rank in this update, or 0 when any rank voted to stop (then every rank stops here)."""
        if self.stopped or self.reducer.failed:
            return 0
        # Every game finished goes with this vote, so none waits and the outbox stays small: the newest one by one,
        # the others as their number (a rank that finishes more games per update than a vote lists).
        finished = [self._outbox.popleft() for _ in range(len(self._outbox))]
        games = finished[-MAX_GAMES_PER_VOTE:]
        message = torch.zeros(VOTE_HEADER + 2 * MAX_GAMES_PER_VOTE, dtype=torch.float64)
        lives = self.lives.state_dict() if self.lives is not None else dict.fromkeys(ActorLives.KEYS, 0)
        message[:VOTE_HEADER] = torch.tensor([float(stop), float(steps), float(len(finished)),
                                              *(float(lives[key]) for key in ActorLives.KEYS)])
        if games:
            message[VOTE_HEADER:VOTE_HEADER + 2 * len(games)] = torch.tensor(games, dtype=torch.float64).flatten()
        gathered = [torch.empty_like(message) for _ in range(self.ranks.world_size)]
        try:
            dist.all_gather(gathered, message, group=self.ranks.control)
        except RuntimeError as exc:
            self.stopped = True  # no second try on a broken group: this rank's other learner threads just stop
            raise _lost("the vote before an update", exc) from exc
        if self.rank == 0:
            for other in gathered:
                for index, key in enumerate(ActorLives.KEYS, start=3):
                    self.peak_lives[key] = max(self.peak_lives[key], int(other[index]))
                listed = min(int(other[2]), MAX_GAMES_PER_VOTE)
                pairs = other[VOTE_HEADER:VOTE_HEADER + 2 * listed].view(-1, 2).tolist()
                self._inbox.extend((episode_return, int(length)) for episode_return, length in pairs)
                if int(other[2]) > listed:
                    self._unlisted.append(int(other[2]) - listed)
        stopping = [rank for rank, other in enumerate(gathered) if other[0]]
        if stopping:
            self.stopped = True
            if not stop:
                self.stopped_by = stopping[0]
            return 0
        return int(sum(float(other[1]) for other in gathered))

    def games(self, finished: list[tuple[float, int]]) -> tuple[list[tuple[float, int]], int]:
        """Hand this rank's `finished` games (return, length) to its next vote. Returns, on rank 0, the games of
        every rank that votes have listed so far and how many other games they counted (a vote lists
        MAX_GAMES_PER_VOTE of a rank's games at most), and once the ranks have stopped its own that no vote
        carried; elsewhere ([], 0)."""
        self._outbox.extend(finished)
        if self.rank != 0:
            return [], 0
        if self.stopped:  # no vote carries games any more: rank 0's own (those of its last drain) go to its log
            self._inbox.extend(self._outbox.popleft() for _ in range(len(self._outbox)))
        unlisted = sum(self._unlisted.popleft() for _ in range(len(self._unlisted)))  # deques: votes add meanwhile
        return [self._inbox.popleft() for _ in range(len(self._inbox))], unlisted

    def run_wide_lives(self, counters: dict[str, Any]) -> dict[str, Any]:
        """`counters` (rank 0's, for a checkpoint) with the actor-life counters raised to the highest any rank
        reported: every rank resumes from rank 0's, and none may hand out again a life or env seed it used
        (each rank counts from a seed of its own, `rank_seed`)."""
        return {**counters, **{key: max(int(counters[key]), value) for key, value in self.peak_lives.items()}}

    def ready(self) -> None:
        """Wait until every rank has built what it can refuse (its env, its memory, its Ray cluster): rank 0 writes
        the run's files only then, so a rank that refused (and exited, saying why) leaves them as they were."""
        try:
            dist.barrier(group=self.ranks.control)
        except RuntimeError as exc:  # most likely a rank that refused the run: its own line says why
            raise TrainingError(f"another learner process ended before the run began, most likely refusing it "
                                f"(its own line says why): {_lost_text(exc)}") from exc

    def share_state(self, state: LearnerState, session: int, config: Config) -> int:
        """Rank 0 sends its learner state (weights, optimiser, counters: a checkpoint's content) and its
        session number; every other rank loads them. Returns the session. Called by every rank, before
        any actor starts; from then on the votes report `state.lives`."""
        payload: list[Any] = [{**state.state_dict(), "session": session} if self.rank == 0 else None]
        try:
            dist.broadcast_object_list(payload, src=0, group=self.ranks.control)
        except RuntimeError as exc:
            raise _lost("sharing rank 0's weights", exc) from exc
        if self.rank != 0:
            state.load_state_dict(payload[0], config, Path(f"<rank 0's state of {config.xpid}>"))
        self.lives = state.lives
        return int(payload[0]["session"])


def rank_run_dir(config: Config) -> Path:
    """Where the run lives, for a rank other than 0: it reads and writes nothing there."""
    assert config.xpid is not None, "set by join"
    return run_path(config.savedir, config.xpid)


class NoRunLog(RunLog):
    """The run log of ranks other than 0: rank 0 alone writes TensorBoard and the CSV."""

    def __init__(self) -> None:  # no SummaryWriter, no file
        pass

    def scalars(self, step: int, values: Any) -> None:
        pass

    def scalar(self, tag: str, value: float, step: int) -> None:
        pass

    def games(self, games: Any, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def rank_console(rank: int) -> None:
    """On ranks other than 0: warnings and errors only, each marked with the rank (rank 0 logs the run)."""
    log.setLevel(logging.WARNING)
    formatter = logging.Formatter(f"[%(asctime)s rank {rank}] %(message)s", datefmt="%H:%M:%S")
    for handler in log.handlers:
        if isinstance(handler, ConsoleHandler):
            handler.setFormatter(formatter)
