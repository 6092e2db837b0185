"""Where the CPU goes: each stage of the data path alone, the whole trainer, and the ceiling they imply.

    python -m impala.bench                      # Pong, shallow net, the trainer's T and B, 2 actors x 8 envs
    python -m impala.bench --only env,inference,learner --seconds 10
    python -m impala.bench --only e2e --variants "--inference actor" "--inference central"
    torchrun --standalone --nproc_per_node 2 -m impala.bench --only learner --disable_cuda   # 2 learner ranks

Components, each timed for `--seconds` after a warm-up, in this process:

    env        one EnvBatch of envs_per_actor envs stepped with random actions (an actor without a model)
    inference  the actor's batched forward + action sampling (one torch thread, the actor's autocast);
               with --inference central: all actors' envs in one batch on the learner's device
    learner    stack B slots, copy to the learner's device, learner.update, on a synthetic [T+1, B] batch;
               under torchrun every rank does it in lockstep, gradients all-reduced (`distributed.py`), and
               rank 0 reports the steps of all ranks
    actor      one actor as its process runs it (actor.run_actor: env splits, policy, slot writes) with its
               slots recycled at once: what one actor does with no learner to wait for (not in the ceiling)
    actors     --num_actors such actors at once, each in its own process, timed over one window: what the
               trainer's actors step together on this machine's cores with no learner to wait for; each
               end-to-end row gives its share of it

End to end: `python run.py ...` as a subprocess; its whole process tree (main process, fork server,
actors) is sampled from /proc every POLL_S for CPU time and every PSS_POLL_S for proportional memory (PSS).

Every rate is in agent steps (one inference sample, one env step of one env, one [t, b] entry of a
batch). Per CPU-second rates divide by the CPU time of the process(es) doing the work, so they hold
up on a machine busy with other work far better than rates per wall second.

Ceiling: one agent step costs 1/env + 1/inference + 1/learner CPU-seconds (each per CPU-second), so
no arrangement of processes on this machine does better than 1 / that per CPU-second, or that times the
usable cores per second. A GPU learner's cost here is its host CPU only. The env-only ceiling is every
usable core stepping envs and nothing else, which a trainer whose learner and inference are on a GPU
approaches: each end-to-end row says what fraction of it the run reached.

On a GPU, the learner component and the end-to-end rows also give the GPU's busy share: the mean of
nvidia-smi's utilization.gpu (the share of time a kernel ran), sampled every GPU_POLL_MS.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import math
import multiprocessing
import os
import platform
import queue
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing import Pipe, resource_tracker
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from impala import channels, distributed, learner
from impala.actor import ACTOR_PHASES, ActorChannels, phase_shares, run_actor
from impala.actor_pool import keep_freed_memory
from impala.buffers import BufferSpec, create_buffers, pin_observations, unpin_observations
from impala.checkpoint import CHECKPOINT_NAME, load_checkpoint
from impala.config import (
    ONLY_WITH,
    Config,
    DefaultsHelpFormatter,
    OneLineErrorParser,
    UserError,
    add_flags,
    cpu_quota,
    env_int,
    parse_config,
    path_problem,
    to_flags,
    usable_cores,
)
from impala.environment import EnvBatch, probe_env
from impala.inference import InferenceServer, InferenceServers
from impala.learners import learner_torch_threads, select_device
from impala.model import CastTorso, Net, sample_actions, use_amp
from impala.seeding import first_life
from impala.stopping import Terminated, sigterm_as_ctrl_c

REPO_ROOT = Path(__file__).resolve().parent.parent
COMPONENTS = ("env", "inference", "learner", "actor", "actors", "e2e")
# Config fields the bench takes as flags; every other field keeps its Config default.
CONFIG_FLAGS = ("env", "model", "use_lstm", "num_actors", "envs_per_actor", "env_splits", "unroll_length",
                "batch_size", "total_steps", "disable_cuda", "amp", "inference", "inference_wait_ms",
                "inference_threads", "policy_loss", "optimizer", "epochs", "minibatches", "advantage_norm",
                "minibatch_mode", "compile", "cuda_graph", "pin_slots")
# Where the bench's defaults differ from the trainer's: a short run sized for two cores.
BENCH_DEFAULTS = {"num_actors": 2, "total_steps": 60_000}
POLL_S = 0.1
GPU_POLL_MS = 200
PSS_POLL_S = 2.0  # reading smaps_rollup costs ~6 ms CPU per torch process; the run's memory changes slowly
PROVISIONAL_LOAD = 1.5  # a 1-minute load average above this at the start makes wall-clock rates unreliable
MIN_CALLS = 3  # timed calls per component, however slow one call is
ACTORS_START_TIMEOUT_S = 300.0  # for --num_actors processes to import torch and make their envs
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------ micro-benchmarks


@dataclass
class Rate:
    """Agent steps done in a timed window, with its wall and CPU (process_time: every thread) seconds."""

    steps: int
    wall_s: float
    cpu_s: float

    def to_dict(self) -> dict[str, float]:
        return {"steps": self.steps, "wall_s": self.wall_s, "cpu_s": self.cpu_s,
                "steps_per_s": self.steps / self.wall_s, "steps_per_cpu_s": self.steps / self.cpu_s,
                "cpu_ms_per_step": 1000.0 * self.cpu_s / self.steps}


class DispatchCount(TorchDispatchMode):
    """Counts the tensor operations dispatched below autograd, views left out, while it is entered: on a GPU each
    launches about one kernel, so that a learner bound by launching work (an eager update, or a CUDA graph of many
    small kernels) costs in proportion to it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def operations_per_gradient_step(model: Net, optimizer: torch.optim.Optimizer,
                                 scheduler: torch.optim.lr_scheduler.LRScheduler, batch: dict[str, torch.Tensor],
                                 core_state: tuple[torch.Tensor, ...], config: Config, amp: bool) -> float:
    """The operations (`DispatchCount`) of one eager `learner.update` of `batch`, per gradient step: what a CUDA
    graph of the update replays, without `--compile`'s fusions. The update is applied."""
    with DispatchCount() as dispatched:
        learner.update(model, optimizer, scheduler, batch, core_state, config, amp)
    return dispatched.count / learner.gradient_steps(learner.minibatch_units(batch, config), config)


def timed_loop(step: Callable[[], int], seconds: float, lockstep: Any = None, warm: bool = True) -> Rate:
    """Call `step` (returns the agent steps it did) for a warm-up of 10% of `seconds` (unless the caller warmed
    it up: `warm` False), then time it for `seconds` and at least MIN_CALLS calls. `lockstep` (torchrun ranks
    whose steps are collectives: their gloo group, which takes CPU tensors whatever the ranks' devices): every
    rank calls `step` as often as the others, each stopping when the first wants to; the CPU seconds are
    those of all ranks."""
    if warm:
        warm_up(step, seconds, lockstep)
    steps, calls = 0, 0
    wall_start, cpu_start = time.perf_counter(), time.process_time()
    while not _done(calls >= MIN_CALLS and time.perf_counter() - wall_start >= seconds, lockstep):
        steps += step()
        calls += 1
    cpu_s = torch.tensor(time.process_time() - cpu_start, dtype=torch.float64)
    if lockstep is not None:
        dist.all_reduce(cpu_s, group=lockstep)
    return Rate(steps, time.perf_counter() - wall_start, float(cpu_s))


def warm_up(step: Callable[[], int], seconds: float, lockstep: Any = None) -> None:
    """The warm-up of a timed loop: `step` called three times, then until 10% of `seconds` has passed."""
    warmup_end = time.perf_counter() + 0.1 * seconds
    for _ in range(3):  # whatever the time: lazy initialisation, allocator, cuDNN autotuning, --compile's
        step()          # compilation and its CUDA-graph recording (the third call)
    while not _done(time.perf_counter() >= warmup_end, lockstep):
        step()


@contextlib.contextmanager
def gpu_busy(device_index: int | None) -> Iterator[dict[str, float]]:
    """Sample GPU `device_index`'s utilisation with nvidia-smi every GPU_POLL_MS while inside: on exit the dict
    holds `gpu_busy`, the mean share of time in which a kernel ran (0-1; `nvidia-smi dmon`'s "sm" column).
    Empty without a GPU (None) or without nvidia-smi."""
    result: dict[str, float] = {}
    tool = shutil.which("nvidia-smi")
    if device_index is None or tool is None:
        yield result
        return
    sampler = subprocess.Popen([tool, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                "-i", nvidia_smi_id(device_index), "-lms", str(GPU_POLL_MS)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        yield result
    finally:
        sampler.terminate()
        try:
            output, _ = sampler.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            sampler.kill()
            output, _ = sampler.communicate()
        samples = [float(line) for line in output.split() if line.replace(".", "", 1).isdigit()]
        if samples:
            result["gpu_busy"] = sum(samples) / len(samples) / 100


def nvidia_smi_id(device_index: int) -> str:
    """nvidia-smi's name for torch's CUDA device `device_index`: the entry of CUDA_VISIBLE_DEVICES that torch's
    index counts (nvidia-smi numbers every GPU of the machine and ignores the variable), else the index itself."""
    visible = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    return visible[device_index] if device_index < len(visible) else str(device_index)


def _done(done: bool, lockstep: Any) -> bool:
    if lockstep is not None:  # the ranks' clocks differ: agree, or one would wait forever in the next step's all-reduce
        flag = torch.tensor(float(done))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=lockstep)
        return bool(flag)
    return done


@contextlib.contextmanager
def torch_threads(count: int) -> Any:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@dataclass(frozen=True)
class EnvShape:
    observation_shape: tuple[int, ...]
    observation_dtype: torch.dtype
    num_actions: int
    model: str  # the network `--model auto` resolves to


def env_shape(config: Config) -> EnvShape:
    """The env's shapes as the trainer probes them (`environment.probe_env`), and the model `--model` names."""
    observation_shape, dtype, num_actions = probe_env(config.env, config.seed)
    try:
        with torch.device("meta"):  # its shapes alone, as the trainer checks them
            model = Net(observation_shape, num_actions, config.model, config.use_lstm, config.hidden_size)
    except ValueError as exc:  # --model shallow for vectors: the trainer's one line
        raise UserError(str(exc)) from None
    return EnvShape(observation_shape, dtype, num_actions, model.model)


def bench_env(config: Config, seconds: float) -> dict[str, Any]:
    """One actor's envs (an EnvBatch of envs_per_actor / env_splits) stepped with uniformly random actions."""
    batch = config.envs_per_actor // config.env_splits
    env = EnvBatch(config.env, batch, config.seed, episodic_life=config.episodic_life,
                   fire_on_life_loss=config.fire_on_life_loss)
    try:
        env.reset()
        actions = np.random.default_rng(config.seed).integers(0, env.num_actions, (1024, env.num_envs))
        calls = 0

        def step() -> int:
            nonlocal calls
            env.step(actions[calls % len(actions)])
            calls += 1
            return env.num_envs

        rate = timed_loop(step, seconds)
    finally:
        env.close()
    return {"what": f"EnvBatch of {batch} envs, random actions, one process",
            "batch": batch, "device": "cpu", **rate.to_dict()}


def bench_inference(config: Config, shape: EnvShape, seconds: float) -> dict[str, Any]:
    """The policy forward and action sampling one actor does per step, or with --inference central one batch of
    the central thread for every actor's env split at once (`_bench_server`)."""
    if config.inference == "central":
        return _bench_server(config, shape, seconds)
    batch = config.envs_per_actor // config.env_splits  # as an actor
    amp = use_amp(config.amp, torch.device("cpu"), shape.model)
    model = Net(shape.observation_shape, shape.num_actions, config.model, config.use_lstm, config.hidden_size).eval()
    obs = _random_tensor((1, batch, *shape.observation_shape), shape.observation_dtype)
    done = torch.zeros((1, batch), dtype=torch.bool)
    core_state = model.initial_state(batch)
    generator = torch.Generator().manual_seed(config.seed)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp)
    net = CastTorso(model, torch.bfloat16).refresh(0) if amp else model  # the torso's weights cast once, as actors do

    def step() -> int:
        with torch.no_grad(), autocast:
            output, _ = net(obs, done, core_state)
        sample_actions(output.policy_logits[0], generator)
        return batch

    with torch_threads(1):
        rate = timed_loop(step, seconds)
    return {"what": f"{shape.model} forward + sampling at batch {batch} (one actor)", "batch": batch,
            "device": "cpu", "threads": 1, "amp": amp, **rate.to_dict()}


def _bench_server(config: Config, shape: EnvShape, seconds: float) -> dict[str, Any]:
    """`InferenceServer.serve_once` on the learner's device, every actor's env split asking at once: the
    observations gathered from slots in shared memory, the forward and sampling (a CUDA graph on a GPU with
    --cuda_graph), the answers written back, each request and answer a byte on a pipe (both ends in this thread).
    With --inference_threads K, K servers (`InferenceServers`) each in a thread of its own, every one serving its
    share of the clients at once, as the trainer runs them: what K threads answer together (`_concurrent_loop`)."""
    device = select_device(config)
    clients, envs = config.num_actors * config.env_splits, config.envs_per_actor // config.env_splits
    threads = learner_torch_threads(config, device)
    amp = use_amp(config.amp, device, shape.model)
    model = Net(shape.observation_shape, shape.num_actions, config.model, config.use_lstm, config.hidden_size)
    model = model.to(device).eval()
    buffers = create_buffers(BufferSpec(clients * envs, 1, shape.observation_shape, shape.observation_dtype,
                                        shape.num_actions))
    buffers["obs"].copy_(_random_tensor(buffers["obs"].shape, shape.observation_dtype))
    buffers["done"].zero_()
    positions = torch.zeros((clients, envs + 1), dtype=torch.int64)  # client c: slots c x envs..., row 0
    positions[:, :-1] = torch.arange(clients * envs).view(clients, envs)
    servers = InferenceServers(model, buffers, positions, device, amp, wait_s=1.0,
                               seeds=[config.seed + k for k in range(config.inference_threads)],
                               graphed=config.cuda_graph, splits=config.env_splits).servers
    ends: list[list[Connection]] = [[] for _ in servers]  # each server's clients' actor ends
    for client in range(clients):
        server_end, actor_end = Pipe()
        servers[client % len(servers)].connect(client, server_end)
        ends[client % len(servers)].append(actor_end)

    def serve(server: InferenceServer, its_ends: list[Connection]) -> Callable[[], int]:
        def step() -> int:
            for end in its_ends:
                channels.signal(end)
            served = server.serve_once(timeout_s=5.0)
            if served != len(its_ends) or not all(channels.take_signal(end) for end in its_ends):
                raise RuntimeError(f"the inference server answered {served} of {len(its_ends)} clients")
            return len(its_ends) * envs
        return step

    steps = [serve(server, its_ends) for server, its_ends in zip(servers, ends, strict=True)]
    try:
        with torch_threads(threads):
            rate = timed_loop(steps[0], seconds) if len(steps) == 1 else _concurrent_loop(steps, seconds)
    finally:
        for end in (end for its_ends in ends for end in its_ends):
            end.close()
        for server in servers:
            server.serve_once(timeout_s=0.0)  # drops the closed clients, closing the server's ends
    graphed = all(server.graphed for server in servers)
    how = " as CUDA graphs" if graphed else ""
    where = "central thread" if len(servers) == 1 else f"{len(servers)} central threads"
    return {"what": f"{shape.model} forward + sampling{how}, {clients} clients x {envs} envs ({where})",
            "batch": clients * envs, "device": str(device), "threads": threads, "amp": amp,
            "inference_threads": len(servers), "graphed": graphed, **rate.to_dict()}


def _concurrent_loop(steps: Sequence[Callable[[], int]], seconds: float) -> Rate:
    """Each of `steps` called over and over in a thread of its own, all at once: each warmed up (`warm_up`),
    then timed together for `seconds` (every thread at least MIN_CALLS calls). The steps are those of all the
    threads; the CPU seconds the process's. What a thread raises is raised here once all have stopped."""
    warm = threading.Barrier(len(steps) + 1)  # the timing starts once every thread is warm
    stop = threading.Event()
    counts, calls = [0] * len(steps), [0] * len(steps)
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            warm_up(steps[k], seconds)
            warm.wait()
            while not (stop.is_set() and calls[k] >= MIN_CALLS):
                counts[k] += steps[k]()
                calls[k] += 1
        except threading.BrokenBarrierError:
            pass  # another thread failed while warming up
        except BaseException as exc:  # noqa: BLE001 - raised again in the calling thread
            errors.append(exc)
            warm.abort()

    workers = [threading.Thread(target=run, args=(k,), name=f"bench-server-{k}", daemon=True)
               for k in range(len(steps))]
    for worker in workers:
        worker.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        warm.wait()
    wall_start, cpu_start = time.perf_counter(), time.process_time()
    while not errors and time.perf_counter() - wall_start < seconds:
        time.sleep(min(0.05, seconds))
    stop.set()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return Rate(sum(counts), time.perf_counter() - wall_start, time.process_time() - cpu_start)


def bench_learner(config: Config, shape: EnvShape, seconds: float) -> dict[str, Any]:
    """What one learner thread does per batch: stack B slots [T+1, B], copy them to the device, update. Under
    torchrun, every rank at once with the gradients all-reduced: the steps are those of all ranks."""
    _, coordinator = distributed.join(config)
    reducer = coordinator.step_reducer if coordinator is not None else None
    world_size = coordinator.ranks.world_size if coordinator is not None else 1
    device = coordinator.ranks.device if coordinator is not None else select_device(config)
    threads = learner_torch_threads(config, device, coordinator.ranks.local_world_size if coordinator else 1)
    amp = use_amp(config.amp, device, shape.model)
    with torch_threads(threads):
        torch.manual_seed(config.seed)
        model = Net(shape.observation_shape, shape.num_actions, config.model, config.use_lstm,
                    config.hidden_size).to(device)
        optimizer, scheduler = learner.make_optimizer(model, config, world_size)
        buffers = _synthetic_slots(config, shape, model)
        pinned = device.type == "cuda" and config.pin_slots
        if pinned:  # as the trainer's learner threads copy them: from shared memory, page-locked
            buffers["obs"].share_memory_()
            pinned = pin_observations(buffers, device)
        staging = learner.BatchStaging(buffers, config.batch_size, pin=device.type == "cuda")
        slots = list(range(config.batch_size))
        loss_fn = learner.loss_function(config, device, world_size)  # compiled with --compile, in the warm-up
        update = learner.update_function(config, device, world_size)  # a CUDA graph on a GPU, captured in the warm-up

        phases_ms: dict[str, list[float]] = {"stack": [], "copy": [], "update": []}

        def step() -> int:
            start = time.perf_counter()
            staging.fill(slots)
            stacked = time.perf_counter()
            batch, core_state = staging.to(device)
            copied = time.perf_counter()
            update(model, optimizer, scheduler, batch, core_state, config, amp, reducer, loss_fn)  # waits
            for name, ms in zip(phases_ms, (stacked - start, copied - stacked, time.perf_counter() - copied),
                                strict=True):
                phases_ms[name].append(1000.0 * ms)
            return config.steps_per_update * world_size

        lockstep = coordinator.ranks.control if coordinator is not None else None
        warm_up(step, seconds, lockstep)  # not in the GPU's busy share: a capture or --compile's minute leaves it idle
        with gpu_busy(_cuda_index(device)) as busy:
            rate = timed_loop(step, seconds, lockstep, warm=False)
        operations = {}
        if coordinator is None:  # counted after the timing: the ranks' all-reduces are left out of it
            staging.fill(slots)
            operations["operations_per_gradient_step"] = operations_per_gradient_step(
                model, optimizer, scheduler, *staging.to(device), config, amp)
        if pinned:
            unpin_observations(buffers, device)
        distributed.leave(coordinator)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    ranks = f", {world_size} ranks x B" if world_size > 1 else ""
    graph = ", one CUDA graph per update" if isinstance(update, learner.GraphedUpdate) else ""
    direct = ", observations copied straight from page-locked slots" if pinned else ""
    return {"what": f"{shape.model} update on [T+1={config.unroll_length + 1}, B={config.batch_size}] "
                    f"({name}{ranks}{graph}{direct})",
            "batch": config.batch_size, "ranks": world_size, "device": str(device), "threads": threads, "amp": amp,
            "cpu_is_host_only": device.type == "cuda",
            # Medians over every call, the warm-up's included (the median leaves out its compiling and capturing):
            # stacking B slots, their copy to the device (started; observations copied straight from page-locked
            # slots are read by then), and the update until its stats are read.
            "median_ms_per_batch": {name: statistics.median(times) for name, times in phases_ms.items()},
            **operations, **rate.to_dict(), **busy}


def _cuda_index(device: torch.device) -> int | None:
    return (device.index or 0) if device.type == "cuda" else None


class _CountingQueue(queue.Queue):
    """A queue that counts its puts (slots handed over, for `bench_actor`)."""

    puts = 0

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        self.puts += 1


def bench_actor(config: Config, shape: EnvShape, seconds: float, index: int = 0,
                start: Any = None) -> dict[str, Any]:
    """One actor, run as its process runs it, in a thread of this process: its slots go straight back to it.

    Timed from the first handed-over unroll on (env creation and reset excluded) for `seconds`, then to
    the next unroll boundary. Always actor-side inference. `index`: the actor whose first life's seeds it
    plays. `start`: a barrier (`bench_actors`) that every actor reaches after its warm-up; then timed from
    the next unroll boundary on.
    """
    model = Net(shape.observation_shape, shape.num_actions, config.model, config.use_lstm, config.hidden_size).eval()
    core_shapes = model.core_state_shapes()
    spec = BufferSpec(2 * config.envs_per_actor, config.unroll_length, shape.observation_shape,
                      shape.observation_dtype, shape.num_actions, core_shapes)
    buffers = {name: torch.zeros(size, dtype=dtype) for name, (size, dtype) in spec.fields().items()}
    recycled = _CountingQueue()  # free and full at once: a handed-over slot is free again
    for slot in range(spec.num_buffers):
        recycled.put(slot)
    errors: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
    phase_seconds = [0.0] * len(ACTOR_PHASES)
    channels = ActorChannels(free_queue=recycled, full_queue=recycled, episode_queue=queue.SimpleQueue(),
                             error_queue=errors, stop_event=threading.Event(),
                             policy_version=types.SimpleNamespace(value=0), phase_seconds=phase_seconds)
    seeds = first_life(config.seed, index, config.envs_per_actor)
    actor = threading.Thread(target=run_actor, args=(0, dataclasses.replace(config, inference="actor"), buffers,
                                                     model, channels, seeds), daemon=True)

    def handed_over(after: int) -> tuple[int, float, float]:
        """Wait until more than `after` slots were handed over; (slots, wall, CPU) at that moment."""
        while recycled.puts <= after:
            if not actor.is_alive():
                raise RuntimeError(errors.get()[1] if not errors.empty()
                                   else "the actor stopped")
            time.sleep(0.001)
        return recycled.puts, time.perf_counter(), time.process_time()

    with torch_threads(1):  # as in an actor process
        actor.start()
        try:
            slots_start, wall_start, cpu_start = handed_over(spec.num_buffers)
            if start is not None:
                start.wait(ACTORS_START_TIMEOUT_S)
                slots_start, wall_start, cpu_start = handed_over(recycled.puts)
            phases_start = list(phase_seconds)
            time.sleep(seconds)
            slots_end, wall_end, cpu_end = handed_over(recycled.puts)
            spent = [end - start for end, start in zip(phase_seconds, phases_start, strict=True)]
        finally:
            channels.stop_event.set()
            actor.join()
    steps = (slots_end - slots_start) * config.unroll_length
    rate = Rate(steps, wall_end - wall_start, cpu_end - cpu_start)
    shares = phase_shares(spent)
    return {"what": f"one actor, {config.envs_per_actor} envs in {config.env_splits} split(s), {shape.model} "
                    f"policy, no learner; its time {shares['policy']:.0%} choosing actions, {shares['env']:.0%} "
                    f"its envs stepping", "batch": config.envs_per_actor // config.env_splits, "device": "cpu",
            "threads": 1, "splits": config.env_splits, "phase_shares": shares, **rate.to_dict()}


def bench_actors(config: Config, shape: EnvShape, seconds: float) -> dict[str, Any]:
    """`config.num_actors` actors at once, each `bench_actor` in a process of its own (spawned, one torch thread,
    the trainer's malloc settings), timed over the same window: each warms up, waits for the others, then runs
    `seconds`. The steps and CPU are their sums; the rate is the sum of their rates. Where the actors share
    cores, memory bandwidth or a core's hyperthreads, this is below `num_actors` times one actor alone."""
    ctx = multiprocessing.get_context("spawn")  # this process has torch's threads: no fork
    start = ctx.Barrier(config.num_actors)
    results = ctx.Queue()
    processes = [ctx.Process(target=_actor_process, args=(config, shape, seconds, index, start, results),
                             daemon=True) for index in range(config.num_actors)]
    with ctrl_c_left_to_this_process():
        for process in processes:
            process.start()
    rows: list[dict[str, Any]] = []
    try:
        while len(rows) < len(processes):
            try:
                rows.append(results.get(timeout=1.0))
            except queue.Empty:
                if dead := [p.exitcode for p in processes if p.exitcode not in (None, 0)]:  # killed, no row
                    start.abort()  # the others stop waiting for it
                    raise RuntimeError(f"an actor process of the actors component exited with {dead[0]}") from None
    except KeyboardInterrupt:
        for process in processes:
            process.kill()
        raise
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    failures = [row for row in rows if "error" in row]
    if failures:
        raise RuntimeError(f"an actor of the actors component failed:\n{failures[0]['error']}")
    steps = sum(row["steps"] for row in rows)
    rate = sum(row["steps_per_s"] for row in rows)
    shares = {name: sum(row["phase_shares"][name] for row in rows) / len(rows) for name in rows[0]["phase_shares"]}
    total = Rate(steps, steps / rate, sum(row["cpu_s"] for row in rows))
    return {"what": f"{config.num_actors} actors at once, one process each, {config.envs_per_actor} envs in "
                    f"{config.env_splits} split(s), no learner; their time {shares['policy']:.0%} choosing actions, "
                    f"{shares['env']:.0%} their envs stepping", "actors": config.num_actors,
            "batch": config.envs_per_actor // config.env_splits, "device": "cpu", "threads": 1,
            "phase_shares": shares, "per_actor_steps_per_s": [row["steps_per_s"] for row in rows],
            **total.to_dict()}


def _actor_process(config: Config, shape: EnvShape, seconds: float, index: int, start: Any, results: Any) -> None:
    """One actor of `bench_actors`: its row, or {"error": traceback} (then the others are let go)."""
    keep_freed_memory()  # as an actor process of the trainer
    try:
        results.put(bench_actor(config, shape, seconds, index, start))
    except Exception:  # noqa: BLE001 - reported by the parent, with its traceback
        start.abort()  # the others stop waiting
        results.put({"error": traceback.format_exc()})


@contextlib.contextmanager
def ctrl_c_left_to_this_process() -> Iterator[None]:
    """Processes started inside start with SIGINT blocked, and keep it blocked (the mask survives fork and exec,
    and Python leaves it as it finds it), so that Ctrl-C, which the terminal sends to the whole process group,
    interrupts this process alone, which stops them, instead of printing a traceback from each, wherever it
    lands in their start-up. Blocked here rather than ignored: a Ctrl-C that comes while they start waits, and
    interrupts this process as soon as the block ends, where an ignored one would be lost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # multiprocessing's resource tracker, started with the first child if it is not running, unblocks SIGINT
    # in this thread on its way out: so the tracker first, then the block (as `actor_pool.start_fork_server`).
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _synthetic_slots(config: Config, shape: EnvShape, model: Net) -> dict[str, torch.Tensor]:
    """B filled slots (plain tensors, not shared memory), laid out as `buffers.BufferSpec` lays them out."""
    core_shapes = model.core_state_shapes()
    spec = BufferSpec(config.batch_size, config.unroll_length, shape.observation_shape, shape.observation_dtype,
                      shape.num_actions, core_shapes)
    generator = torch.Generator().manual_seed(config.seed)
    slots = {}
    for name, (size, dtype) in spec.fields().items():
        if name == "done":
            slots[name] = torch.rand(size, generator=generator) < 0.01
        elif name == "action":
            slots[name] = torch.randint(0, shape.num_actions, size, generator=generator)
        elif name.startswith("core_state_"):
            slots[name] = torch.zeros(size)
        else:
            slots[name] = _random_tensor(size, dtype, generator)
    return slots


def _random_tensor(size: Sequence[int], dtype: torch.dtype, generator: torch.Generator | None = None
                   ) -> torch.Tensor:
    if dtype == torch.uint8:
        return torch.randint(0, 256, tuple(size), dtype=dtype, generator=generator)
    if dtype.is_floating_point:
        return torch.randn(tuple(size), generator=generator).to(dtype)
    return torch.zeros(tuple(size), dtype=dtype)


# --------------------------------------------------------------------------------- process-tree usage


@dataclass
class TreeUsage:
    """What a process tree used: `cpu_s` sums, over every process seen, the largest utime + stime read."""

    returncode: int
    wall_s: float
    cpu_s: float
    cpu_s_wait4: float  # the root's rusage at exit: itself plus the descendants it and they reaped
    peak_pss_bytes: int
    processes: int  # distinct processes seen in the tree
    monitor_cpu_s: float  # what the sampling cost this process
    cpu_s_by_depth: list[float] = field(default_factory=list)  # [root, its children, grandchildren, ...]


def _proc_stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, utime + stime in clock ticks, state) of `pid`, or None once it is gone."""
    try:  # os.read: half the CPU of Path.read_text, and this runs for every process on the machine each poll
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        try:
            text = os.read(fd, 4096)
        finally:
            os.close(fd)
    except OSError:
        return None
    fields = text[text.rindex(b")") + 2:].split()  # the name in parentheses may hold spaces
    # After the name: state is field 3 of proc(5), ppid 4, utime 14, stime 15.
    return int(fields[1]), int(fields[11]) + int(fields[12]), fields[0].decode()


def _pss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _tree(root: int) -> dict[int, tuple[int, int, str]]:
    """(depth below `root`, CPU ticks, state) of `root` and all its descendants now, found by walking ppid
    links through /proc."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _proc_stat(int(entry))) is not None:
            stats[int(entry)] = stat
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = {}, [(root, 0)]
    while todo:
        pid, depth = todo.pop()
        if pid in stats:
            tree[pid] = (depth, *stats[pid][1:])
            todo += [(child, depth + 1) for child in children.get(pid, [])]
    return tree


def measure_process_tree(argv: Sequence[str], cwd: str | os.PathLike | None = None,
                         log_path: str | os.PathLike | None = None, poll_s: float = POLL_S,
                         pss_poll_s: float = PSS_POLL_S) -> TreeUsage:
    """Run `argv` to completion, sampling its process tree's CPU times from /proc every `poll_s` seconds and
    its PSS every `pss_poll_s`.

    A process's CPU after its last sample is missed (at most `poll_s` of it); `cpu_s_wait4` is exact for
    whatever was reaped inside the tree and serves as a check. Output goes to `log_path` (or nowhere).
    """
    cpu_ticks: dict[int, int] = {}
    depths: dict[int, int] = {}
    peak_pss, next_pss = 0, 0.0
    monitor_start = time.process_time()
    with open(log_path or os.devnull, "wb") as out:
        wall_start = time.perf_counter()
        process = subprocess.Popen(list(argv), cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        try:
            while True:
                tree = _tree(process.pid)
                for pid, (depth, ticks, _) in tree.items():
                    cpu_ticks[pid] = max(cpu_ticks.get(pid, 0), ticks)
                    depths.setdefault(pid, depth)
                if time.perf_counter() >= next_pss:
                    peak_pss = max(peak_pss, sum(_pss_bytes(pid) for pid in tree))
                    next_pss = time.perf_counter() + pss_poll_s
                if process.pid not in tree or tree[process.pid][2] == "Z":  # exited, its last times read
                    break
                time.sleep(poll_s)
            _, status, rusage = os.wait4(process.pid, 0)
            wall_s = time.perf_counter() - wall_start
            process.returncode = os.waitstatus_to_exitcode(status)
        finally:
            if process.returncode is None:
                process.terminate()
                process.wait()
    cpu_s_by_depth = [0.0] * (max(depths.values(), default=0) + 1)
    for pid, ticks in cpu_ticks.items():
        cpu_s_by_depth[depths[pid]] += ticks / CLOCK_TICKS_PER_S
    return TreeUsage(
        returncode=process.returncode, wall_s=wall_s, cpu_s=sum(cpu_ticks.values()) / CLOCK_TICKS_PER_S,
        cpu_s_wait4=rusage.ru_utime + rusage.ru_stime, peak_pss_bytes=peak_pss, processes=len(cpu_ticks),
        monitor_cpu_s=time.process_time() - monitor_start, cpu_s_by_depth=cpu_s_by_depth)


# -------------------------------------------------------------------------------------- end to end


def run_argv(config: Config, savedir: str, extra: Sequence[str] = ()) -> list[str]:
    """`python run.py ...` with `config`'s bench flags, except those `extra` sets, then `extra`."""
    overridden = {token[2:].split("=")[0].removeprefix("no-") for token in extra if token.startswith("--")}
    argv = [sys.executable, "run.py", "--savedir", savedir, "--xpid", "bench"]
    defaults = Config()
    argv += to_flags(config, [name for name in CONFIG_FLAGS if name not in overridden and not (
        name in CENTRAL_ONLY and getattr(config, name) == getattr(defaults, name))])  # unnamed: not said unused
    return argv + list(extra)


CENTRAL_ONLY = dict(ONLY_WITH)["--inference central"]  # flags of --inference central alone
# What `run_argv` makes each end-to-end run, which --extra and --variants may not change: a new run in a temporary
# savedir (not a saved run continued, nor one elsewhere written over).
BENCH_RUN = {"mode": "train", "savedir": "savedir", "xpid": "bench", "resume": False, "checkpoint": "latest"}


def bench_end_to_end(config: Config, extra: Sequence[str] = (), variant: str = "") -> dict[str, Any]:
    """Train for `config.total_steps` in a fresh temporary savedir; rates use the step count the run reports."""
    with tempfile.TemporaryDirectory(prefix="impala-bench-") as savedir:
        argv = run_argv(config, savedir, extra)
        log_path = Path(savedir) / "run-output.log"
        with gpu_busy(_cuda_index(select_device(config))) as busy:
            usage = measure_process_tree(argv, cwd=REPO_ROOT, log_path=log_path)
        steps = _final_step(Path(savedir) / "bench")
        logged = run_scalars(Path(savedir) / "bench")
        fell_back = fallbacks(log_path.read_text(errors="replace") if log_path.exists() else "")
        if usage.returncode != 0 or steps is None:
            tail = log_path.read_text(errors="replace").splitlines()[-20:]
            print(f"bench: end-to-end run {variant!r} exited with {usage.returncode}:\n" + "\n".join(tail),
                  file=sys.stderr)
    steps = steps or 0
    return {"variant": variant, "command": shlex.join(argv), "cwd": str(REPO_ROOT),
            "returncode": usage.returncode, "steps": steps, "wall_s": usage.wall_s, "cpu_s": usage.cpu_s,
            "cpu_s_wait4": usage.cpu_s_wait4, "cpu_s_by_depth": usage.cpu_s_by_depth, "steps_per_s": steps / usage.wall_s,
            "steps_per_cpu_s": steps / usage.cpu_s if usage.cpu_s else 0.0,
            "peak_pss_mib": usage.peak_pss_bytes / 2**20, "processes": usage.processes,
            "monitor_cpu_s": usage.monitor_cpu_s, "fallbacks": fell_back, **logged, **busy}


def fallbacks(log_text: str) -> list[str]:
    """What a run said it could not do and did otherwise ("Could not capture the update as a CUDA graph ...;
    updating without one"), each once: a row measured without what it was meant to measure says so."""
    found: list[str] = []
    for line in log_text.splitlines():
        _, mark, said = line.partition("Could not ")
        if mark and (said := mark + said) not in found:
            found.append(said)
    return found


# What the run itself logged, shown under its row: (CSV column, key in the row, how the rows combine, label,
# format). A running total is the last row's; a per-interval figure is averaged over the run; the steady rate is
# the median interval's after the first two (start-up: actors starting, the first batch), as a long run sees it.
LOGGED = (("charts/SPS", "steady_steps_per_s", "steady", "median agent steps/s per interval after the first two",
           ",.0f"),
          ("stats/policy_lag", "mean_policy_lag", "mean", "mean policy lag", ".2f"),
          ("timing/wait_batch_ms", "wait_batch_ms", "mean", "learner ms per batch waiting for it", ".1f"),
          ("timing/host_to_device_ms", "host_to_device_ms", "mean", "learner ms per batch stacking and copying it", ".1f"),
          ("timing/stack_ms", "stack_ms", "mean", "of which stacking", ".1f"),
          ("timing/forward_backward_ms", "forward_backward_ms", "mean", "learner ms per batch updating", ".1f"),
          ("timing/inference_batch_ms", "inference_batch_ms", "mean", "central inference ms per batch", ".2f"),
          ("timing/inference_forward_ms", "inference_forward_ms", "mean", "of which the forward", ".2f"),
          ("timing/inference_slots_ms", "inference_slots_ms", "mean", "the slots' gather and writes", ".2f"),
          ("stats/inference_actors_per_batch", "inference_actors_per_batch", "mean", "actors per batch", ".1f"),
          ("stats/inference_busy_share", "inference_busy_share", "mean", "its thread's time serving", ".0%"),
          ("actors/slot_wait_share", "actor_slot_wait_share", "mean", "actors' time waiting for slots", ".0%"),
          ("actors/policy_share", "actor_policy_share", "mean", "actors' time choosing actions", ".0%"),
          ("actors/env_share", "actor_env_share", "mean", "actors' time stepping envs", ".0%"),
          ("actors/write_share", "actor_write_share", "mean", "actors' time writing slots", ".0%"),
          ("ray/bytes_per_step", "ray_bytes_per_step", "last", "Ray bytes per agent step", ",.0f"),
          ("ray/receive_ms_per_unroll", "ray_receive_ms_per_unroll", "last", "receiver ms per unroll", ".3f"))


def run_scalars(run_dir: Path) -> dict[str, float]:
    """What a run logged in its logs.csv (`LOGGED`): its median agent steps/s per interval after the first two, the
    means over its intervals of the policy lag, the learner's time per update and the actors' shares of time, and
    with --ray the bytes per agent step and the receiver's ms per unroll (running totals: the last row's); what is
    missing is left out."""
    try:
        with open(run_dir / "logs.csv", newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return {}
    found: dict[str, float] = {}
    for column, key, combine, _, _ in LOGGED:
        values = [float(row[column]) for row in rows if row.get(column)]
        if not values:
            continue
        if combine == "mean":
            found[key] = sum(values) / len(values)
        elif combine == "steady":
            found[key] = statistics.median(values[2:] or values)
        else:
            found[key] = values[-1]
    return found


def _final_step(run_dir: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, KeyError):
        return int(json.loads((run_dir / "meta.json").read_text())["final_step"])
    with contextlib.suppress(Exception):  # no meta.json: the checkpoint, if one was written
        return int(load_checkpoint(run_dir / CHECKPOINT_NAME, mmap=True)["step"])
    return None


# ------------------------------------------------------------------------------------------- ceiling


def ceiling(components: dict[str, dict[str, Any]], cores: int) -> dict[str, Any]:
    """CPU per agent step = the sum of each stage's CPU per step; the ceiling is its inverse (x cores)."""
    cpu_s_per_step = sum(1.0 / components[name]["steps_per_cpu_s"] for name in ("env", "inference", "learner"))
    per_cpu_s = 1.0 / cpu_s_per_step
    result = {"cpu_ms_per_step": 1000.0 * cpu_s_per_step, "steps_per_cpu_s": per_cpu_s, "cores": cores,
              "steps_per_s": per_cpu_s * cores}
    if components["learner"].get("cpu_is_host_only") or components["inference"]["device"] != "cpu":
        result["note"] = ("the GPU's own time is not in this ceiling: work on the GPU counts only its host CPU; "
                          f"the learner alone runs at {components['learner']['steps_per_s']:.0f} steps/s")
    return result


def env_ceiling(components: dict[str, dict[str, Any]], cores: int) -> float | None:
    """Agent steps/s of every usable core stepping envs and nothing else: what no trainer on this machine
    passes, and what one with its learner and inference on a GPU approaches."""
    return components["env"]["steps_per_cpu_s"] * cores if "env" in components else None


def add_fractions(row: dict[str, Any], limit: dict[str, Any] | None, env_limit: float | None = None,
                  actors_alone: float | None = None) -> dict[str, Any]:
    """A row's shares of the ceiling, of the env-only ceiling, and of what its actors step alone together
    (`actors_alone`, the actors component's steps/s)."""
    if limit is not None:
        row["fraction_of_ceiling_cpu"] = row["steps_per_cpu_s"] / limit["steps_per_cpu_s"]
        row["fraction_of_ceiling_wall"] = row["steps_per_s"] / limit["steps_per_s"]
    if env_limit:
        row["fraction_of_env_ceiling"] = row["steps_per_s"] / env_limit
    if actors_alone:
        row["fraction_of_actors_alone"] = row["steps_per_s"] / actors_alone
        if "steady_steps_per_s" in row:
            row["steady_fraction_of_actors_alone"] = row["steady_steps_per_s"] / actors_alone
    return row


def row_summary(row: dict[str, Any]) -> str:
    """One end-to-end row in a line: its steps, wall time and rates (and its steady rate, where the run logged one),
    and its share of what its actors step alone."""
    steady = (f" ({row['steady_steps_per_s']:,.0f} per interval after the first two)"
              if "steady_steps_per_s" in row else "")
    text = (f"{row.get('steps', 0):,} steps in {row.get('wall_s', 0.0):.1f} s, {row['steps_per_s']:,.0f} steps/s{steady}, "
            f"{row['steps_per_cpu_s']:,.0f} steps/CPU-s")
    if "fraction_of_actors_alone" in row:
        text += f", {row['fraction_of_actors_alone']:.0%} of its actors alone"
        if "steady_fraction_of_actors_alone" in row:
            text += f" ({row['steady_fraction_of_actors_alone']:.0%} after the first two intervals)"
    return text if row["returncode"] == 0 else f"{text}; exited with {row['returncode']}"


# --------------------------------------------------------------------------------------- the machine


def machine() -> dict[str, Any]:
    model_name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
                break
    cuda = torch.cuda.is_available()
    usable = os.sched_getaffinity(0)
    return {"cpu": model_name, "cores_usable": len(usable), "physical_cores_usable": physical_cores(usable),
            "cpu_count": os.cpu_count(), "cpu_quota": cpu_quota(),
            "torch": torch.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA device)",
            "cpu_bf16_by_default": bool(use_amp(None, torch.device("cpu"), "shallow")),
            "hostname": platform.node()}


def physical_cores(cpus: set[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> int | None:
    """How many physical cores the logical CPUs `cpus` are (hyperthreads of one core count once), from the
    kernel's topology; None where it is not readable."""
    cores = set()
    try:
        for cpu in cpus:
            topology = sysfs / f"cpu{cpu}" / "topology"
            cores.add(((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()))
    except OSError:
        return None
    return len(cores)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ------------------------------------------------------------------------------------------- output


def format_table(results: dict[str, Any]) -> str:
    m, lines = results["machine"], []
    physical = m.get("physical_cores_usable")
    threads = f" ({physical} physical)" if physical and physical != m["cores_usable"] else ""
    quota = m.get("cpu_quota")
    if quota is not None and quota < m["cores_usable"]:
        threads += f", a cgroup CPU quota of {quota:.3g} cores' worth"
    lines.append(f"machine: {m['cpu']}, {m['cores_usable']} usable cores{threads}, torch {m['torch']}, {m['device']}")
    load = results["load_average_start"]
    lines.append(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
                 + ("  (busy machine: wall-clock rates are provisional)" if results["wall_provisional"] else ""))
    components = results["components"]
    if components:
        lines += ["", f"{'component':<10} {'steps/s':>10} {'steps/CPU-s':>12} {'CPU ms/step':>12}  what"]
        for name, c in components.items():
            detail = c["what"] + (f", {c['threads']} thread(s)" if "threads" in c else "")
            detail += (", bf16 autocast" if c.get("amp") else "") + (", host CPU only" if c.get("cpu_is_host_only")
                                                                     else "")
            detail += f", GPU busy {c['gpu_busy']:.0%}" if "gpu_busy" in c else ""
            if "median_ms_per_batch" in c:
                detail += "; ms per batch: " + ", ".join(f"{name} {ms:.1f}" for name, ms in c["median_ms_per_batch"].items())
            if "operations_per_gradient_step" in c:
                detail += f"; {c['operations_per_gradient_step']:.0f} operations per gradient step (eager)"
            lines.append(f"{name:<10} {c['steps_per_s']:>10.0f} {c['steps_per_cpu_s']:>12.0f} "
                         f"{c['cpu_ms_per_step']:>12.3f}  {detail}")
    if (limit := results["ceiling"]) is not None:
        lines.append(f"{'ceiling':<10} {limit['steps_per_s']:>10.0f} {limit['steps_per_cpu_s']:>12.0f} "
                     f"{limit['cpu_ms_per_step']:>12.3f}  sum of the three per step; x {limit['cores']} cores")
        if "note" in limit:
            lines.append(f"           note: {limit['note']}")
    rows = results["end_to_end"]
    if rows:
        names = [(r["variant"] or "(base flags)") + ("" if r["returncode"] == 0 else f" [exit {r['returncode']}]")
                 for r in rows]
        width = max(len("end to end"), *(len(name) for name in names))
        header = (f"{'end to end':<{width}} {'steps':>8} {'wall s':>7} {'steps/s':>8} {'CPU s':>7} "
                  f"{'steps/CPU-s':>11} {'PSS MiB':>8} {'of ceiling CPU/wall':>20}")
        lines += ["", header]
        for name, r in zip(names, rows):
            fraction = (f"{r['fraction_of_ceiling_cpu']:>9.0%} / {r['fraction_of_ceiling_wall']:>4.0%}"
                        if "fraction_of_ceiling_cpu" in r else "")
            lines.append(f"{name:<{width}} {r['steps']:>8} {r['wall_s']:>7.1f} {r['steps_per_s']:>8.0f} "
                         f"{r['cpu_s']:>7.1f} {r['steps_per_cpu_s']:>11.0f} {r['peak_pss_mib']:>8.0f} {fraction:>20}")
        for r in rows:
            by_depth = ", ".join(f"{cpu_s:.1f}" for cpu_s in r["cpu_s_by_depth"])
            lines.append(f"{r['variant'] or '(base flags)'}: CPU s by depth in the tree [{by_depth}] (run.py, its "
                         f"children, grandchildren = actors), the bench's polling {r['monitor_cpu_s']:.1f}")
            logged = [f"{label} {r[key]:{spec}}" for _, key, _, label, spec in LOGGED if key in r]
            shares = [f"GPU busy {r['gpu_busy']:.0%}"] if "gpu_busy" in r else []
            if "fraction_of_env_ceiling" in r:
                shares.append(f"{r['fraction_of_env_ceiling']:.0%} of the env-only ceiling "
                              f"({results['env_ceiling_steps_per_s']:.0f} steps/s)")
            if "fraction_of_actors_alone" in r:
                actors = results["components"]["actors"]
                steady = (f" ({r['steady_fraction_of_actors_alone']:.0%} in its intervals after the first two)"
                          if "steady_fraction_of_actors_alone" in r else "")
                shares.append(f"{r['fraction_of_actors_alone']:.0%}{steady} of what {actors['actors']} actors step "
                              f"alone together ({actors['steps_per_s']:.0f} steps/s)")
            if shares:
                lines.append(f"  {', '.join(shares)}")
            if logged:
                lines.append(f"  logged by the run: {', '.join(logged)}")
            lines += [f"  the run fell back: {said}" for said in r.get("fallbacks", ())]
            lines.append(f"  command: (cd {r['cwd']} && {r['command']})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- the CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m impala.bench", formatter_class=DefaultsHelpFormatter,
        description="Measure env, inference and learner throughput alone, the trainer end to end, and the "
                    "ceiling the parts imply, per wall second and per CPU-second.")
    add_flags(parser, CONFIG_FLAGS, BENCH_DEFAULTS)  # the trainer's flags that the bench passes on
    parser.add_argument("--only", default=",".join(COMPONENTS),
                        help=f"comma-separated subset of {','.join(COMPONENTS)}")
    parser.add_argument("--seconds", type=float, default=5.0, help="timed seconds per micro-benchmark")
    parser.add_argument("--extra", default="", help="extra flags for every end-to-end run.py, one quoted string; "
                        "a single flag as --extra=--no-amp")
    parser.add_argument("--variants", nargs="+", default=None, metavar="FLAGS",
                        help="one end-to-end run per quoted string of run.py flags (after --extra, replacing the "
                        "base flags they name); a single flag needs a leading space: ' --no-amp'; '' for the base")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON here")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Config, list[str]]:
    parser = build_parser()
    parser.__class__ = OneLineErrorParser  # a mistyped flag is one line, as in run.py
    args = parser.parse_args(argv)
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(only) - set(COMPONENTS))
    if not only:
        raise UserError(f"--only {args.only!r} names no component; choose from {','.join(COMPONENTS)}")
    if unknown:
        raise UserError(f"--only {args.only!r}: unknown {', '.join(unknown)}; choose from {','.join(COMPONENTS)}")
    if distributed.launched_by_torchrun() and only != ["learner"]:  # every rank would run each: e2e runs would join
        raise UserError(f"--only {args.only!r} under torchrun: only the learner is measured on several ranks "  # as one
                        "(--only learner); run the other components without torchrun")
    if not 0 < args.seconds < math.inf:
        raise UserError(f"--seconds must be > 0 and finite, got {args.seconds}")
    for name, text in [("--extra", args.extra)] + [("--variants", v) for v in args.variants or []]:
        try:
            shlex.split(text)
        except ValueError as exc:
            raise UserError(f"{name} {text!r}: {exc}") from None
    if args.json == "":  # `--json "$OUT"` with OUT unset
        raise UserError("--json is empty (an unset shell variable?); pass a path, or leave the flag out")
    if args.json and (problem := path_problem(args.json)):
        raise UserError(f"--json {args.json}: {problem}")
    json_path = Path(args.json).expanduser().resolve() if args.json else None
    if json_path is not None and json_path.is_dir():
        raise UserError(f"--json {args.json} is a directory; name a file in it")
    if json_path is not None and json_path.suffix.lower() != ".json" and os.path.lexists(json_path):
        raise UserError(f"--json {args.json}: a file of that name is there, and the results would replace it; name "
                        "a new file, or one ending in .json")
    if json_path is not None and (not json_path.parent.is_dir() or not os.access(json_path.parent, os.W_OK)):
        raise UserError(f"--json {args.json}: its directory does not exist or cannot be written")
    config = Config(**{name: getattr(args, name) for name in CONFIG_FLAGS})
    if problems := config.validate():
        raise UserError("; ".join(problems))
    if config.compile and "learner" in only:
        learner.check_compiler(select_device(config))
    if "e2e" in only:  # each run's flags checked as run.py checks them, before the first run rather than in its row
        extra = shlex.split(args.extra)
        for name, text, flags in [("--extra", args.extra, extra)] + [
                ("--variants", variant, extra + shlex.split(variant)) for variant in args.variants or []]:
            try:
                run_config = parse_config(run_argv(config, "savedir", flags)[2:])
                owned = [flag for flag, value in BENCH_RUN.items() if getattr(run_config, flag) != value]
                if owned := ["mode"] if "mode" in owned else owned:  # plot mode's --xpid: runs to plot
                    raise UserError(f"the bench trains a new run of its own, in a temporary directory: leave out "
                                    f"{', '.join('--' + flag for flag in owned)}")
                if run_config.env != config.env or run_config.model != config.model:
                    env_shape(run_config)  # the env and model the run would probe first, checked here
            except UserError as exc:
                raise UserError(f"{name} {text!r}: {exc}") from None
    return args, config, only


def run_bench(args: argparse.Namespace, config: Config, only: Sequence[str]) -> dict[str, Any]:
    keep_freed_memory()  # as the trainer and its actors do, so that the components allocate as they would there
    results: dict[str, Any] = {"machine": machine(), "load_average_start": load_average()}
    results["wall_provisional"] = results["load_average_start"][0] > PROVISIONAL_LOAD
    results["config"] = {name: getattr(config, name) for name in CONFIG_FLAGS}
    results["seconds"] = args.seconds
    components: dict[str, dict[str, Any]] = {}
    if {"env", "inference", "learner", "actor", "actors"} & set(only):
        shape = env_shape(config)
        results["config"]["model_resolved"] = shape.model
        for name, bench in (("env", lambda: bench_env(config, args.seconds)),
                            ("inference", lambda: bench_inference(config, shape, args.seconds)),
                            ("learner", lambda: bench_learner(config, shape, args.seconds)),
                            ("actor", lambda: bench_actor(config, shape, args.seconds)),
                            ("actors", lambda: bench_actors(config, shape, args.seconds))):
            if name in only:
                components[name] = bench()
                print(f"bench: {name}: {components[name]['steps_per_s']:.0f} steps/s, "
                      f"{components[name]['steps_per_cpu_s']:.0f} steps/CPU-s", file=sys.stderr)
    results["components"] = components
    has_all = all(name in components for name in ("env", "inference", "learner"))
    cores = usable_cores()  # the affinity's cores, fewer under a cgroup quota: what the trainer's --num_actors auto uses
    limit = ceiling(components, cores) if has_all else None
    results["ceiling"] = limit
    results["env_ceiling_steps_per_s"] = env_limit = env_ceiling(components, cores)
    rows = []
    if "e2e" in only:
        extra = shlex.split(args.extra)
        for variant in args.variants or [""]:  # one row per variant: the loop a sweep builds on
            name = variant.strip() or "(base flags)"
            print(f"bench: end to end {name}: {config.total_steps} steps ...", file=sys.stderr)
            rows.append(add_fractions(bench_end_to_end(config, extra + shlex.split(variant), variant.strip()),
                                      limit, env_limit, components.get("actors", {}).get("steps_per_s")))
            print(f"bench: end to end {name}: {row_summary(rows[-1])}", file=sys.stderr)  # kept if a later row is cut off
    results["end_to_end"] = rows
    results["load_average_end"] = load_average()
    return results


def main(argv: Sequence[str] | None = None) -> int:
    with sigterm_as_ctrl_c():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    try:
        args, config, only = parse_args(argv)
        reports = env_int("RANK", 0) == 0  # under torchrun rank 0 reports for all
        results = run_bench(args, config, only)
    except UserError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the results so far went to stderr as they came
        terminated = isinstance(exc, Terminated)
        print("bench: stopped by SIGTERM" if terminated else "bench: interrupted", file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
    if not reports:
        return 0
    print(format_table(results))
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        try:
            Path(args.json).expanduser().write_text(text + "\n")
        except OSError as exc:
            print(f"bench: error: cannot write {args.json}: {exc.strerror or exc} (the results are above)", file=sys.stderr)
            return 1
    return 0 if all(row["returncode"] == 0 for row in results["end_to_end"]) else 1


if __name__ == "__main__":
    sys.exit(main())
