"""One learner update: stage a batch of slots, then passes of minibatch gradient steps (V-trace targets, the
PPO or IMPALA loss, clipping, Adam or RMSprop), eagerly or replayed as one CUDA graph (`GraphedUpdate`).

Nothing here starts a thread or touches a queue: `learners.py` calls these from its learner threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import sysconfig
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NoReturn, Protocol

import torch

from impala import cudagraphs, losses, vtrace
from impala.buffers import Buffers
from impala.checkpoint import eval_seeds_used
from impala.config import Config, UserError, first_line
from impala.model import CoreState, Net
from impala.seeding import ActorLives

log = logging.getLogger("impala")


class GradientReducer(Protocol):
    """What an update needs from several learner processes (`distributed.GradientReducer` under torchrun):
    handed in by the caller, so this module knows nothing of how the processes talk."""

    def reduce(self, model: Net, loss: torch.Tensor) -> None:
        """Replace every rank's gradients in `model` by those of the batches of all ranks."""
        ...

    def moments(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and standard deviation of `values` over the batches of all ranks."""
        ...

Moments = tuple[torch.Tensor, torch.Tensor]  # a mean and a standard deviation

# The fields the learner reads, time-major in a batch: [T + 1, B, ...].
BATCH_KEYS = ("obs", "done", "reward", "truncated", "truncation_value", "action", "policy_logits")


class BatchStaging:
    """How one learner thread puts B slots on its device as one time-major batch [T + 1, B, ...].

    `fill` stacks the slots' fields into reusable host tensors (pinned for CUDA), `to` copies them to the device
    at once. On a GPU whose slots' observations are page-locked in place (`buffers.pin_observations`), those,
    nearly all of a batch's bytes, are not stacked: `to` copies each slot's frames straight from shared memory
    to the device and returns once the GPU has read them. Either way the slots may go back to the actors as soon
    as `to` returns.
    """

    def __init__(self, buffers: Buffers, batch_size: int, pin: bool) -> None:
        self.direct = ("obs",) if pin and buffers["obs"].is_pinned() else ()  # copied straight from the slots
        self.tensors = {}
        for key in BATCH_KEYS:
            if key in self.direct:
                continue
            per_slot = buffers[key].shape[1:]  # [T + 1, ...]
            shape = (per_slot[0], batch_size, *per_slot[1:])
            tensor = torch.empty(shape, dtype=buffers[key].dtype)
            self.tensors[key] = tensor.pin_memory() if pin else tensor
        self._core_keys = [f"core_state_{i}" for i in range(sum(k.startswith("core_state_") for k in buffers))]
        self.core_state = [torch.empty((buffers[k].shape[1], batch_size, buffers[k].shape[2]))
                           for k in self._core_keys]
        if pin:
            self.core_state = [s.pin_memory() for s in self.core_state]
        self._copied: torch.cuda.Event | None = None  # the last copy to a GPU, which reads these tensors
        self._buffers = buffers
        self._slots: list[int] = []  # those of the last `fill`

    def fill(self, slots: Sequence[int]) -> None:
        """Stack `slots` of the buffers into the host tensors (every field but those `to` copies straight from them).
        Waits first for the previous asynchronous copy to a GPU to have read these tensors, if it has not yet."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        for key, out in self.tensors.items():
            torch.stack([self._buffers[key][i] for i in slots], dim=1, out=out)
        for key, out in zip(self._core_keys, self.core_state, strict=True):
            torch.stack([self._buffers[key][s] for s in slots], dim=1, out=out)
        self._slots = list(slots)

    def to(self, device: torch.device) -> tuple[dict[str, torch.Tensor], CoreState]:
        """The batch of the last `fill` on `device`. To a GPU asynchronously, from pinned memory: the host goes on
        at once, or, when fields are copied straight from the slots, once the GPU has read them. A GPU wait here
        sleeps (a blocking event) rather than spin a core that an actor could use."""
        non_blocking = device.type == "cuda"
        staged = {key: value.to(device, non_blocking=non_blocking) for key, value in self.tensors.items()}
        for key in self.direct:
            staged[key] = gather_slots(self._buffers[key], self._slots, device)
        core_state = tuple(s.to(device, non_blocking=non_blocking) for s in self.core_state)
        if non_blocking:
            self._copied = torch.cuda.Event(blocking=True)
            self._copied.record(torch.cuda.current_stream(device))
            if self.direct:  # the slots themselves are being read
                self._copied.synchronize()
                self._copied = None
        return {key: staged[key] for key in BATCH_KEYS}, core_state


def gather_slots(source: torch.Tensor, slots: Sequence[int], device: torch.device) -> torch.Tensor:
    """`source[slots]` time-major, [T + 1, B, ...], on `device`: copied slot by slot (a slot's rows lie together
    in memory, a batch's do not), asynchronously where `source` is pinned, then turned time-major on the device."""
    by_slot = torch.empty((len(slots), *source.shape[1:]), dtype=source.dtype, device=device)
    for i, slot in enumerate(slots):
        by_slot[i].copy_(source[slot], non_blocking=True)
    return by_slot.transpose(0, 1).contiguous()


def compute_loss(model: Net, batch: dict[str, torch.Tensor], core_state: CoreState, config: Config,
                 reducer: GradientReducer | None = None, advantage_moments: Moments | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The IMPALA loss of one batch ([T + 1, B, ...], see `buffers.py` for the row alignment), as staged or as
    `vtrace_inputs` gives it (an update calls that once for all its gradient steps). PPO normalises its
    advantages with `advantage_moments` (mean, deviation) where given (`--advantage_norm batch`), else with their
    own, over the batches of all learner processes with `reducer`."""
    batch = vtrace_inputs(batch, config)
    output, _ = model(batch["obs"], batch["done"], core_state)
    # Rows 0..T-1, whose actions are learned from (row T's obs only bootstraps the value): sliced once, one
    # gradient to pad back in the backward pass.
    logits = output.policy_logits[:-1].float()
    values = output.baseline.float()
    returns = _vtrace(logits, values, batch, config)
    if config.policy_loss == "ppo":
        advantages = returns.advantages
        if advantage_moments is None and reducer is not None:
            advantage_moments = reducer.moments(advantages)
        pg_loss, clip_fraction = losses.ppo_loss(returns.log_rhos, advantages, config.ppo_clip, config.ppo_dual_clip,
                                                 moments=advantage_moments)
        baseline_loss = config.baseline_cost * losses.baseline_loss(returns.vs, values[:-1]) / returns.vs.numel()
        entropy_loss = config.entropy_cost * losses.entropy_loss(logits) / returns.vs.numel()
    else:
        pg_loss = losses.policy_gradient_loss(logits, batch["action"][:-1], returns.pg_advantages)
        clip_fraction = torch.zeros((), device=logits.device)
        baseline_loss = config.baseline_cost * losses.baseline_loss(returns.vs, values[:-1])
        entropy_loss = config.entropy_cost * losses.entropy_loss(logits)
    return _total_and_stats(pg_loss, baseline_loss, entropy_loss, returns.log_rhos, clip_fraction)


def _total_and_stats(pg_loss: torch.Tensor, baseline_loss: torch.Tensor, entropy_loss: torch.Tensor,
                     log_rhos: torch.Tensor, clip_fraction: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss to differentiate, the sum of the three, and the stats a gradient step reports."""
    total_loss = pg_loss + baseline_loss + entropy_loss
    rhos = log_rhos.detach().exp()
    stats = {
        "total_loss": total_loss.detach(),
        "pg_loss": pg_loss.detach(),
        "baseline_loss": baseline_loss.detach(),
        "entropy_loss": entropy_loss.detach(),
        "rho_mean": rhos.mean(),
        "rho_clipped_fraction": (rhos > 1.0).float().mean(),
        "ppo_clip_fraction": clip_fraction,
    }
    return total_loss, stats


def vtrace_inputs(batch: dict[str, torch.Tensor], config: Config) -> dict[str, torch.Tensor]:
    """A staged batch ([T + 1, B, ...]) as the loss takes it: its `obs`, `done` and `action` as they are, and, [T, B],
    what V-trace needs of it that no weights change: the `rewards` of its T steps (clipped, a time limit's bootstrap
    added), their `discounts` (0 at an episode end) and the `behaviour_log_probs` of the actions taken. An update
    computes them once for the whole batch, not once per gradient step: on a GPU, some ten fewer kernels a step.
    A batch already through it comes back as it is."""
    if "discounts" in batch:
        return batch
    # Action t was chosen at obs t and produced reward t + 1 and done t + 1.
    rewards = batch["reward"][1:]
    if config.reward_clipping == "abs_one":
        rewards = rewards.clamp(-1, 1)
    # A time limit cut the episode: the trace stops there (done), but the state it stopped in still had a
    # value, which the actor computed; added unclipped, it is the bootstrap of that episode.
    rewards = torch.where(batch["truncated"][1:], rewards + config.discounting * batch["truncation_value"][1:], rewards)
    return {
        "obs": batch["obs"],
        "done": batch["done"],
        "action": batch["action"],
        "rewards": rewards,
        "discounts": (~batch["done"][1:]).float() * config.discounting,
        "behaviour_log_probs": vtrace.action_log_probs(batch["policy_logits"][:-1], batch["action"][:-1]),
    }


def _vtrace(logits: torch.Tensor, values: torch.Tensor, batch: dict[str, torch.Tensor], config: Config
            ) -> vtrace.VTraceFromLogitsReturns:
    """The V-trace returns of a `vtrace_inputs` batch under the policy of `logits` (rows 0..T-1, [T, B, A]) and the
    values of `values` ([T + 1, B])."""
    return vtrace.from_action_log_probs(
        behaviour_action_log_probs=batch["behaviour_log_probs"],
        target_action_log_probs=vtrace.action_log_probs(logits, batch["action"][:-1]),
        discounts=batch["discounts"],
        rewards=batch["rewards"],
        values=values[:-1],
        bootstrap_value=values[-1],  # the value of obs T, after the last action
        lambda_=config.vtrace_lambda,
    )


@torch.no_grad()
def batch_advantage_moments(model: Net, batch: dict[str, torch.Tensor], core_state: CoreState, config: Config,
                            reducer: GradientReducer | None = None) -> Moments:
    """The mean and standard deviation of PPO's advantages over a whole batch (over the batches of all learner
    processes with `reducer`), with the model as it is: `--advantage_norm batch` normalises every minibatch's
    advantages with them. In a game whose rewards are rare, most minibatches of a few unrolls hold none, and
    normalised on their own their advantages would be value noise scaled up to the size of a real signal."""
    return _moments(_returns(model, vtrace_inputs(batch, config), core_state, config).advantages, reducer)


@torch.no_grad()
def batch_samples(model: Net, batch: dict[str, torch.Tensor], core_state: CoreState, config: Config,
                  reducer: GradientReducer | None = None) -> tuple[dict[str, torch.Tensor], Moments | None]:
    """`--minibatch_mode samples`: a batch's T x B steps as single samples ([T x B, ...]: frames, action, its
    log-probability under the behaviour policy, V-trace target `vs` and PPO advantage), the targets and advantages
    from one forward with the model as it is, held for every pass of the update as CleanRL's PPO holds its GAE. With
    `--advantage_norm batch` also their mean and deviation over the batch (over all learner processes' with
    `reducer`), else None."""
    batch = vtrace_inputs(batch, config)
    returns = _returns(model, batch, core_state, config)
    samples = {"obs": batch["obs"][:-1], "action": batch["action"][:-1],
               "behaviour_log_probs": batch["behaviour_log_probs"], "vs": returns.vs, "advantage": returns.advantages}
    moments = _moments(returns.advantages, reducer) if config.advantage_norm == "batch" else None
    return {name: value.flatten(0, 1) for name, value in samples.items()}, moments


def _returns(model: Net, batch: dict[str, torch.Tensor], core_state: CoreState, config: Config
             ) -> vtrace.VTraceFromLogitsReturns:
    """The V-trace returns of a `vtrace_inputs` batch under `model` as it is."""
    output, _ = model(batch["obs"], batch["done"], core_state)
    return _vtrace(output.policy_logits[:-1].float(), output.baseline.float(), batch, config)


def _moments(advantages: torch.Tensor, reducer: GradientReducer | None) -> Moments:
    """The mean and standard deviation of `advantages`, over those of all learner processes with `reducer`."""
    return reducer.moments(advantages) if reducer is not None else (advantages.mean(), advantages.std())


def compute_sample_loss(model: Net, samples: dict[str, torch.Tensor], core_state: CoreState, config: Config,
                        reducer: GradientReducer | None = None, advantage_moments: Moments | None = None
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's loss on N single steps ([N, ...], `batch_samples`), whose V-trace targets and advantages were
    computed before the update: one forward of N frames, no time axis. The same losses as `compute_loss`'s
    PPO, averaged over the N steps; `core_state` is empty (no LSTM)."""
    obs = samples["obs"][None]  # [1, N, ...]: one time step of N "envs"
    output, _ = model(obs, torch.zeros(obs.shape[:2], dtype=torch.bool, device=obs.device), core_state)
    logits = output.policy_logits[0].float()
    values = output.baseline[0].float()
    log_rhos = vtrace.action_log_probs(logits, samples["action"]) - samples["behaviour_log_probs"]
    advantages = samples["advantage"]
    if advantage_moments is None and reducer is not None:
        advantage_moments = reducer.moments(advantages)
    pg_loss, clip_fraction = losses.ppo_loss(log_rhos, advantages, config.ppo_clip, config.ppo_dual_clip,
                                             moments=advantage_moments)
    baseline_loss = config.baseline_cost * losses.baseline_loss(samples["vs"], values) / values.numel()
    entropy_loss = config.entropy_cost * losses.entropy_loss(logits) / values.numel()
    return _total_and_stats(pg_loss, baseline_loss, entropy_loss, log_rhos, clip_fraction)


LossFunction = Callable[[Net, dict[str, torch.Tensor], CoreState, Config, "GradientReducer | None", "Moments | None"],
                        tuple[torch.Tensor, dict[str, torch.Tensor]]]


def eager_loss(config: Config) -> LossFunction:
    """The loss of a minibatch in `--minibatch_mode`: of whole unrolls, or of single steps."""
    return compute_sample_loss if config.minibatch_mode == "samples" else compute_loss


def loss_function(config: Config, device: torch.device, world_size: int = 1) -> LossFunction:
    """The loss of `--minibatch_mode` (`eager_loss`), or with `--compile` the same code compiled as one region:
    the model's forward, V-trace and the losses, and with them their backward, each a few fused kernels instead
    of hundreds of small ones. On a GPU whose update is not already one CUDA graph (`--cuda_graph`) the region is itself
    captured as CUDA graphs (mode "reduce-overhead"), so a gradient step replays a graph forward and one
    backward. Shapes are fixed ([T + 1, minibatch]): a batch split into parts of two sizes compiles twice.
    tests/test_learner.py holds the compiled step equal to the eager one."""
    loss = eager_loss(config)
    if not config.compile:
        return loss
    graphs = compiles_cuda_graphs(config, device, world_size)
    compiled = torch.compile(loss, mode="reduce-overhead" if graphs else None, dynamic=False)
    if not graphs:
        return compiled

    def compiled_loss(model: Net, batch: dict[str, torch.Tensor], core_state: CoreState, config: Config,
                      reducer: GradientReducer | None = None, advantage_moments: Moments | None = None
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # A new gradient step: the previous step's graph outputs (loss, stats) have been used, their memory is free.
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(model, batch, core_state, config, reducer, advantage_moments)

    return compiled_loss


def check_compiler(device: torch.device) -> None:
    """`--compile` builds its kernels at the first update: on the CPU with a C++ compiler (torch's own search: $CXX
    when set at import, else g++), on a GPU with the C compiler Triton builds its launchers with ($CC, gcc or clang),
    both against Python's C headers. Where either is missing (a slim image; a compiler without python3-dev) that is
    a UserError here, before anything is written, rather than torch's traceback once the actors have started."""
    if device.type == "cuda":
        if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):
            _refuse_compile("a C compiler, which Triton builds its GPU kernels' launchers with, and none was found "
                            "(gcc or clang on PATH, or $CC)", "install one", "g++")
    else:
        from torch._inductor.cpp_builder import get_cpp_compiler
        from torch._inductor.exc import InvalidCxxCompiler

        try:
            get_cpp_compiler()
        except InvalidCxxCompiler:
            _refuse_compile("a C++ compiler, which torch.compile builds its CPU kernels with, and none was found "
                            "(g++ on PATH, or $CXX)", "install one", "g++")
    include = Path(sysconfig.get_path("include"))
    if not (include / "Python.h").is_file():
        _refuse_compile(f"Python's C headers, which its kernels are built against, and {include} has no Python.h",
                        "install them", f"python{sys.version_info.major}.{sys.version_info.minor}-dev")


def _refuse_compile(needs: str, install: str, package: str) -> NoReturn:
    raise UserError(f"--compile needs {needs}: {install} (on Debian or Ubuntu: apt install {package}), or leave out "
                    "--compile")


def compiles_cuda_graphs(config: Config, device: torch.device, world_size: int = 1) -> bool:
    """Whether `loss_function` compiles the loss as CUDA graphs of torch.compile's own (`--compile` on a GPU whose
    update is not one graph of ours). Central inference then serves without graphs: torch.compile's captures
    neither take `cudagraphs.CAPTURE_LOCK` nor leave alone the matrix multiplications' workspaces that another
    graph was captured with (it clears every thread's, and their memory may go to other tensors)."""
    return config.compile and device.type == "cuda" and not uses_cuda_graph(config, device, world_size)


def make_optimizer(model: Net, config: Config, world_size: int = 1
                   ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """RMSprop or Adam and the `--lr_schedule` (`world_size` learner processes each add `steps_per_update`
    agent steps per update)."""
    if config.optimizer == "adam":
        # Fused: one kernel per step, which also skips a non-finite step on the device (`_step`).
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=config.learning_rate,
                                                            eps=config.epsilon, fused=True)
    else:
        optimizer = torch.optim.RMSprop(model.parameters(), lr=config.learning_rate, alpha=config.alpha,
                                        momentum=config.momentum, eps=config.epsilon)
    return optimizer, make_schedule(optimizer, config, world_size=world_size)


def make_schedule(optimizer: torch.optim.Optimizer, config: Config, start_step: int = 0, world_size: int = 1
                  ) -> torch.optim.lr_scheduler.LRScheduler:
    """`--learning_rate`, constant or (`--lr_schedule linear`) decayed linearly to 0 at `--total_steps` agent
    steps, from agent step `start_step` on.

    A function of agent steps, not of updates, and of the flags given now: a run resumed with another
    T, B, --learning_rate, --lr_schedule or --total_steps follows the schedule those flags give at its step.
    """
    for group in optimizer.param_groups:  # a loaded optimizer state brings the previous session's settings
        group["lr"] = group["initial_lr"] = config.learning_rate
        group["eps"] = config.epsilon
        if isinstance(optimizer, torch.optim.RMSprop):
            group["alpha"], group["momentum"] = config.alpha, config.momentum
            for param in group["params"]:  # momentum turned on by a resume: a buffer, as RMSprop's first step makes
                state = optimizer.state.get(param, {})
                if state and config.momentum > 0 and "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if isinstance(optimizer, torch.optim.Adam):  # a checkpoint from before fused Adam: its steps on the CPU
            group["fused"], group["foreach"] = True, None
            group["capturable"] = False  # a checkpoint of a --cuda_graph run: set again where it is captured
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                if "step" in state:
                    state["step"] = state["step"].to(param.device, torch.float32)

    def remaining_fraction(update: int) -> float:
        if config.lr_schedule == "constant":
            return 1.0
        step = start_step + update * config.steps_per_update * world_size
        return 1.0 - min(step, config.total_steps) / config.total_steps

    return torch.optim.lr_scheduler.LambdaLR(optimizer, remaining_fraction)


def update(model: Net, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
           batch: dict[str, torch.Tensor], core_state: CoreState, config: Config, amp: bool = False,
           reducer: GradientReducer | None = None, loss_fn: LossFunction | None = None) -> dict[str, float]:
    """`--epochs` passes over the batch, each `--minibatches` gradient steps on a share of its unrolls (or steps,
    `--minibatch_mode`). With several learner processes, `reducer` makes each step's gradient that of all their
    batches. `loss_fn` is `loss_function`'s (the eager loss of the mode when None).

    A step whose loss or gradient is not finite is not applied, and `stats["skipped"]` is then 1. The schedule
    steps once per batch. Returns the stats averaged over the steps, as Python floats: the one wait for the
    device in a batch (with Adam; RMSprop waits once per step to decide whether to apply it).
    """
    units = minibatch_units(batch, config)
    orders = draw_orders(units, config, batch["obs"].device)
    names, sums = _update_steps(model, optimizer, batch, core_state, orders, config, amp, reducer,
                                loss_fn or eager_loss(config))
    return _finish_update(names, sums, gradient_steps(units, config), scheduler)


def minibatch_units(batch: dict[str, torch.Tensor], config: Config) -> int:
    """What `--minibatches` divides: the batch's B unrolls, or with `--minibatch_mode samples` its T x B steps."""
    rows, unrolls = batch["obs"].shape[:2]
    return (rows - 1) * unrolls if config.minibatch_mode == "samples" else unrolls


def draw_orders(units: int, config: Config, device: torch.device) -> torch.Tensor:
    """The unrolls (or steps, `minibatch_units`) of each of the `--epochs` passes in the order they are cut into
    minibatches, [epochs, units]: a fresh permutation per pass, drawn where it is used (no copy, no wait); one
    part needs no order."""
    if min(config.minibatches, units) == 1:
        return torch.arange(units, device=device).expand(config.epochs, units)
    return torch.stack([torch.randperm(units, device=device) for _ in range(config.epochs)])


def _update_steps(model: Net, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
                  core_state: CoreState, orders: torch.Tensor, config: Config, amp: bool,
                  reducer: GradientReducer | None, loss_fn: LossFunction, skip_all: torch.Tensor | None = None
                  ) -> tuple[list[str], torch.Tensor]:
    """Every gradient step of one update, the minibatches cut from `orders` ([epochs, units]: `minibatch_units`),
    with nothing read back: the stats' names and their sums over the steps, one tensor on the device. `skip_all`
    (a 0-d tensor, 1 or 0) skips every step on the device: `GraphedUpdate`'s warm-up, which must change nothing."""
    samples = config.minibatch_mode == "samples"
    parts = min(config.minibatches, minibatch_units(batch, config))
    device = batch["obs"].device
    cache = skip_all is None  # autocast's cache of cast weights must not outlive a CUDA graph's capture
    moments = None  # one part in one pass is the whole batch as the update starts: its own moments are the batch's
    with _autocast(device.type, amp, cache):  # as a step would compute them
        batch = vtrace_inputs(batch, config)
    if samples:  # the targets and advantages of every step, once, with the weights the update starts from
        with _autocast(device.type, amp, cache):
            batch, moments = batch_samples(model, batch, core_state, config, reducer)
    elif config.policy_loss == "ppo" and config.advantage_norm == "batch" and (parts > 1 or len(orders) > 1):
        with _autocast(device.type, amp, cache):
            moments = batch_advantage_moments(model, batch, core_state, config, reducer)
    names: list[str] = []
    sums: torch.Tensor | None = None  # the steps' stats side by side, summed as they come: two kernels a step
    for order in orders:
        for columns in torch.tensor_split(order, parts):  # near-equal parts, sizes differing by at most one
            if samples:  # steps along the first axis; no LSTM state
                part, part_state = {k: v.index_select(0, columns) for k, v in batch.items()}, core_state
            elif parts == 1:
                part, part_state = batch, core_state
            else:
                part = {k: v.index_select(1, columns) for k, v in batch.items()}
                part_state = tuple(s.index_select(1, columns) for s in core_state)
            stats = _step(model, optimizer, part, part_state, config, amp, reducer, loss_fn, moments, skip_all)
            names = list(stats)
            # A copy either way: a CUDA-graphed loss writes its outputs over at the next step.
            stacked = torch.stack(list(stats.values()))
            sums = stacked if sums is None else sums + stacked
    assert sums is not None  # every update makes at least one step
    return names, sums


def gradient_steps(units: int, config: Config) -> int:
    """The gradient steps of an update of `units` unrolls (or steps, `minibatch_units`): `--epochs` x
    `--minibatches` (at most one per unit)."""
    return config.epochs * min(config.minibatches, units)


def _finish_update(names: list[str], sums: torch.Tensor, steps: int,
                   scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, float]:
    """Read the stats' sums (the update's one wait for the device), average them, step the schedule. On a GPU
    the wait sleeps until the update is done (a blocking event) instead of spinning a core the actors could use."""
    if sums.is_cuda:
        done = torch.cuda.Event(blocking=True)
        done.record(torch.cuda.current_stream(sums.device))
        done.synchronize()
    values = {name: total / steps for name, total in zip(names, sums.tolist(), strict=True)}
    values["skipped"] = 1.0 if values["skipped"] else 0.0  # a batch with a non-finite step counts as skipped
    values["learning_rate"] = scheduled_lr(scheduler)
    with warnings.catch_warnings():  # a skipped first update steps the schedule before the optimizer: intended
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        scheduler.step()
    return values


def scheduled_lr(scheduler: torch.optim.lr_scheduler.LRScheduler) -> float:
    """The learning rate the schedule gives now (before `scheduler.step()`: the one the update just used),
    computed on the host by `make_schedule`'s LambdaLR: where
    `GraphedUpdate` made it a tensor on the device, reading it back would wait for the GPU."""
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return float(scheduler.base_lrs[0] * scheduler.lr_lambdas[0](scheduler.last_epoch))
    return float(scheduler.get_last_lr()[0])


UpdateFunction = Callable[..., dict[str, float]]  # `update`'s signature


def uses_cuda_graph(config: Config, device: torch.device, world_size: int = 1) -> bool:
    """Whether the learner's updates are CUDA graphs (`GraphedUpdate`): `--cuda_graph` on a GPU with Adam, which
    is fused and skips a non-finite step on the device (RMSprop decides on the host), in a run of one learner
    process (`world_size`: under torchrun every gradient step exchanges gradients with the other ranks)."""
    return config.cuda_graph and device.type == "cuda" and config.optimizer == "adam" and world_size == 1


def update_function(config: Config, device: torch.device, world_size: int = 1) -> UpdateFunction:
    """`update`, or a `GraphedUpdate` that replays it as one CUDA graph per batch (`uses_cuda_graph`)."""
    return GraphedUpdate() if uses_cuda_graph(config, device, world_size) else update


class GraphedUpdate:
    """`update` as one CUDA graph: every gradient step of a batch (the minibatches' gathers, forward, V-trace,
    losses, backward, clipping, fused Adam and the stats' sums) captured once, then replayed with one launch
    per batch. Eagerly, PyTorch launches a small kernel or so for each of a gradient step's operations (about 200
    for the default rule, `bench.operations_per_gradient_step`) and the host, not the GPU, sets the pace.

    Called as `update`. Each batch is copied into the graph's inputs and the minibatch orders are drawn as
    `update` draws them, so a replay computes what the eager update would, from the same random stream. The
    first call captures, and again whenever the model, optimiser or batch shapes change. Capture must change
    nothing: two warm-up passes (which make the optimiser's state and let PyTorch settle its kernels) run the
    whole update with every step skipped on the device (fused Adam's `found_inf`), so weights, moments and
    step counts stay as they were. The learning rate becomes a 0-d tensor on the device that the schedule
    fills in place. With a `reducer` (several learner processes) the update runs eagerly, and so does every
    update after a capture that failed (logged once).
    """

    def __init__(self) -> None:
        self.failed = False  # a capture failed: every update since is eager
        self._key: tuple[Any, ...] | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._batch: dict[str, torch.Tensor] = {}
        self._core_state: CoreState = ()
        self._orders = torch.empty(0)
        self._names: list[str] = []
        self._sums = torch.empty(0)
        self._skip_all = torch.empty(0)  # read by the graph at every replay: it must live as long as the graph

    def __call__(self, model: Net, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, batch: dict[str, torch.Tensor],
                 core_state: CoreState, config: Config, amp: bool = False, reducer: GradientReducer | None = None,
                 loss_fn: LossFunction | None = None) -> dict[str, float]:
        loss_fn = loss_fn or eager_loss(config)
        if reducer is not None or self.failed:
            return update(model, optimizer, scheduler, batch, core_state, config, amp, reducer, loss_fn)
        units = minibatch_units(batch, config)
        key = (id(model), id(optimizer), amp, loss_fn, tuple((k, v.shape, v.dtype) for k, v in batch.items()),
               tuple(s.shape for s in core_state))
        if key != self._key:
            try:
                self._capture(model, optimizer, batch, core_state, config, amp, loss_fn)
            # Nothing was applied: the run goes on, launching as without the flag. Out of memory too: the eager
            # update needs no graph pool, and if it does not fit either, it ends the run as `OutOfDeviceMemory`.
            except RuntimeError as exc:
                log.warning("Could not capture the update as a CUDA graph (%s); updating without one",
                            first_line(exc))
                self.failed = True
                _set_capturable(optimizer, False)
                return update(model, optimizer, scheduler, batch, core_state, config, amp, reducer, loss_fn)
            self._key = key
        for name, value in batch.items():
            self._batch[name].copy_(value)
        for static, value in zip(self._core_state, core_state, strict=True):
            static.copy_(value)
        self._orders.copy_(draw_orders(units, config, batch["obs"].device))
        assert self._graph is not None
        self._graph.replay()
        return _finish_update(self._names, self._sums, gradient_steps(units, config), scheduler)

    def _capture(self, model: Net, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
                 core_state: CoreState, config: Config, amp: bool, loss_fn: LossFunction) -> None:
        device = batch["obs"].device
        self._graph = None
        self._key = None
        self._batch = {name: value.clone() for name, value in batch.items()}
        self._core_state = tuple(s.clone() for s in core_state)
        units = minibatch_units(batch, config)
        self._orders = torch.arange(units, device=device).repeat(config.epochs, 1)  # draws nothing
        for group in optimizer.param_groups:
            if not isinstance(group["lr"], torch.Tensor):  # a float would be baked into the graph
                group["lr"] = torch.tensor(group["lr"], dtype=torch.float32, device=device)
        skip_all = self._skip_all = torch.ones((), device=device)

        def steps() -> tuple[list[str], torch.Tensor]:
            return _update_steps(model, optimizer, self._batch, self._core_state, self._orders, config, amp,
                                 None, loss_fn, skip_all)

        _set_capturable(optimizer, False)  # the warm-up runs uncaptured
        with cudagraphs.CAPTURE_LOCK:  # one capture at a time in the process: central inference captures too
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    steps()
            torch.cuda.current_stream(device).wait_stream(side)
            skip_all.zero_()  # read by the graph at every replay
            graph = torch.cuda.CUDAGraph()
            optimizer.zero_grad(set_to_none=True)  # the gradients are then allocated in the graph's memory
            _set_capturable(optimizer, True)  # Adam refuses to be captured otherwise; its fused kernel is the same
            with cudagraphs.capture(graph):
                self._names, self._sums = steps()
        self._graph = graph


def _set_capturable(optimizer: torch.optim.Optimizer, capturable: bool) -> None:
    for group in optimizer.param_groups:
        group["capturable"] = capturable


def _step(model: Net, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor], core_state: CoreState,
          config: Config, amp: bool, reducer: GradientReducer | None = None,
          loss_fn: LossFunction = compute_loss, advantage_moments: Moments | None = None,
          skip_all: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One gradient step on `batch`, skipped if its loss or gradient is not finite. Returns its stats as float32
    scalars on the device, `skipped` among them (1 when skipped).

    Fused Adam takes the decision on the device (`found_inf`, as for a gradient scaler: the kernel then leaves
    weights, moments and step count as they were), so the host never waits here; other optimisers wait for
    the device once, to decide."""
    with _autocast(batch["obs"].device.type, amp, cache=skip_all is None):
        loss, stats = loss_fn(model, batch, core_state, config, reducer, advantage_moments)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if reducer is not None:  # before clipping: every rank clips and steps with the same gradient
        reducer.reduce(model, loss)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_norm_clipping)
    stats["grad_norm"] = grad_norm.detach()
    stats = {k: v.float() for k, v in stats.items()}
    # One test of both: loss x 0 is 0 where the loss is finite and NaN where not, and adding it leaves a finite
    # gradient norm exactly as it is (a plain sum of two huge finite values could overflow).
    not_finite = (~torch.isfinite(stats["total_loss"] * 0 + stats["grad_norm"])).float()
    stats["skipped"] = not_finite
    if _skips_on_device(optimizer):
        found_inf = not_finite if skip_all is None else torch.maximum(not_finite, skip_all)
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]  # read by Adam.step, as GradScaler sets it
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
    elif not not_finite.item():
        optimizer.step()
    return stats


def _autocast(device_type: str, amp: bool, cache: bool = True) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=cache) if amp else contextlib.nullcontext()


def _skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` honours `found_inf` (fused Adam, whose kernel then changes nothing)."""
    return isinstance(optimizer, torch.optim.Adam) and all(group.get("fused") for group in optimizer.param_groups)


@dataclass
class LearnerState:
    """What a checkpoint saves and a resume restores: the learner's model, optimiser and schedule, the run's
    counters, the actor lives handed out (`seeding.ActorLives`) and the state of torch's generator that draws
    the minibatch orders (`draw_orders`), so that a resumed run cuts its batches as the uninterrupted one
    would. `state_dict()` is the checkpoint's content, bar the flags and shapes; a new counter is one name in
    COUNTERS and one field.

    Learner threads change it under the run's update lock; the monitor reads the counters without it
    (a snapshot) and takes the lock for `state_dict()`, so a checkpoint falls between two updates.
    """

    COUNTERS: ClassVar[tuple[str, ...]] = ("step", "updates", "skipped_updates", "episodes", "evaluations",
                                             "eval_seeds_used")

    model: Net  # the learner's, on its device
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    lives: ActorLives  # numbers every actor start and hands it its seeds
    step: int = 0  # agent steps learned from
    updates: int = 0  # updates made (the policy version), skipped ones included
    skipped_updates: int = 0  # updates with a non-finite gradient step (that step not applied), run-wide
    episodes: int = 0  # full games finished by the actors
    evaluations: int = 0  # evaluations asked for (--eval_interval_s), run-wide
    eval_seeds_used: int = 0  # game seeds handed to evaluations, run-wide (--eval_episodes may differ by session)
    bad_updates_in_a_row: int = 0  # the current streak of skipped updates; not saved
    world_size: int = 1  # learner processes of the run (torchrun); not saved: a run resumes on any number
    optimizer_trained_with: str = ""  # a checkpoint's other --optimizer, whose state was left: not saved

    def state_dict(self) -> dict[str, Any]:
        """Model and optimiser state copied to the CPU, the counters and the lives."""
        return {
            "model_state_dict": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
            "optimizer_state_dict": _to_cpu(self.optimizer.state_dict()),
            **self.counters(),
            ORDERS_GENERATOR: orders_generator_state(self.device),
        }

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def counters(self) -> dict[str, int]:
        """The counters and the lives: a checkpoint's, and model_best.tar's (those of the weights it evaluated)."""
        return {**{name: getattr(self, name) for name in self.COUNTERS}, **self.lives.state_dict()}

    def load_state_dict(self, state: dict[str, Any], config: Config, path: Path) -> None:
        """Continue from checkpoint `state` (read from `path`): weights, optimiser state when it has one
        of this run's --optimizer (model_best.tar has none: the optimiser starts afresh, as it does after a
        change of --optimizer), the schedule at its step, the counters.
        A state that does not fit this model is the checkpoint's fault: a UserError naming it."""
        _load(self.model, state["model_state_dict"], path)
        trained_with = state.get("flags", {}).get("optimizer", config.optimizer)
        if "optimizer_state_dict" in state and trained_with != config.optimizer:
            self.optimizer_trained_with = trained_with
        elif "optimizer_state_dict" in state:
            _check_optimizer_state(self.optimizer, state["optimizer_state_dict"], path)
            _load(self.optimizer, state["optimizer_state_dict"], path)
        try:
            for name in self.COUNTERS:
                setattr(self, name, int(state.get(name, 0)))
            self.eval_seeds_used = eval_seeds_used(state, config.eval_episodes)  # also of a checkpoint saved before
            self.lives.load_state_dict(state)
        except (TypeError, ValueError) as exc:
            raise UserError(f"checkpoint {path} has a counter that is not a whole number: {first_line(exc)[:200]}"
                            ) from None
        load_orders_generator_state(state.get(ORDERS_GENERATOR), self.device, path)
        self.scheduler = make_schedule(self.optimizer, config, start_step=self.step, world_size=self.world_size)


ORDERS_GENERATOR = "orders_generator"  # a checkpoint's key for `orders_generator_state`


def orders_generator_state(device: torch.device) -> dict[str, Any]:
    """The state of torch's default generator on `device`, from which `draw_orders` draws (the CPU's, or the
    CUDA device's), with the device type it belongs to; {} for another kind of device."""
    if device.type == "cuda":
        return {"device": "cuda", "state": torch.cuda.get_rng_state(device)}
    if device.type == "cpu":
        return {"device": "cpu", "state": torch.get_rng_state()}
    return {}


def load_orders_generator_state(saved: Any, device: torch.device, path: Path) -> None:
    """Set the generator `draw_orders` uses on `device` to `saved` (`orders_generator_state`'s). One saved on
    another kind of device (a GPU run resumed on the CPU, or the other way), or none (a checkpoint from before
    it was kept, or model_best.tar), leaves the stream this session seeded: the orders then differ from the
    uninterrupted run's, as any random draw does, and nothing else does."""
    if not isinstance(saved, dict) or saved.get("device") != device.type:
        return
    try:
        if device.type == "cuda":
            torch.cuda.set_rng_state(saved["state"], device)
        else:
            torch.set_rng_state(saved["state"])
    except (KeyError, TypeError, RuntimeError, ValueError) as exc:
        raise UserError(f"checkpoint {path} has a generator state that does not fit this run's {device.type} "
                        f"generator: {first_line(exc)[:200]}") from None


def _load(target: Any, state: dict[str, Any], path: Path) -> None:
    try:
        target.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"checkpoint {path} does not fit this run's {type(target).__name__}: "
                        f"{first_line(exc)[:300]}") from None


def _check_optimizer_state(optimizer: torch.optim.Optimizer, saved: Any, path: Path) -> None:
    """Raise UserError where `saved` (an optimiser's state_dict) holds a moment whose shape is not its parameter's:
    `Optimizer.load_state_dict` checks the groups' sizes only, and a fused step over mis-sized moments reads and
    writes past them. What else does not fit is left to `load_state_dict`, which `_load` reports."""
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        raise UserError(f"checkpoint {path} does not fit this run's {type(optimizer).__name__}: its optimiser state is "
                        "not a state_dict")
    groups = [group for group in saved.get("param_groups") or [] if isinstance(group, dict)]
    saved_ids = [i for group in groups for i in group.get("params", [])]
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    for index, parameter in zip(saved_ids, parameters, strict=False):  # unequal counts: load_state_dict says so
        moments = saved["state"].get(index)
        for name, value in (moments.items() if isinstance(moments, dict) else ()):
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != parameter.shape:
                raise UserError(f"checkpoint {path} does not fit this run's {type(optimizer).__name__}: its {name} "
                                f"of parameter {index} is {tuple(value.shape)}, the parameter {tuple(parameter.shape)}")


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
