"""The learner threads' bookkeeping (`impala/learners.py`), driven without processes."""

from __future__ import annotations

import threading
import time

import torch

from impala import learner
from impala.buffers import BufferSpec, create_buffers
from impala.config import Config
from impala.learner import LearnerState
from impala.learners import Learners
from impala.model import Net
from impala.seeding import ActorLives

T, B = 3, 2


class _Slots:
    """Hands out full slots in a fixed order; once they are gone, stops the learner."""

    def __init__(self, order: list[int], stop: threading.Event) -> None:
        self.order, self.stop = list(order), stop

    def take_full(self, timeout_s: float) -> int | None:
        if self.order:
            return self.order.pop(0)
        self.stop.set()
        return None

    def give_back(self, slot: int) -> None:
        pass


class _Pool:
    def __init__(self, slots: _Slots) -> None:
        self.slots = slots
        self.published: list[int] = []

    def publish(self, model: Net, version: int) -> None:
        self.published.append(version)


class _RecordingLearners(Learners):
    lags: list[float]

    def record(self, stats: dict[str, float], policy_lag: float, timings_s: dict[str, float] | None = None) -> None:
        assert not stats["skipped"]
        self.lags.append(policy_lag)


def test_policy_lag_counts_the_updates_between_acting_and_learning() -> None:
    """One learner thread, three batches of two slots: the first two acted with version 0 (before any
    update), the third with version 1. At updates 1, 2 and 3 the lags are 0, 1 and 1."""
    config = Config(env="CartPole-v1", unroll_length=T, batch_size=B, num_learner_threads=1, total_steps=10**6,
                    policy_loss="impala", optimizer="rmsprop", epsilon=0.01, epochs=1, minibatches=1)
    torch.manual_seed(0)
    model = Net((4,), 2, "mlp", False, 8)
    buffers = create_buffers(BufferSpec(3 * B, T, (4,), torch.float32, 2))
    for key, value in (("obs", 0.0), ("done", False), ("reward", 0.0), ("truncated", False), ("truncation_value", 0.0),
                       ("action", 0), ("policy_logits", 0.0)):
        buffers[key].fill_(value)
    buffers["policy_version"][:] = torch.tensor([0, 0, 0, 0, 1, 1])
    optimizer, scheduler = learner.make_optimizer(model, config)
    state = LearnerState(model, optimizer, scheduler, ActorLives(0, 0))
    stop = threading.Event()
    pool = _Pool(_Slots([0, 1, 2, 3, 4, 5], stop))
    learners = _RecordingLearners(config, state, buffers, pool, torch.device("cpu"), False, None,
                                  threading.Lock())
    learners.stop_event, learners.lags = stop, []
    learners._learn()
    assert learners.lags == [0.0, 1.0, 1.0]
    assert pool.published == [1, 2, 3] and state.updates == 3 and state.step == 3 * T * B


class _SlowVote:
    """A coordinator whose votes wait for the other ranks (their actors slow), watched for the learner's busy time."""

    step_reducer = None

    def __init__(self, learners: Learners) -> None:
        self.learners = learners
        self.busy_while_voting: list[float] = []  # the longest any learner thread had been busy, at each vote's end

    def vote(self, stop: bool, steps: int) -> int:
        time.sleep(0.5)  # the other ranks are slow: another learner thread of this rank waits for the lock meanwhile
        now = time.monotonic()
        self.busy_while_voting.append(max((now - since for since in self.learners.busy_since.values()), default=0.0))
        return 0 if stop else steps


def test_waiting_in_the_vote_for_other_ranks_is_not_the_learners_busy_time() -> None:
    """--learner_timeout_s takes a thread busy past it for hung; a rank whose actors are slow keeps the others in
    the vote, and that wait must not end the run (it did, without a final checkpoint, at a timeout under 300 s)."""
    config = Config(env="CartPole-v1", unroll_length=T, batch_size=B, num_learner_threads=1, total_steps=10**6,
                    policy_loss="impala", optimizer="rmsprop", epsilon=0.01, epochs=1, minibatches=1)
    torch.manual_seed(0)
    model = Net((4,), 2, "mlp", False, 8)
    buffers = create_buffers(BufferSpec(2 * B, T, (4,), torch.float32, 2))
    for key in ("obs", "done", "reward", "truncated", "truncation_value", "action", "policy_logits", "policy_version"):
        buffers[key].fill_(0)
    optimizer, scheduler = learner.make_optimizer(model, config)
    state = LearnerState(model, optimizer, scheduler, ActorLives(0, 0))
    stop = threading.Event()
    pool = _Pool(_Slots([0, 1, 2, 3, 0, 1, 2, 3], stop))
    learners = _RecordingLearners(config, state, buffers, pool, torch.device("cpu"), False, None, threading.Lock())
    learners.stop_event, learners.lags = stop, []
    coordinator = _SlowVote(learners)
    learners.coordinator = coordinator  # type: ignore[assignment]
    threads = [threading.Thread(target=learners._thread) for _ in range(2)]  # --num_learner_threads 2
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    # No thread counted the votes as its own time: not the voter, nor the thread waiting for the lock meanwhile.
    assert len(coordinator.busy_while_voting) >= 3 and max(coordinator.busy_while_voting) < 0.4
    assert state.updates >= 2


def test_an_update_that_fails_halfway_is_known_to_whoever_takes_the_lock_next() -> None:
    """An update that raises after writing some weights: the checkpoint waiting for the update lock used to take it
    first, before the failure was recorded, and saved the torn weights over the last good model.tar. The failure
    is now said under the lock, so the next holder sees `weights_whole()` false."""
    config = Config(env="CartPole-v1", unroll_length=T, batch_size=B, num_learner_threads=1, total_steps=10**6,
                    policy_loss="impala", optimizer="rmsprop", epsilon=0.01, epochs=1, minibatches=1)
    torch.manual_seed(0)
    model = Net((4,), 2, "mlp", False, 8)
    buffers = create_buffers(BufferSpec(B, T, (4,), torch.float32, 2))
    for key in ("obs", "done", "reward", "truncated", "truncation_value", "action", "policy_logits", "policy_version"):
        buffers[key].fill_(0)
    optimizer, scheduler = learner.make_optimizer(model, config)
    state = LearnerState(model, optimizer, scheduler, ActorLives(0, 0))
    stop, lock, inside = threading.Event(), threading.Lock(), threading.Event()
    learners = Learners(config, state, buffers, _Pool(_Slots([0, 1], stop)), torch.device("cpu"), False, None, lock)
    learners.stop_event = stop

    def torn_update(model: Net, *args: object) -> dict[str, float]:
        with torch.no_grad():
            next(model.parameters()).fill_(1234.0)  # part of a step written
        inside.set()
        time.sleep(0.3)  # the checkpoint is waiting for the lock meanwhile
        raise RuntimeError("a bug halfway through the update")

    learners.update = torn_update  # type: ignore[assignment]
    thread = threading.Thread(target=learners._thread)
    thread.start()
    assert inside.wait(timeout=30)
    with lock:  # as `training.checkpoint` takes it
        whole_when_taken = learners.weights_whole()
    thread.join(timeout=30)
    assert not whole_when_taken and not learners.weights_whole()
    assert len(learners.errors) == 1 and "halfway" in str(learners.errors[0])
