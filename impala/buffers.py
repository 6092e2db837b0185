"""Shared-memory rollout slots.

A slot holds one unroll of one env in rows 0..T, where row 0 repeats the last row of the previous
unroll of that env. Alignment (the same in every row t):

    obs[t], done[t]      the observation and whether it begins an episode
    reward[t]            the reward received on arriving at obs t
    truncated[t]         whether the step that arrived at obs t hit a time limit (done[t] is true too)
    truncation_value[t]  then the value of the observation that episode ended on; 0 elsewhere
    action[t], policy_logits[t], baseline[t]   chosen at obs t (row T's are not used)

so the action at t pairs with reward[t + 1] and done[t + 1], and the bootstrap value is the value
of obs T. Only slot numbers travel through queues; the tensors below stay in shared memory.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from impala.config import UserError, memory_limit

log = logging.getLogger("impala")

_POISON = {torch.uint8: 255, torch.bool: True, torch.int64: -1, torch.float32: float("nan")}
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context, not only the current


@dataclass(frozen=True)
class BufferSpec:
    num_buffers: int
    unroll_length: int
    observation_shape: tuple[int, ...]
    observation_dtype: torch.dtype
    num_actions: int
    core_state_shapes: tuple[tuple[int, ...], ...] = ()  # per tensor of the LSTM state, one env's shape

    def fields(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        n, rows = self.num_buffers, self.unroll_length + 1
        fields = {
            "obs": ((n, rows, *self.observation_shape), self.observation_dtype),
            "done": ((n, rows), torch.bool),
            "reward": ((n, rows), torch.float32),
            "truncated": ((n, rows), torch.bool),
            "truncation_value": ((n, rows), torch.float32),
            "episode_return": ((n, rows), torch.float32),
            "episode_step": ((n, rows), torch.int64),
            "game_over": ((n, rows), torch.bool),
            "action": ((n, rows), torch.int64),
            "policy_logits": ((n, rows, self.num_actions), torch.float32),
            "baseline": ((n, rows), torch.float32),
            "policy_version": ((n,), torch.int64),
            "slot_owner": ((n,), torch.int64),  # actor filling the slot, -1 when none
        }
        for i, shape in enumerate(self.core_state_shapes):
            fields[f"core_state_{i}"] = ((n, *shape), torch.float32)
        return fields

    def nbytes(self) -> int:
        total = 0
        for shape, dtype in self.fields().values():
            count = 1
            for size in shape:
                count *= size
            total += count * torch.empty((), dtype=dtype).element_size()
        return total


Buffers = dict[str, torch.Tensor]


def write_row(buffers: Buffers, slots: Sequence[int], index: torch.Tensor, t: int,
              row: dict[str, torch.Tensor]) -> None:
    """Write `row`'s fields ([N, ...], one entry per env) into row t of `slots` (N slot numbers; `index` the same
    as a tensor). Observations go slot by slot: each is one contiguous copy (a frame stack, 28 KB for Atari),
    which takes a quarter of the time an indexed write of all N does (38 against 151 us for 8 Atari envs, one
    thread, BENCHMARKS.md); the other fields are a few bytes per env, one indexed write each."""
    for key, value in row.items():
        if key == "obs":
            target = buffers[key]
            for i, slot in enumerate(slots):
                target[slot, t].copy_(value[i])
        else:
            buffers[key][index, t] = value


def physical_memory_bytes() -> int:
    """This machine's memory, the most a run's processes could share."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class UsableMemory:
    """The memory a run's processes may use together: this machine's, or less where this process's cgroups limit it
    and its children (`limit`: a container's, a job's), whose kernel kills a process of the run once they are over
    it. Its str is the words a message gives it."""

    physical: int
    limit: int | None  # below `physical`, or None

    @property
    def bytes(self) -> int:
        return self.physical if self.limit is None else self.limit

    def __str__(self) -> str:
        if self.limit is None:
            return f"this machine has {self.physical / 2**30:.1f} GiB"
        return (f"this process's memory limit (its cgroup's: a container's, a job's) is {self.limit / 2**30:.1f} GiB "
                f"of the machine's {self.physical / 2**30:.1f}")


def usable_memory() -> UsableMemory:
    """This machine's memory, and the limit of this process's cgroups (`memory_limit`) where it is below that."""
    physical, limit = physical_memory_bytes(), memory_limit()
    return UsableMemory(physical, limit if limit is not None and limit < physical else None)


LOWER_LOCAL_SLOTS = "--num_buffers, --unroll_length or --envs_per_actor"
LOWER_REMOTE_SLOTS = "--ray_steps_per_request or --ray_actors"  # each remote actor's object has slots of its own


def check_shared_memory(needed_bytes: int, path: str = "/dev/shm", lower: str = LOWER_LOCAL_SLOTS) -> None:
    """Raise UserError if `path` has too little free space for the rollout buffers, or the memory the run may use
    (`usable_memory`) is less than they take; `lower` names the flags that make them fewer or smaller."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return  # no /dev/shm to check (not Linux): let torch report what it can
    free = stat.f_bavail * stat.f_frsize
    with_room = needed_bytes * 1.1 + 64 * 2**20  # room for the shared models and the queues' own segments
    if with_room > free:
        raise UserError(
            f"the rollout buffers need {needed_bytes / 2**20:.0f} MiB of shared memory, {with_room / 2**20:.0f} MiB "
            f"with the shared models and queues, but {path} has {free / 2**20:.0f} MiB free; in Docker run with "
            f"--shm-size=8g (or --ipc=host), or lower {lower}")
    memory = usable_memory()
    if with_room > memory.bytes:  # a cgroup's limit counts shared memory as any other: the kernel would kill the run
        raise UserError(
            f"the rollout buffers need {needed_bytes / 2**20:.0f} MiB of shared memory, {with_room / 2**20:.0f} MiB "
            f"with the shared models and queues, where {memory}: lower {lower}")


def create_buffers(spec: BufferSpec, shared: bool = True, lower: str = LOWER_LOCAL_SLOTS) -> Buffers:
    """Allocate every field, filled with poison so an unwritten row fails loudly; in shared memory unless
    `shared` is false (a remote actor's own slots, which no other process reads). `lower`: the flags a user would
    lower where shared memory is short."""
    if shared:
        check_shared_memory(spec.nbytes(), lower=lower)
    buffers = {}
    for name, (shape, dtype) in spec.fields().items():
        tensor = torch.full(shape, _POISON[dtype], dtype=dtype)
        buffers[name] = tensor.share_memory_() if shared else tensor
    return buffers


def pin_observations(buffers: Buffers, device: torch.device) -> bool:
    """Page-lock the slots' observations where they are, in shared memory, for CUDA (`cudaHostRegister`), so a GPU
    learner copies each slot's frames straight to the device instead of stacking them on the host first
    (`learner.BatchStaging`): with Pong's defaults, 30 MB per batch that the host no longer copies. Returns
    whether they are pinned; where CUDA refuses (a limit on locked memory), one warning, and the learner stacks
    them as before. `unpin_observations` undoes it.

    Only the main process pins: actors open the same memory from the fork server and are not affected.
    """
    storage = buffers["obs"].untyped_storage()
    start, size = storage.data_ptr(), storage.nbytes()
    error = _cuda_call(device, lambda: torch.cuda.cudart().cudaHostRegister(start, size, _HOST_REGISTER_PORTABLE))
    if error is not None:
        log.warning("Could not page-lock the slots' observations for the GPU (%s, %.0f MiB); the learner stacks "
                    "each batch on the host instead", error, size / 2**20)
        return False
    return True


def unpin_observations(buffers: Buffers, device: torch.device) -> None:
    """Undo `pin_observations`, once nothing copies from the slots any more."""
    start = buffers["obs"].untyped_storage().data_ptr()
    error = _cuda_call(device, lambda: torch.cuda.cudart().cudaHostUnregister(start))
    if error is not None:
        log.warning("Could not release the page-locked slots (%s)", error)


def _cuda_call(device: torch.device, call: Callable[[], object]) -> str | None:
    """Run a CUDA runtime call of `torch.cuda.cudart()` for `device`; None when it succeeded, else why not. It runs
    in a thread of its own: a failed call also leaves its error as the thread's last CUDA error, which PyTorch would
    report at that thread's next kernel launch. The thread works on `device`, not on the first GPU, where it would
    otherwise make a CUDA context of its own (a learner process of torchrun on another GPU)."""
    outcome: list[str | None] = ["no result"]

    def run() -> None:
        try:
            with torch.cuda.device(device):
                torch.cuda.check_error(call())  # type: ignore[arg-type]
            outcome[0] = None
        except (RuntimeError, TypeError) as exc:  # a CudaError, or a binding that takes other arguments
            outcome[0] = str(exc).strip() or type(exc).__name__

    thread = threading.Thread(target=run, name="cuda-register")
    thread.start()
    thread.join()
    return outcome[0]
