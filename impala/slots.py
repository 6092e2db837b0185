"""Where every rollout slot is, kept so that an actor killed at any instant loses no slot and no slot is
handed out twice.

A slot is always in exactly one of these places:

    its actor's free pipe, or being filled              slot_owner = the actor
    the full queue (handed to the learners)             slot_owner = the actor still
    the backlog (what was in the full queue when an
      actor died, taken by the learners first)          slot_owner = -1
    with a learner thread                               slot_owner = -1

Each slot belongs to one actor (slot % num_actors, or the `homes` given), which gets it back every time a
learner is done with it. A writer that is not a process (the thread that copies in the unrolls of remote
actors, `ray_pool.py`) is one more "actor" with slots of its own. Only the main process writes `slot_owner`, under one lock, and always before the slot enters
an actor's pipe; an actor only reads its pipe and writes the full queue. So when an actor dies, the
monitor takes the lock, moves everything in the full queue to a backlog the learners read first (the
dead actor cannot add to the queue any more, and no learner is between a read and its mark), and then
every slot still marked as the dead actor's was never handed over: it goes to the new actor's pipe.
Created by `actor_pool.LocalActorPool`.
"""

from __future__ import annotations

import collections
import queue
import struct
import threading
import time
from typing import Any

import torch

from impala.channels import RecordQueue, pipe_records
from impala.config import UserError

SLOT_RECORD = "q"  # a slot number as the pipes carry it

NO_OWNER = -1


def check_pipes_hold(local_slots: int, num_actors: int, remote_slots: int) -> None:
    """Raise UserError, before a run writes anything, where an actor's free pipe could not hold all its slots:
    filling it at the start would block the main process for good."""
    local_share = -(-local_slots // num_actors) if num_actors else 0
    most = max(local_share, remote_slots) + 1
    fits = pipe_records(struct.calcsize(SLOT_RECORD), most)
    if most > fits and remote_slots > local_share:  # the remote actors' slots share one pipe
        raise UserError(f"the remote actors' objects and the learners' batches take {remote_slots} slots, all in one "
                        f"pipe, which holds {fits - 1} here (/proc/sys/fs/pipe-max-size): lower "
                        "--ray_steps_per_request or --ray_actors")
    if most > fits:
        raise UserError(f"{local_slots + remote_slots} slots (--num_buffers, or what --batch_size asks for) put up "
                        f"to {most - 1} in one actor's pipe, which holds {fits - 1} here "
                        "(/proc/sys/fs/pipe-max-size): lower --num_buffers or --batch_size, or add --num_actors")


class SlotLedger:
    """The free pipe of every actor, the full queue, and the `slot_owner` marks that tie them together."""

    def __init__(self, ctx: Any, slot_owner: torch.Tensor, num_actors: int, full_queue: RecordQueue,
                 homes: list[int] | None = None) -> None:
        """`homes[slot]`: the actor `slot` returns to (default: slot % num_actors)."""
        self._ctx = ctx
        self._owner = slot_owner
        self.num_actors = num_actors
        self._homes = homes if homes is not None else [slot % num_actors for slot in range(len(slot_owner))]
        self.full_queue = full_queue
        self._lock = threading.Lock()
        self._closed = False  # the run has ended: a learner thread that outlived its stop gives back and takes nothing
        self._backlog: collections.deque[int] = collections.deque()  # full slots moved out of the queue
        self._free = [self._new_free_queue(index) for index in range(num_actors)]
        for slot in range(len(slot_owner)):
            self.give_back(slot)

    def _new_free_queue(self, actor_index: int) -> RecordQueue:
        return RecordQueue(self._ctx, SLOT_RECORD, capacity=self._homes.count(actor_index) + 1)

    def free_queue(self, actor_index: int) -> RecordQueue:
        """The pipe actor `actor_index` takes its slots from."""
        return self._free[actor_index]

    def give_back(self, slot: int) -> None:
        """Return `slot` (from a learner, or at the start) to its actor."""
        actor_index = self._homes[slot]
        with self._lock:
            if self._closed:
                return  # no actor is left to take it
            self._owner[slot] = actor_index
            self._free[actor_index].put(slot)

    def take_full(self, timeout_s: float) -> int | None:
        """The next slot an actor handed over, now the caller's; None if none came within `timeout_s`, or the
        ledger is closed."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self._closed:
                    return None
                slot = self._backlog.popleft() if self._backlog else None
                if slot is None:
                    try:
                        slot = self.full_queue.get_nowait()
                    except queue.Empty:
                        pass
                if slot is not None:
                    self._owner[slot] = NO_OWNER
                    return slot
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                self.full_queue.wait(min(remaining, 0.05))  # short: the monitor may fill the backlog meanwhile
            except OSError:
                if not self._closed:
                    raise
                return None  # closed meanwhile

    def reclaim(self, actor_index: int) -> int:
        """After actor `actor_index` died (its process joined): give its replacement a new free pipe holding
        every slot the dead actor had not handed over. Returns how many that was."""
        with self._lock:
            while True:
                try:
                    slot = self.full_queue.get_nowait()
                except queue.Empty:
                    break
                self._owner[slot] = NO_OWNER
                self._backlog.append(slot)
            old, self._free[actor_index] = self._free[actor_index], self._new_free_queue(actor_index)
            owned = (self._owner == actor_index).nonzero().flatten().tolist()
            for slot in owned:
                self._free[actor_index].put(slot)
        old.close()  # whatever the dead actor left unread in it is in `owned`
        return len(owned)

    def free_size(self) -> int:
        """Slots waiting in the actors' free pipes (a snapshot)."""
        return sum(q.qsize() for q in self._free)

    def full_size(self) -> int:
        """Slots handed over and not yet taken by a learner (a snapshot)."""
        return self.full_queue.qsize() + len(self._backlog)

    def drain(self) -> list[int]:
        """Every slot in a pipe or the backlog, removed from them (once the actors are gone)."""
        slots = []
        with self._lock:
            for q in (*self._free, self.full_queue):
                while True:
                    try:
                        slots.append(q.get_nowait())
                    except queue.Empty:
                        break
            slots.extend(self._backlog)
            self._backlog.clear()
        return slots

    def close(self) -> None:
        """Close every pipe; from then on `give_back` and `take_full` do nothing (learner threads that outlived
        their stop, training.LEARNER_JOIN_TIMEOUT_S, end quietly)."""
        with self._lock:
            self._closed = True
            for q in self._free:
                q.close()
            self.full_queue.close()
