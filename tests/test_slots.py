"""Tests for impala/slots.py: every slot is in exactly one place, whenever and however often an actor dies."""

from __future__ import annotations

import functools
import multiprocessing
import os
import queue
import random
import signal
import threading
import time
from pathlib import Path

import torch

from impala import training
from impala.channels import RecordQueue
from impala.config import Config
from impala.slots import NO_OWNER, SlotLedger

CTX = multiprocessing.get_context("forkserver")


def _ledger(num_buffers: int, num_actors: int) -> SlotLedger:
    owner = torch.full((num_buffers,), -1, dtype=torch.int64)
    return SlotLedger(CTX, owner, num_actors, RecordQueue(CTX, "q", capacity=num_buffers))


def _take(q: RecordQueue, count: int) -> list[int]:
    return [q.get(timeout=1) for _ in range(count)]


def test_each_actor_gets_its_own_slots_back() -> None:
    ledger = _ledger(7, 2)
    assert _take(ledger.free_queue(0), 4) == [0, 2, 4, 6]
    assert _take(ledger.free_queue(1), 3) == [1, 3, 5]
    assert ledger.free_size() == 0
    for slot in (4, 1):
        ledger.full_queue.put(slot)  # an actor hands them over; they stay marked as its own until taken
    assert ledger._owner[4] == 0 and ledger.full_size() == 2
    assert ledger.take_full(1) == 4 and ledger._owner[4] == NO_OWNER
    assert ledger.take_full(1) == 1
    assert ledger.take_full(0.01) is None
    ledger.give_back(4)
    ledger.give_back(1)
    assert ledger._owner[4] == 0 and ledger._owner[1] == 1
    assert _take(ledger.free_queue(0), 1) == [4]
    assert _take(ledger.free_queue(1), 1) == [1]
    ledger.close()


def test_a_learner_that_outlives_the_close_of_the_slots_neither_takes_nor_gives_back_nor_fails() -> None:
    """A learner thread still waiting for a batch when the run closed the pipes (it outlived its stop, as 2,000
    threads did) gave its slots back to a closed pipe: "BrokenPipeError", a traceback after the final checkpoint."""
    ledger = _ledger(4, 1)
    ledger.full_queue.put(_take(ledger.free_queue(0), 1)[0])
    assert ledger.take_full(1) == 0
    waiting: list[int | None] = []
    thread = threading.Thread(target=lambda: waiting.append(ledger.take_full(timeout_s=5)))
    thread.start()  # waits on the full queue, as a learner does
    time.sleep(0.2)
    ledger.close()
    thread.join(timeout=5)
    assert waiting == [None]  # at once, not after its 5 s
    ledger.give_back(0)  # nothing to give it to, and no error
    assert ledger.take_full(0.01) is None and ledger._owner[0] == NO_OWNER


def test_a_dead_actors_slots_go_to_its_replacement_and_what_it_handed_over_to_the_learners() -> None:
    ledger = _ledger(8, 2)  # actor 0 holds 0, 2, 4, 6
    taken = _take(ledger.free_queue(0), 3)  # filling 0, 2, 4; 6 still in its pipe
    ledger.full_queue.put(taken[0])  # killed in the middle of handing over its unroll
    assert _take(ledger.free_queue(1), 1) == [1]
    ledger.full_queue.put(1)  # actor 1's unroll, handed over before the death
    assert ledger.reclaim(0) == 3  # 2, 4 (half-filled) and 6 (unread)
    assert ledger.free_size() == 3 + 3  # actor 1's other three slots are untouched
    assert sorted(_take(ledger.free_queue(0), 3)) == [2, 4, 6]
    assert ledger.take_full(1) == 0  # the handed-over slot reaches a learner once, not the replacement
    assert ledger.take_full(1) == 1
    assert ledger.take_full(0.01) is None
    assert sorted(ledger.drain()) == [3, 5, 7]
    ledger.close()


def test_no_slot_is_lost_or_doubled_when_actors_are_killed_at_random_moments(tmp_path: Path) -> None:
    """Kill actors with SIGKILL at random instants while they act and learners learn, then account for
    every slot: each must be in exactly one pipe."""
    config = Config(env="CartPole-v1", num_actors=2, envs_per_actor=4, unroll_length=2, batch_size=4,
                    hidden_size=16, total_steps=10**9, disable_cuda=True, max_actor_restarts=1000,
                    savedir=str(tmp_path), xpid="kills")
    run = training.build(config)
    rng = random.Random(0)
    killed: set[int] = set()
    try:
        training.start_actors(run)
        training.start_learners(run)
        deadline = time.monotonic() + 60
        while run.state.step == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run.state.step > 0, "no update within 60 s"
        for _ in range(20):
            time.sleep(rng.uniform(0.0, 0.3))
            index = rng.randrange(config.num_actors)
            victim = run.pool.processes[index]
            os.kill(victim.pid, signal.SIGKILL)
            victim.join()
            killed.add(victim.pid)
            run.pool.check()
            assert run.pool.processes[index].pid != victim.pid
        step = run.state.step
        deadline = time.monotonic() + 30
        while run.state.step < step + 200 and time.monotonic() < deadline:  # and training goes on
            time.sleep(0.05)
        assert run.state.step >= step + 200
        assert not run.learners.errors
    finally:
        run.pool.channels.stop_event.set()
        run.learners.stop_event.set()
        for thread in run.learners.threads:
            thread.join(timeout=10)
        run.pool.stop(functools.partial(training._drain_episodes, run))
        for index in range(config.num_actors):  # slots the stopped actors had taken, back in their pipes
            run.pool.slots.reclaim(index)
        slots = run.pool.slots.drain()
        training.shutdown(run, save=False)
    assert len(killed) == 20  # every kill found a live actor: the one before it had been replaced
    assert sorted(slots) == list(range(config.resolved_num_buffers()))


def _free_now(q: RecordQueue) -> int:
    """How many slots `q` hands out without waiting for a learner."""
    count = 0
    while True:
        try:
            q.get(timeout=0.01)
        except queue.Empty:
            return count
        count += 1


def test_with_a_learner_that_keeps_up_an_actor_starts_its_next_unroll_while_its_last_waits_for_a_batch() -> None:
    config = Config(num_actors=14, envs_per_actor=8, batch_size=32)  # the default on a GPU machine of 16 cores
    for learner_keeps_up, free_after_handing_over in ((False, (2, 3)), (True, (8,))):
        ledger = _ledger(config.resolved_num_buffers(learner_keeps_up=learner_keeps_up), config.num_actors)
        for actor in range(config.num_actors):
            for slot in _take(ledger.free_queue(actor), config.envs_per_actor):  # one unroll, filled, handed over
                ledger.full_queue.put(slot)
            assert _free_now(ledger.free_queue(actor)) in free_after_handing_over  # what its next unroll can have
        ledger.close()
