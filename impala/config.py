"""The run's configuration: one frozen dataclass, its command line, and its validation.

Every flag is a field below with its default and a one-line description; `build_parser` turns the
fields into argparse flags, so `python run.py --help` and this file can never disagree.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn


class UserError(Exception):
    """A problem the user can fix (a flag, an env id, a path, a checkpoint).

    `run.py` prints its message as one line and exits with code 2, without a traceback.
    """


class TrainingError(RuntimeError):
    """The run stopped because of a fault in the run itself (actors crashing, numerical failure)."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, for a one-line report; its type's name where it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def say(text: str) -> None:
    """Print `text` to stdout, whose reader may have gone (`run.py --mode test ... | head -1`): then this line and
    every later one go to /dev/null, as a command's output does there, and the mode finishes its work (a video to
    write) rather than ending in a traceback."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _flag(default: Any, help: str, **argparse_kwargs: Any) -> Any:
    return field(default=default, metadata={"help": help, **argparse_kwargs})


AUTO_ACTORS = -1  # --num_actors auto, until __post_init__ puts the number in its place
CORES_KEPT = 2  # --num_actors auto leaves a core to the learner and one to the main process
EVAL_ACTIONS = ("greedy", "sampled")  # --eval_actions: each kind keeps its own best agent


def auto_num_actors(cores: int, local_ranks: int, batch_size: int, envs_per_actor: int, other_actors: int) -> int:
    """--num_actors auto: this process's share of `cores` (one of `local_ranks` learner processes on the
    machine) less CORES_KEPT and less `other_actors` acting on it too (--ray local's), but never fewer
    than it takes to fill one batch, ceil(batch_size / envs_per_actor), nor fewer than one: an invalid
    --batch_size is reported for itself, not as a number of actors the user never gave."""
    return max(cores // local_ranks - CORES_KEPT - other_actors, math.ceil(batch_size / max(envs_per_actor, 1)), 1)


def usable_cores() -> int:
    """The cores this process may use: those of its CPU affinity, fewer where its cgroups cap its CPU time
    (`cpu_quota`: `docker run --cpus 4` on a 64-core host is 4), and at least one."""
    cores = len(os.sched_getaffinity(0))
    quota = cpu_quota()
    return cores if quota is None else max(1, min(cores, int(quota)))


def cpu_quota(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPUs' worth of time this process's cgroups allow it: the smallest quota of its cgroup and of those above
    it (`docker run --cpus`, a Kubernetes CPU limit, systemd's CPUQuota), from cgroup v2's `cpu.max` or v1's
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`; None where none is set or none can be read."""
    return min(_cgroup_limits(proc_cgroup, root, _cpu_max, "cpu", ("cpu", "cpu,cpuacct", "cpuacct,cpu"), _cfs_quota),
               default=None)


def memory_limit(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The bytes of memory this process's cgroups allow it and its children: the smallest limit of its cgroup and of
    those above it (`docker run --memory`, a Kubernetes memory limit, systemd's MemoryMax), from cgroup v2's
    `memory.max` or v1's `memory.limit_in_bytes`; None where none is set or none can be read."""
    limits = _cgroup_limits(proc_cgroup, root, _memory_max, "memory", ("memory",), _memory_limit_in_bytes)
    return int(min(limits)) if limits else None


def _cgroup_limits(proc_cgroup: Path, root: Path, read_v2: Callable[[Path], float | None], controller: str,
                   v1_mounts: tuple[str, ...], read_v1: Callable[[Path], float | None]) -> list[float]:
    """The limits that `read_v2` (cgroup v2) or `read_v1` (v1's `controller`, mounted at one of `v1_mounts` under
    `root`) finds in this process's cgroup (named in `proc_cgroup`) and in those above it."""
    limits: list[float] = []
    for controllers, path in _cgroups(proc_cgroup):
        if controllers == "":  # cgroup v2: one hierarchy
            limits += _quotas_up_from(root, path, read_v2)
        elif controller in controllers.split(","):  # cgroup v1: the controller's hierarchy
            mount = next((root / name for name in v1_mounts if (root / name).is_dir()), None)
            if mount is not None:
                limits += _quotas_up_from(mount, path, read_v1)
    return limits


def own_cgroup_file(v2_name: str, v1_controller: str, v1_name: str, proc_cgroup: Path = Path("/proc/self/cgroup"),
                    root: Path = Path("/sys/fs/cgroup")) -> Path | None:
    """The file `v2_name` (cgroup v2) or `v1_name` (v1, in `v1_controller`'s hierarchy) of this process's own cgroup:
    at its path under the mount, or at the mount point where that path is not there (a container without a cgroup
    namespace sees the host's path and its own cgroup mounted, as `_quotas_up_from` takes it); None where there is
    no such file."""
    for controllers, path in _cgroups(proc_cgroup):
        if controllers == "":
            mount, name = root, v2_name
        elif v1_controller in controllers.split(","):
            mount, name = root / v1_controller, v1_name
        else:
            continue
        directory = mount / path.lstrip("/")
        candidate = (directory if directory.is_dir() else mount) / name
        if candidate.is_file():
            return candidate
    return None


def _cgroups(proc_cgroup: Path) -> list[tuple[str, str]]:
    """(controllers, path) of each hierarchy this process's cgroups are in (`proc_cgroup`: /proc/self/cgroup; "" for
    cgroup v2's controllers); none where it cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    fields = [line.split(":", 2) for line in lines]  # hierarchy id : controllers : the cgroup's path
    return [(controllers, path) for _, controllers, path in (f for f in fields if len(f) == 3)]


def _quotas_up_from(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The quotas `read` finds in the cgroup at `path` of the hierarchy mounted at `mount` and in those above it. A
    container that sees its own cgroup at the mount point (no cgroup namespace) starts from there."""
    directory = mount / path.lstrip("/")
    if not directory.is_dir():
        directory = mount
    quotas = []
    while True:
        quota = read(directory)
        if quota is not None:
            quotas.append(quota)
        if directory == mount or mount not in directory.parents:
            return quotas
        directory = directory.parent


def _cpu_max(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _cfs_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None  # -1: no quota


def _memory_max(directory: Path) -> int | None:
    try:
        text = (directory / "memory.max").read_text().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _memory_limit_in_bytes(directory: Path) -> int | None:
    try:
        limit = int((directory / "memory.limit_in_bytes").read_text())
    except (OSError, ValueError):
        return None
    return limit if 0 < limit < 2**62 else None  # no limit: the largest page count, 9223372036854771712


def _num_actors_arg(text: str) -> int:
    """--num_actors: auto, or a whole number >= 0 written as the other counts may be (4, 1e2)."""
    if text == "auto":
        return AUTO_ACTORS
    try:
        number = whole_number(text)
    except argparse.ArgumentTypeError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"takes a number >= 0 or auto, got {text!r}")
    return number


@dataclass(frozen=True)
class Config:
    # What to run.
    mode: str = _flag("train", "train, test (play episodes with a saved agent) or plot (runs' returns to PNG)",
                      choices=("train", "test", "plot"))
    env: str = _flag("PongNoFrameskip-v4", "gymnasium env id: Atari (e.g. PongNoFrameskip-v4, ALE/Breakout-v5) "
                     "or another env with discrete actions (e.g. CartPole-v1, FrozenLake-v1, MODULE:ID); test mode "
                     "without it plays the checkpoint's env")
    xpid: str | None = _flag(None, "run name; the run lives in SAVEDIR/XPID (default: ENV-date-time; under "
                             "torchrun ENV-ID of its rendezvous id); plot mode takes several", nargs="+", metavar="XPID")
    savedir: str = _flag("runs", "directory that holds one subdirectory per run")
    resume: bool = _flag(False, "continue the run XPID from its last checkpoint (same as re-running its xpid)")
    checkpoint: str = _flag("latest", "the checkpoint test mode plays, or training continues from: latest "
                            "(model.tar of the run), best (its model_best.tar, or the best of --eval_actions where it "
                            "kept both) or the PATH of a checkpoint file (into a "
                            "new --xpid too); training starts from best or PATH once, then goes on from its model.tar")
    seed: int = _flag(0, "seed for envs, weights and action sampling, in [0, 2^31); every actor life of a run "
                      "gets its own env seeds and sampling stream from it")

    # Acting.
    num_actors: int = _flag(AUTO_ACTORS, "actor processes (of each rank under torchrun); auto: the cores this "
                            "process may use (capped by a cgroup CPU quota; its share under torchrun) less "
                            f"{CORES_KEPT} (the learner and the main process) and less --ray local's actors, but at "
                            "least ceil(batch_size / envs_per_actor); the number is printed at start and kept in "
                            "flags.json",
                            type=_num_actors_arg, argparse_default="auto")
    envs_per_actor: int = _flag(8, "envs stepped together by each actor, with one batched policy forward")
    env_splits: int = _flag(1, "groups each actor steps its envs in, in turn: while one group's Atari envs step "
                               "(in ale-py's thread), the actor chooses actions for the next; pays where cores "
                               "are free (see BENCHMARKS.md)")
    num_buffers: int | None = _flag(None, "shared rollout slots (default: the fewest that cannot deadlock, envs of "
                                    "all actors + learner threads x batch_size, so that actors run at most about one "
                                    "batch ahead of a learner slower than they are, which keeps the policy lag low; "
                                    "with a GPU learner whose update is one CUDA graph, at least two unrolls of slots for "
                                    "every env, so that no actor waits for its last unroll to be taken before it "
                                    "starts the next)")
    unroll_length: int = _flag(32, "agent steps per unroll (T)")
    inference: str = _flag("actor", "where actions are computed: 'actor' (each actor, on CPU) or 'central' "
                           "(one thread in the main process batches all actors on the learner's device)",
                           choices=("actor", "central"))
    inference_wait_ms: float = _flag(0.0, "central inference: how long to wait for more actors before "
                                     "running a partial batch (0: serve whoever is ready); a batch starts sooner "
                                     "once every actor has asked, of any thread (each asks for one env split at a "
                                     "time), or waits for free slots")
    inference_threads: int = _flag(1, "central inference: threads that serve the actors, each its share of the env "
                                   "splits, with its own CUDA stream and weight copies, so that several batches run "
                                   "at once (pays where a batch waits on the GPU rather than on the host)")

    # Remote actors on a Ray cluster (impala/ray_pool.py; needs `pip install -r requirements-ray.txt`).
    ray: str | None = _flag(None, "also act on a Ray cluster: auto (the running cluster, or RAY_ADDRESS), local "
                            "(start a private Ray on this machine and stop it at the end) or HOST:PORT of a head "
                            "node; with it --num_actors may be 0 (remote actors only)")
    ray_actors: int = _flag(2, "--ray: remote actor processes, one CPU each")
    ray_envs_per_actor: int = _flag(8, "--ray: envs stepped by each remote actor")
    ray_steps_per_request: int = _flag(256, "--ray: agent steps a remote actor ships per Ray object, at least: whole "
                                       "unrolls of every env, as many of each as it takes (Ray's cost is per "
                                       "object)")
    ray_actor_resource: str | None = _flag(None, "--ray: a custom Ray resource each remote actor needs one unit of "
                                           "(e.g. actor_slot, given only to actor nodes with `ray start --resources`)")
    ray_publish_every: int = _flag(1, "--ray: put the weights in Ray's object store every K policy versions")
    ray_max_policy_lag: int = _flag(0, "--ray: drop remote unrolls acted with weights more than N versions older "
                                    "than the learner's (counted in ray/dropped_unrolls); 0 keeps every one")

    # Training and the network.
    total_steps: int = _flag(5_000_000, "agent steps to train for, of all ranks under torchrun (1 agent step = "
                             "frame skip frames on Atari)")
    batch_size: int = _flag(32, "unrolls per learner update (B); under torchrun each of G ranks takes B, and "
                            "the update is one learner's with G x B unrolls (see README)")
    num_learner_threads: int = _flag(1, "learner threads; updates are serialised, extra threads prepare batches "
                                     "(each adds about one update of policy lag when the learner is the bottleneck)")
    model: str = _flag("auto", "network: shallow (IMPALA/TorchBeast Atari net), resnet (deep IMPALA ResNet), "
                       "mlp (vector observations) or auto (shallow for images of 36x36 pixels or more, mlp "
                       "otherwise)",
                       choices=("auto", "shallow", "resnet", "mlp"))
    use_lstm: bool = _flag(False, "add an LSTM core, reset at episode ends")
    hidden_size: int = _flag(256, "width of the MLP layers and of the LSTM core")

    # The learning rule.
    entropy_cost: float = _flag(0.01, "entropy bonus weight")
    baseline_cost: float = _flag(0.5, "baseline (value) loss weight")
    discounting: float = _flag(0.99, "discount factor gamma")
    reward_clipping: str = _flag("abs_one", "reward clipping for learning: abs_one (to [-1, 1]) or none",
                                 choices=("abs_one", "none"))
    episodic_life: bool = _flag(True, "Atari: a lost life ends the episode for the learner (returns are "
                                "still reported per full game)", negatable=True)
    fire_on_life_loss: bool = _flag(True, "Atari games whose action 1 is FIRE and that have lives: press FIRE "
                                    "after every lost life, as Baselines' and TorchBeast's wrappers do (training "
                                    "and test mode)", negatable=True)

    policy_loss: str = _flag("ppo", "policy loss: impala (V-trace policy gradient, losses summed over time "
                             "and batch as in the paper) or ppo (PPO's clipped surrogate on V-trace advantages "
                             "normalised (--advantage_norm), losses averaged; Sample Factory's APPO)",
                             choices=("impala", "ppo"))
    ppo_clip: float = _flag(0.1, "ppo: clip range of the probability ratio pi/mu")
    ppo_dual_clip: float = _flag(3.0, "ppo: bound the loss of a negative advantage at this multiple of it "
                                 "(dual-clip PPO; 0 turns it off)")
    epochs: int = _flag(2, "passes over each batch of unrolls")
    minibatches: int = _flag(8, "gradient steps per pass: the batch split along its unrolls into this many "
                             "near-equal parts (one unroll each where B is smaller)")
    advantage_norm: str = _flag("minibatch", "ppo: normalise the advantages over each minibatch, or over the whole "
                                "batch (its mean and deviation from one extra forward pass without gradient per batch, "
                                "with the weights the update starts from)", choices=("minibatch", "batch"))
    minibatch_mode: str = _flag("unrolls", "ppo: what --minibatches cuts the batch into: whole unrolls, whose V-trace "
                                "targets and advantages every gradient step recomputes with the weights it has "
                                "(Sample Factory's APPO), or single steps drawn at random from the whole batch, whose "
                                "targets and advantages one forward computes per batch with the weights the update "
                                "starts from (CleanRL's PPO, with V-trace for GAE); samples needs no --use_lstm",
                                choices=("unrolls", "samples"))
    vtrace_lambda: float = _flag(0.95, "lambda of the V-trace targets (1: the paper's; lower trades variance for bias)")

    # The optimiser.
    optimizer: str = _flag("adam", "adam or rmsprop", choices=("rmsprop", "adam"))
    learning_rate: float = _flag(0.00025, "learning rate (under torchrun as for one learner with batch G x B)")
    lr_schedule: str = _flag("constant", "learning-rate schedule: constant, or linear (decayed to 0 at "
                             "total_steps, counted in agent steps)", choices=("constant", "linear"))
    alpha: float = _flag(0.99, "RMSprop smoothing constant")
    momentum: float = _flag(0.0, "RMSprop momentum")
    epsilon: float = _flag(1e-5, "optimizer epsilon (TorchBeast's RMSprop used 0.01; PyTorch's RMSprop adds it "
                           "outside the square root)")
    grad_norm_clipping: float = _flag(0.5, "global gradient-norm clipping threshold")

    # Devices and speed.
    disable_cuda: bool = _flag(False, "learn on the CPU even when a GPU is present")
    amp: bool | None = _flag(None, "bfloat16 autocast for the learner and actor inference (weights stay float32); "
                             "default: on where bfloat16 outruns float32 (recent GPUs; CPUs with AMX, and AMD's "
                             "with AVX512-BF16), --no-amp to turn it off", negatable=True)
    compile: bool = _flag(False, "torch.compile the learner's loss and its backward as one region "
                                 "(replayed as CUDA graphs on a GPU)")
    cuda_graph: bool = _flag(True, "a GPU learner with --optimizer adam replays each update (every gradient step "
                             "of a batch) as one CUDA graph instead of launching every kernel from Python, and "
                             "--inference central its forwards; --no-cuda_graph to launch them one by one",
                             negatable=True)
    pin_slots: bool = _flag(True, "a GPU learner page-locks the slots' observations in shared memory and copies each "
                            "batch's straight to the GPU, instead of stacking them on the host first; "
                            "--no-pin_slots to stack them", negatable=True)

    # Logs, checkpoints and failures.
    log_interval_s: float = _flag(5.0, "seconds between console lines and TensorBoard scalars")
    checkpoint_interval_s: float = _flag(300.0, "seconds between checkpoints (one is always written at the end)")
    keep_checkpoints: int = _flag(0, "also keep the last K checkpoints (periodic and final) beside model.tar, named "
                                  "model_step_STEP.tar; 0: only model.tar")
    max_actor_restarts: int = _flag(10, "a run stops after more than this many actor crashes within 10 minutes, or in a "
                                    "row with no update learned between them")
    actor_timeout_s: float = _flag(300.0, "an actor that makes no progress for this long (no env step, no wait "
                                          "for a slot or an action: a hung env) is killed and replaced, and so is the "
                                          "evaluator stuck in an evaluation; 0: never")
    max_bad_updates: int = _flag(20, "a run stops after this many consecutive non-finite updates")
    learner_timeout_s: float = _flag(1800.0, "a learner thread, or the central inference thread, that spends this "
                                     "long on one batch (a hung GPU or driver, a deadlock) ends the process at once, "
                                     "exit code 1, its stack in out.log and the last checkpoint kept, for a process "
                                     "manager to resume the run; 0: never")

    # Evaluation while training.
    eval_interval_s: float = _flag(0.0, "seconds between evaluations while training: a separate process plays "
                                   "--eval_episodes full games with the newest weights and model_best.tar keeps "
                                   "the best agent; 0: no evaluation (see README)")
    eval_episodes: int = _flag(10, "full-game episodes (no episodic life, unclipped returns) per evaluation")
    eval_actions: str = _flag("greedy", "actions in evaluations and test mode: greedy (the most likely) or sampled "
                              "(from the policy, as the actors act)", choices=EVAL_ACTIONS)
    eval_max_steps: int = _flag(27_000, "evaluations and test mode: a game of an env without a time limit of its "
                                "own (gymnasium's max_episode_steps) is cut after this many agent steps, as a time "
                                "limit cuts it, so that a policy that never ends a game cannot stall them; an Atari "
                                "game's own limit (27,000) is lowered to it")

    # Test and plot modes.
    test_episodes: int = _flag(10, "test mode: full-game episodes to play")
    video: bool = _flag(False, "test mode: also write the first episode (its first 2,000 agent steps at most) as "
                        "an animated GIF, and the games' mean return, to TensorBoard in SAVEDIR/XPID/test, or beside "
                        "the checkpoint file with --checkpoint PATH and no --xpid (IMAGES tab, tag test/video)")
    plot_out: str | None = _flag(None, "plot mode: the file to write, its format from its extension (.png, .svg, "
                                 ".pdf, ...; default: SAVEDIR/returns.png)")
    plot_xpids: tuple[str, ...] = _flag((), "plot mode: runs to plot (default: XPID, or every run in SAVEDIR)",
                                        nargs="*", metavar="XPID")
    plot_x: str = _flag("steps", "plot mode: x axis, agent steps or hours of training since the run's first point",
                        choices=("steps", "time"))

    def __post_init__(self) -> None:
        if self.num_actors == AUTO_ACTORS:  # resolved once, here: every reader of the config sees the number
            local_ranks = env_int("LOCAL_WORLD_SIZE", 1)  # set by torchrun
            other = self.ray_actors if self.ray == "local" else 0
            number = auto_num_actors(usable_cores(), max(local_ranks, 1), self.batch_size,
                                     self.envs_per_actor, other)
            object.__setattr__(self, "num_actors", number)

    @property
    def slots_needed(self) -> int:
        """Slots that actors and learners can hold at once; fewer would deadlock."""
        return self.num_actors * self.envs_per_actor + self.num_learner_threads * self.batch_size

    def resolved_num_buffers(self, learner_keeps_up: bool = False) -> int:
        """Slots of the local actors (none without them): --num_buffers, else `slots_needed`, and for a learner
        that keeps up with its actors (a GPU learner whose update is one CUDA graph) at least two unrolls of
        slots for every env.

        Each slot returns to one actor (`slots.py`). With `slots_needed` an actor has one unroll of slots and its
        share of a batch (14 actors of 8 envs, batch 32: 2 or 3 slots each), so after handing an unroll over it
        waits until a learner has taken that unroll into a batch and given its slots back. A learner slower than
        its actors (the CPU, an eager GPU update) takes batches as fast as it can anyway, and more slots would
        only queue unrolls and add policy lag. Where the learner keeps up, that wait is time the actors do not
        act: 14% of it in BENCHMARKS.md's measurement, where a second unroll of slots took it to 0% for 0.2-0.3
        updates more policy lag."""
        if self.num_buffers is not None:
            return self.num_buffers
        if self.num_actors == 0:
            return 0
        envs = self.num_actors * self.envs_per_actor
        return max(self.slots_needed, 2 * envs) if learner_keeps_up else self.slots_needed

    @property
    def smallest_minibatch(self) -> int:
        """Steps in the smallest of the `--minibatches` parts a batch is cut into (`learner._update_steps`)."""
        if self.minibatch_mode == "samples":
            units = self.batch_size * self.unroll_length
            return units // min(self.minibatches, units)
        return self.batch_size // min(self.minibatches, self.batch_size) * self.unroll_length

    @property
    def ray_unrolls_per_env(self) -> int:
        """Unrolls of each env in one object of a remote actor: enough for --ray_steps_per_request."""
        return max(1, -(-self.ray_steps_per_request // (self.ray_envs_per_actor * self.unroll_length)))

    @property
    def ray_unrolls_per_object(self) -> int:
        """Unrolls in one object of a remote actor: `ray_unrolls_per_env` of each of its envs."""
        return self.ray_envs_per_actor * self.ray_unrolls_per_env

    @property
    def remote_slots(self) -> int:
        """Slots the unrolls of remote actors (--ray) are copied into: one object's worth per remote actor (more
        would only wait longer, acted with older weights: the next objects are on their way meanwhile) and the
        learners' share, so they never hold them all."""
        if self.ray is None:
            return 0
        return self.ray_actors * self.ray_unrolls_per_object + self.num_learner_threads * self.batch_size

    @property
    def steps_per_update(self) -> int:
        return self.unroll_length * self.batch_size

    def validate(self) -> list[str]:
        """Every problem with these values, each with the numbers involved; empty when all is well."""
        problems = []
        for setting in dataclasses.fields(self):  # flags.json, meta.json and TensorBoard keep them as UTF-8 text
            value = getattr(self, setting.name)
            for text in value if isinstance(value, tuple) else (value,):
                if isinstance(text, str) and not is_utf8(text):
                    problems.append(f"--{setting.name} {shown_bytes(text)} is not UTF-8 text")
        positive_ints = ("envs_per_actor", "env_splits", "inference_threads", "unroll_length", "total_steps", "batch_size",
                         "num_learner_threads", "hidden_size", "test_episodes", "epochs", "minibatches",
                         "eval_episodes", "eval_max_steps", "ray_actors", "ray_envs_per_actor", "ray_publish_every",
                         "ray_steps_per_request")
        if self.num_actors < (0 if self.ray else 1):  # with --ray the remote actors may be the only ones
            problems.append(f"--num_actors must be >= {0 if self.ray else 1}, got {self.num_actors}")
        for name in positive_ints:
            if getattr(self, name) < 1:
                problems.append(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("learning_rate", "epsilon", "grad_norm_clipping", "log_interval_s", "checkpoint_interval_s"):
            if not getattr(self, name) > 0:
                problems.append(f"--{name} must be > 0, got {getattr(self, name)}")
        for name in ("entropy_cost", "baseline_cost", "momentum", "inference_wait_ms", "actor_timeout_s",
                     "learner_timeout_s", "eval_interval_s", "keep_checkpoints", "ray_max_policy_lag"):
            if getattr(self, name) < 0:
                problems.append(f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.momentum >= 1:
            problems.append(f"--momentum must be in [0, 1), got {self.momentum}")
        # Above these no run learns: every update would be non-finite or wreck the weights, and the run would stop
        # after --max_bad_updates of them (a learning rate of 3e4 for 3e-4, say); said before anything starts.
        for name, most in (("learning_rate", 1.0), ("epsilon", 1.0), ("entropy_cost", MAX_LOSS_WEIGHT),
                           ("baseline_cost", MAX_LOSS_WEIGHT)):
            if most < getattr(self, name) < math.inf:  # infinity: below
                problems.append(f"--{name} must be at most {most:,g}, got {getattr(self, name)}")
        for name in ("actor_timeout_s", "learner_timeout_s"):  # a timeout shorter than one step or one batch can take
            if 0 < getattr(self, name) < MIN_TIMEOUT_S:
                problems.append(f"--{name} must be 0 (never) or at least {MIN_TIMEOUT_S:g} s, got {getattr(self, name)}")
        if MAX_INFERENCE_WAIT_MS < self.inference_wait_ms < math.inf:  # infinity: below
            problems.append(f"--inference_wait_ms must be at most {MAX_INFERENCE_WAIT_MS:,.0f}, got "
                            f"{self.inference_wait_ms}")
        if self.hidden_size > MAX_HIDDEN_SIZE:
            problems.append(f"--hidden_size must be at most {MAX_HIDDEN_SIZE:,}, got {self.hidden_size}")
        if self.num_learner_threads > MAX_LEARNER_THREADS:
            problems.append(f"--num_learner_threads must be at most {MAX_LEARNER_THREADS}, got "
                            f"{self.num_learner_threads}: the updates take turns, and more threads only hold more "
                            "batches")
        if self.epochs > MAX_EPOCHS:
            problems.append(f"--epochs must be at most {MAX_EPOCHS:,}, got {self.epochs}")
        for name in ("envs_per_actor", "ray_envs_per_actor"):
            if getattr(self, name) > MAX_ENVS_PER_ACTOR:
                problems.append(f"--{name} must be at most {MAX_ENVS_PER_ACTOR:,}, got {getattr(self, name)}: one "
                                "actor steps its envs in turn, and more of them only make its unrolls later")
        if self.total_steps > MAX_TOTAL_STEPS:
            problems.append(f"--total_steps must be at most {MAX_TOTAL_STEPS:,}, got {self.total_steps}")
        for name in ("test_episodes", "eval_episodes"):
            if getattr(self, name) > MAX_EPISODES:
                problems.append(f"--{name} must be at most {MAX_EPISODES:,}, got {getattr(self, name)}")
        if not 0 <= self.seed < 2**31:  # ale-py takes int32 env seeds
            problems.append(f"--seed must be in [0, 2^31) = [0, {2**31 - 1}], got {self.seed}")
        if not 0 <= self.discounting <= 1:
            problems.append(f"--discounting must be in [0, 1], got {self.discounting}")
        if self.ppo_dual_clip != 0 and self.ppo_dual_clip <= 1:
            problems.append(f"--ppo_dual_clip must be 0 (off) or above 1, got {self.ppo_dual_clip}")
        if not 0 < self.ppo_clip < 1:
            problems.append(f"--ppo_clip must be in (0, 1), got {self.ppo_clip}")
        if not 0 <= self.vtrace_lambda <= 1:
            problems.append(f"--vtrace_lambda must be in [0, 1], got {self.vtrace_lambda}")
        if not 0 <= self.alpha < 1:
            problems.append(f"--alpha must be in [0, 1), got {self.alpha}")
        if self.env_splits >= 1 and self.envs_per_actor % self.env_splits:
            problems.append(f"--envs_per_actor {self.envs_per_actor} must be a multiple of --env_splits "
                            f"{self.env_splits}")
        if self.ray and self.env_splits >= 1 and self.ray_envs_per_actor % self.env_splits:
            problems.append(f"--ray_envs_per_actor {self.ray_envs_per_actor} must be a multiple of --env_splits "
                            f"{self.env_splits}")
        if self.ray is not None and is_head_address(self.ray):
            host, _, port = self.ray.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                problems.append(f"--ray needs auto, local or HOST:PORT (a head node's, e.g. 10.0.0.1:6379), "
                                f"got {self.ray!r}")
        # Between two puts of the weights the remote actors' age past the lag allowed: the run would stall.
        if self.ray and 0 < self.ray_max_policy_lag < self.ray_publish_every:
            problems.append(f"--ray_max_policy_lag {self.ray_max_policy_lag} drops remote unrolls of weights more "
                            f"than {self.ray_max_policy_lag} versions old, but --ray_publish_every "
                            f"{self.ray_publish_every} sends the remote actors new weights only every "
                            f"{self.ray_publish_every}: most of their unrolls would be dropped; set --ray_publish_every "
                            f"at most {self.ray_max_policy_lag}")
        if self.ray and self.ray_actor_resource in ("CPU", "GPU"):  # Ray refuses them as custom resources
            problems.append(f"--ray_actor_resource {self.ray_actor_resource}: Ray's own resource, not a custom one; "
                            "each remote actor takes one CPU already: name a custom resource (ray start --resources)")
        elif self.ray == "local" and self.ray_actor_resource:
            problems.append(f"--ray_actor_resource {self.ray_actor_resource}: --ray local starts a cluster without "
                            "custom resources, so no remote actor could start; drop it, or use --ray auto|HOST:PORT")
        if self.max_actor_restarts < 0 or self.max_bad_updates < 1:
            problems.append("--max_actor_restarts must be >= 0 and --max_bad_updates >= 1")
        if self.num_buffers is not None and self.num_buffers < self.slots_needed:
            problems.append(
                f"--num_buffers {self.num_buffers} is too few: {self.num_actors} actors x {self.envs_per_actor} "
                f"envs + {self.num_learner_threads} learner threads x batch {self.batch_size} "
                f"hold up to {self.slots_needed} slots at once")
        for name in ([self.xpid] if self.xpid is not None else []) + list(self.plot_xpids if self.mode == "plot" else ()):
            if is_utf8(name) and not is_plain_name(name):  # not UTF-8: said above
                problems.append(f"--xpid {name!r} must be a plain name (letters, digits, '.', '_', '-') of at most "
                                f"{MAX_XPID_CHARS} characters")
        for flag, path in (("savedir", self.savedir), ("plot_out", self.plot_out), ("checkpoint", self.checkpoint)):
            if path == "" and flag != "savedir":  # `--checkpoint "$CKPT"` with CKPT unset (--savedir: below)
                problems.append(f"--{flag} is empty (an unset shell variable?); pass a path, or leave the flag out")
            elif path and (problem := path_problem(path)):
                problems.append(f"--{flag} {path}: {problem}")
        if self.mode == "test" and self.xpid is None and self.checkpoint in ("latest", "best"):
            problems.append("--mode test needs --xpid NAME of a trained run (or --checkpoint PATH)")
        if self.resume and self.mode != "train":
            problems.append(f"--resume is for --mode train, not --mode {self.mode}")
        elif self.resume and self.xpid is None and torchrun_run_id() is None:  # under torchrun the id names the run
            problems.append("--resume needs --xpid NAME of the run to continue")
        if self.mode == "train" and self.checkpoint == "best" and self.xpid is None and torchrun_run_id() is None:
            problems.append("--checkpoint best needs --xpid NAME of the run whose model_best.tar to continue from")
        if self.policy_loss == "ppo" and min(self.batch_size, self.unroll_length, self.minibatches) >= 1:
            over = "batch" if self.advantage_norm == "batch" else "minibatch"
            steps = self.batch_size * self.unroll_length if over == "batch" else self.smallest_minibatch
            if steps < 2 and over == "batch":  # the standard deviation of one number is NaN: every update skipped
                problems.append(f"PPO normalises its advantages over each batch, which {self.batch_size} x "
                                f"{self.unroll_length} steps leave with 1 step; use a longer --unroll_length or a "
                                "larger --batch_size")
            elif steps < 2:
                fewer = "fewer --minibatches, " if self.minibatches > 1 else ""
                problems.append(f"PPO normalises its advantages over each minibatch, which batches of "
                                f"{self.batch_size} x {self.unroll_length} steps cut into {self.minibatches} "
                                f"minibatches leave with 1 step; use {fewer}a longer --unroll_length "
                                "or a larger --batch_size")
        if self.minibatch_mode == "samples" and (self.policy_loss != "ppo" or self.use_lstm):
            problems.append("--minibatch_mode samples needs --policy_loss ppo and a model without --use_lstm "
                            "(single steps drawn from the batch have no sequence for an LSTM)")
        clients = self.num_actors * self.env_splits  # what central inference serves: each actor's env splits
        if self.inference == "central" and 1 <= clients < self.inference_threads:
            problems.append(f"--inference_threads {self.inference_threads} is more than the {clients} env splits "
                            f"there are to serve (--num_actors {self.num_actors} x --env_splits {self.env_splits})")
        if self.use_lstm and self.inference == "central":
            problems.append("--use_lstm is not supported with --inference central; use --inference actor")
        if not self.savedir.strip():
            problems.append(f"--savedir must name a directory, got {self.savedir!r}")
        # NaN passes every comparison above that is written as `value < bound`: one message for it instead. Infinity
        # means something for the intervals, the actor timeout and the clipping (never, no bound), not for these.
        floats = [f.name for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), float)]
        not_numbers = {name for name in floats if math.isnan(getattr(self, name))}
        problems = [p for p in problems if p.split(" ", 1)[0].removeprefix("--") not in not_numbers]
        problems[:0] = [f"--{name} must be a number, got nan" for name in floats if name in not_numbers]
        for name in ("learning_rate", "epsilon", "entropy_cost", "baseline_cost", "momentum", "inference_wait_ms",
                     "ppo_dual_clip"):
            if math.isinf(getattr(self, name)):
                problems.append(f"--{name} must be finite, got {getattr(self, name)}")
        return problems

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}


# `python run.py --help` lists the flags in these groups (title, description), each from its first flag, the key,
# to the next group's, in the order of Config's fields.
HELP_GROUPS: dict[str, tuple[str, str | None]] = {
    "mode": ("what to run", None),
    "num_actors": ("acting", "actor processes step envs and write unrolls into shared slots (README: Speed)"),
    "ray": ("remote actors on a Ray cluster", "needs requirements-ray.txt on every machine (README: Many machines)"),
    "total_steps": ("training and the network", None),
    "entropy_cost": ("the learning rule", None),
    "optimizer": ("the optimiser", None),
    "disable_cuda": ("devices and speed", None),
    "log_interval_s": ("logs, checkpoints and failures", None),
    "eval_interval_s": ("evaluation while training", "off by default (README: Evaluation while training)"),
    "test_episodes": ("test and plot modes", "--mode test plays a saved agent, --mode plot draws runs' returns"),
}


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, unless the help says its default itself (`auto`, a rule)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "default:" in action.help:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="run.py",
        usage="%(prog)s [--mode {train,test,plot}] [--env ENV] [--xpid XPID] [FLAG ...] [@FILE ...]",
        description="IMPALA: actor processes fill shared rollout buffers, learner threads apply V-trace. Every "
                    "flag below, by topic, with its default. @FILE stands for the flags written in FILE (words "
                    "split as a shell does, '#' to the end of a line a comment); a flag given twice takes its "
                    "last value, so flags after @FILE override the file's.",
        formatter_class=DefaultsHelpFormatter,
    )
    add_flags(parser)
    return parser


def add_flags(parser: argparse.ArgumentParser, names: Sequence[str] | None = None,
              defaults: dict[str, Any] | None = None) -> None:
    """Add the flags of Config's fields `names` (all by default, in the groups of HELP_GROUPS) to `parser`, with
    their help, types and choices; `defaults` replaces the defaults of some (`impala.bench`'s short runs)."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    group: argparse.ArgumentParser | argparse._ArgumentGroup = parser
    for name in names if names is not None else fields:
        f = fields[name]
        if names is None and name in HELP_GROUPS:
            group = parser.add_argument_group(*HELP_GROUPS[name])
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        negatable = meta.pop("negatable", False)
        default = meta.pop("argparse_default", f.default)  # what --help shows, converted by the flag's type
        default = (defaults or {}).get(name, default)
        if f.type in ("bool", "bool | None"):
            action = argparse.BooleanOptionalAction if negatable else "store_true"
            group.add_argument(f"--{name}", action=action, default=default, help=help_text)
            continue
        if "nargs" not in meta and "type" not in meta:
            meta["type"] = _arg_type(str(f.type))
        group.add_argument(f"--{name}", default=default, help=help_text, **meta)


def to_flags(config: Config, names: Sequence[str]) -> list[str]:
    """The `run.py` flags that set the fields `names` of `config`: `parse_config`'s rules turned around.

    A bool without a `--no-` form is left out when false; a None is left out (the flag's default).
    """
    negatable = {f.name for f in dataclasses.fields(Config) if f.metadata.get("negatable")}
    argv: list[str] = []
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool):
            argv += [f"--{name}"] if value else ([f"--no-{name}"] if name in negatable else [])
        elif isinstance(value, tuple):
            argv += [f"--{name}", *map(str, value)] if value else []
        elif value is not None:
            argv += [f"--{name}", str(value)]
    return argv


def _arg_type(annotation: str) -> Any:
    base = annotation.replace(" | None", "")
    return {"int": whole_number, "float": float, "str": str}[base]


def whole_number(text: str) -> int:
    """An int flag's value: 5000000, 5_000_000, or a whole number in a float's notation, 5e6 (as step counts
    are written in papers)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if not number.is_integer():
        raise argparse.ArgumentTypeError(f"takes a whole number (such as 5000000 or 5e6), got {text!r}")
    return int(number)


class OneLineErrorParser(argparse.ArgumentParser):
    """A parser whose errors are a UserError: one line, exit code 2, where argparse prints its usage first."""

    def error(self, message: str) -> NoReturn:  # argparse would print usage and exit; we want one line
        raise UserError(message)


def torchrun_run_id() -> str | None:
    """torchrun's rendezvous id (--rdzv-id; a fresh one per launch with --standalone), which names the run of a
    job started without --xpid; None outside torchrun, or where it has none."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return run_id if "LOCAL_RANK" in os.environ and run_id not in ("", "none") else None


MAX_FLAG_FILE_DEPTH = 8  # @FILE inside @FILE: deeper is taken for a file that names itself


def expand_flag_files(argv: Sequence[str], depth: int = 0) -> list[str]:
    """`argv` with each @FILE replaced by the words of FILE, split as a shell splits them (quotes keep spaces,
    '#' starts a comment to the end of its line), and any @FILE among them replaced in turn. A file that cannot be
    read, is not UTF-8 text or has an unclosed quote is a UserError naming it."""
    words: list[str] = []
    for arg in argv:
        if not arg.startswith("@"):
            words.append(arg)
            continue
        path = arg[1:]
        if depth >= MAX_FLAG_FILE_DEPTH:
            raise UserError(f"flags file {path}: flags files name one another more than {MAX_FLAG_FILE_DEPTH} deep "
                            "(does one name itself?)")
        if problem := path_problem(path) if path else "the name after @ is empty":
            raise UserError(f"flags file {arg}: {problem}")
        try:
            text = Path(path).expanduser().read_text(encoding="utf-8")
        except OSError as exc:
            raise UserError(f"flags file {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise UserError(f"flags file {path} is not UTF-8 text") from None
        try:
            file_words = shlex.split(text, comments=True)
        except ValueError as exc:  # No closing quotation, No escaped character
            raise UserError(f"flags file {path}: {str(exc).lower()}") from None
        words += expand_flag_files(file_words, depth + 1)
    return words


def parse_config(argv: Sequence[str] | None = None) -> Config:
    """Flags (@FILE expanded: `expand_flag_files`) -> validated Config. Raises UserError naming every problem
    found."""
    parser = build_parser()
    parser.__class__ = OneLineErrorParser
    args = parser.parse_args(expand_flag_files(sys.argv[1:] if argv is None else argv))
    values: dict[str, Any] = vars(args)
    values["plot_xpids"] = tuple(values["plot_xpids"] or ())
    problems = []
    names = values["xpid"] or []  # a list: plot mode compares several runs, every other mode takes one
    if values["mode"] == "plot":
        values["xpid"], values["plot_xpids"] = None, (*names, *values["plot_xpids"])
    else:
        values["xpid"] = names[0] if names else None
        if len(names) > 1:
            problems.append(f"--xpid takes one name in --mode {values['mode']}, got {len(names)} "
                            f"({' '.join(names)}); several only with --mode plot")
    config = Config(**values)
    problems += config.validate()
    if problems:
        raise UserError("; ".join(problems))
    return config


def given_flags(argv: Sequence[str] | None = None) -> frozenset[str]:
    """The names of the flags `argv` gives (abbreviated or not), whatever their values; those left out are not in
    it. For `argv` that `parse_config` accepts."""
    parser = build_parser()
    parser.__class__ = OneLineErrorParser
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return frozenset(vars(parser.parse_args(expand_flag_files(sys.argv[1:] if argv is None else argv))))


def config_from_dict(values: dict[str, Any]) -> Config:
    """Rebuild a Config from `Config.to_dict()` output (e.g. stored in a checkpoint), ignoring unknown keys."""
    names = {f.name for f in dataclasses.fields(Config)}
    kept: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items() if k in names}
    return Config(**kept)


# What test and plot mode read of the flags (tests/test_config.py records it); the rest they ignore, and say so.
MODE_FLAGS = {
    "test": frozenset({"mode", "env", "xpid", "savedir", "checkpoint", "seed", "test_episodes", "eval_actions",
                       "eval_max_steps", "fire_on_life_loss", "video"}),
    "plot": frozenset({"mode", "xpid", "savedir", "plot_xpids", "plot_out", "plot_x"}),
}


def ignored_flags_line(mode: str, given: frozenset[str]) -> str | None:
    """One line naming the flags `given` that --mode `mode` does not read (None when it reads them all): a
    --total_steps in test mode, say, would otherwise pass for having been used."""
    ignored = sorted(given - MODE_FLAGS[mode]) if mode in MODE_FLAGS else []
    if not ignored:
        return None
    return f"run.py: --mode {mode} does not use {', '.join('--' + name for name in ignored)}; ignored"


# Training flags that count only beside another: given without it, they are ignored, and the start says so.
ONLY_WITH = (("--ray", ("ray_actors", "ray_envs_per_actor", "ray_steps_per_request", "ray_actor_resource",
                        "ray_publish_every", "ray_max_policy_lag")),
             ("--inference central", ("inference_wait_ms", "inference_threads")),
             ("--policy_loss ppo", ("ppo_clip", "ppo_dual_clip", "advantage_norm")))


def unused_training_flags_line(config: Config, given: frozenset[str]) -> str | None:
    """One line naming the flags `given` to a training that only another flag, not given, makes count (None when
    there are none): --ray_actors without --ray would otherwise pass for remote actors asked for."""
    needed = {"--ray": bool(config.ray), "--inference central": config.inference == "central",
              "--policy_loss ppo": config.policy_loss == "ppo"}
    parts = [f"{', '.join('--' + name for name in names if name in given)} only with {flag}"
             for flag, names in ONLY_WITH if not needed[flag] and given.intersection(names)]
    return f"run.py: {'; '.join(parts)}: ignored" if parts else None


# Flags that name what a session does rather than the run it continues: expected to differ at a resume.
SESSION_FLAGS = frozenset({"mode", "xpid", "resume", "checkpoint", "savedir", "total_steps", "plot_out",
                           "plot_xpids", "plot_x", "video", "test_episodes"})


def changed_flags(saved: dict[str, Any], config: Config) -> list[str]:
    """`--NAME NEW (was OLD)` for each flag of `config` that differs from the `saved` flags of the run it resumes
    (a flag not given takes its default, not the run's value), session flags and flags `saved` lacks aside."""
    now = config.to_dict()
    changed = []
    for name, value in now.items():
        if name in SESSION_FLAGS or name not in saved:
            continue
        was = saved[name]
        if (list(was) if isinstance(was, (list, tuple)) else was) != value:
            changed.append(f"--{name} {_shown(value)} (was {_shown(was)})")
    return changed


def _shown(value: Any) -> str:
    if value is None:  # the flags whose default is None: auto (--amp) or off (--ray)
        return "default"
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


LATEST_NAME = "latest"


def plain_name(text: str) -> str:
    """`text` as a part of a run name: every character but letters, digits, '.', '_' and '-' as '_'
    (ALE/Pong-v5 gives ALE_Pong-v5, my_envs:Maze-v0 gives my_envs_Maze-v0)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


MAX_NAME_BYTES = 255  # of one file name, on Linux's file systems
MAX_XPID_CHARS = MAX_NAME_BYTES - 40  # room for what is named after a run (`NAME.rank-R.remote-A.life-L`)
MAX_ENV_NAME_CHARS = 100  # of the env id in a run's default name (ENV-date-time), room left for the rest
# Of a path the user names, in bytes: Linux's PATH_MAX (4,096 with its terminating zero), less room for the files of
# a run under a --savedir (XPID/tensorboard/...) and a run's names.
MAX_PATH_BYTES = 4095 - 2 * MAX_NAME_BYTES
MAX_INFERENCE_WAIT_MS = 60_000.0  # a wait for more actors' requests; longer overflowed the selector's timeout
# Test or evaluation games, played at once, an env each: 1,000 Atari envs take some 1.6 GB and 3 CPU-minutes to make.
MAX_EPISODES = 1_000
# Passes over one batch (PPO takes a few): every pass's minibatch order is drawn up front, and a stop waits for
# the update under way. More overflowed, ran out of memory, or stopped after minutes.
MAX_EPOCHS = 1_000
MAX_LOSS_WEIGHT = 1_000.0  # --entropy_cost, --baseline_cost: the policy loss's weight is 1
# One actor's envs: 100,000 CartPoles made one unroll of 3.2M agent steps, no update for minutes, and an actor
# that a stop had to kill. ale-py's vector env and EnvPool run a few hundred per process.
MAX_ENVS_PER_ACTOR = 4_096
MAX_TOTAL_STEPS = 10**15  # a counter that fits int64 with room; the longest published runs are some 10^10 steps
MIN_TIMEOUT_S = 1.0  # --actor_timeout_s, --learner_timeout_s other than 0 (never)
MAX_HIDDEN_SIZE = 65_536  # the Atari net's layer is then 3,136 x 65,536 weights (822 MB); more only failed to allocate
# Learner threads take turns at the updates: more only stage batches ahead, each holding --batch_size slots. 2,000
# slowed a CartPole run's start and outlived its stop (10 s), writing tracebacks after its final checkpoint.
MAX_LEARNER_THREADS = 64


def env_int(name: str, default: int | None = None) -> int:
    """The whole number in environment variable `name` (torchrun's RANK, WORLD_SIZE, ...), or `default` where it is
    unset; anything else in it is a UserError naming it."""
    text = os.environ.get(name)
    if text is None and default is not None:
        return default
    try:
        return int(text or "")
    except ValueError:
        raise UserError(f"the environment variable {name} must be a whole number (torchrun sets it), "
                        f"got {text!r}") from None


def is_head_address(ray: str) -> bool:
    """Whether --ray names a head node as HOST:PORT (not auto, local or a Ray client's ray://...)."""
    return ray not in ("auto", "local") and not ray.startswith("ray://")


def is_utf8(text: str) -> bool:
    """Whether `text` encodes to UTF-8: an argument of bytes that are not UTF-8 reaches Python as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def shown_bytes(text: str) -> str:
    """`text` that is not UTF-8 as the bytes it came from (b'a\\xffb' for the argument a, 0xff, b), for a message
    that must itself be UTF-8."""
    try:
        return repr(os.fsencode(text))
    except UnicodeEncodeError:  # a surrogate no file name or argument decodes to: given from Python
        return repr(text.encode("utf-8", "backslashreplace"))


def is_plain_name(name: str) -> bool:
    """A run's name: letters, digits, '.', '_' and '-', not starting with the last three, short enough for the
    files named after it (a remote actor's `NAME.rank-R.remote-A.life-L`, the run directory itself)."""
    return bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name)) and len(name) <= MAX_XPID_CHARS


def path_problem(path: str) -> str | None:
    """What makes `path` unusable before the file system is asked (None where nothing does): a `~user` with no such
    user (pathlib raises RuntimeError for it), a part longer than a file name can be (ENAMETOOLONG)."""
    try:
        parts = Path(path).expanduser().parts
    except RuntimeError:
        head, _, rest = path.partition("/")
        meant = "/".join(filter(None, (head[1:], rest)))
        return f"{head} is the home of a user {head[1:]!r}, and there is none (did you mean ~/{meant}?)"
    lengths = [len(os.fsencode(part)) for part in parts]
    if max(lengths, default=0) > MAX_NAME_BYTES:
        return f"a part of it is {max(lengths)} bytes long, more than a file name can be ({MAX_NAME_BYTES})"
    if (length := len(os.fsencode(str(Path(*parts))))) > MAX_PATH_BYTES:
        return (f"it is {length:,} bytes long, more than a path can be with a run's files under it "
                f"({MAX_PATH_BYTES:,})")
    return None


def run_path(savedir: str | Path, xpid: str) -> Path:
    """SAVEDIR/XPID, where XPID `latest` means the run named in the file SAVEDIR/latest (when it is a file; a
    directory there, a run of that name or an older version's symlink, keeps its name). UserError when
    SAVEDIR has no latest run, or the run it names is gone: training would otherwise start a run called latest,
    which no later run could then be named in, or a new run of the name given."""
    savedir = Path(savedir).expanduser()
    if xpid != LATEST_NAME:
        return savedir / xpid
    latest = savedir / LATEST_NAME
    if latest.is_dir():
        return latest
    try:
        name = latest.read_text().strip() if latest.is_file() else ""
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise UserError(f"--xpid latest: cannot read the file {latest} ({exc}); pass the run's name") from None
    if not name:
        raise UserError(f"--xpid latest: no run in {savedir} yet (the file {latest} names the run started last); "
                        "train one first, or pass a run's name")
    if not is_plain_name(name):  # what a power cut can leave, or a hand: it must not lead out of SAVEDIR
        raise UserError(f"--xpid latest: the file {latest} is damaged (it holds {name[:60]!r}, no run's name); pass "
                        "the run's name")
    if not os.path.lexists(savedir / name):  # training would start a new run of that name, from step 0
        raise UserError(f"--xpid latest: the file {latest} names the run {name!r}, which is not in {savedir} (moved "
                        "or deleted?); pass a run's name")
    return savedir / name
