"""Seeds of a run: no two actor lives (actors, restarts, sessions) share env seeds or sampling streams, every
seed stays below ale-py's int32 limit, and the same flags and history give the same seeds."""

from __future__ import annotations

import itertools
import queue
import threading
import types
from pathlib import Path
from typing import Any, ClassVar

import torch

from impala import training
from impala.actor import ActorChannels, run_actor
from impala.buffers import BufferSpec, create_buffers
from impala.config import Config
from impala.seeding import SEED_LIMIT, ActorLives, first_life, sampling_seed


def _lives(lives: ActorLives, starts: list[tuple[int, int]]) -> list:
    return [lives.next_life(actor_index, num_envs) for actor_index, num_envs in starts]


def test_no_two_lives_of_a_run_share_env_seeds_or_sampling_streams() -> None:
    first = ActorLives(seed=7, session=0)
    seeds = _lives(first, [(0, 8), (1, 8), (2, 8), (1, 8), (1, 8)])  # three actors, actor 1 restarted twice
    resumed = ActorLives(seed=7, session=1)
    resumed.load_state_dict(first.state_dict())
    seeds += _lives(resumed, [(0, 4), (1, 4), (2, 4), (1, 4)])  # a resume with fewer envs per actor
    assert [s.life for s in seeds] == list(range(9))
    env_seeds = [e for s in seeds for e in s.env_seeds]
    assert len(env_seeds) == 5 * 8 + 4 * 4 and len(set(env_seeds)) == len(env_seeds)
    assert env_seeds == list(range(7, 7 + len(env_seeds)))  # handed out in turn from --seed
    assert len({s.sampling_seed for s in seeds}) == 9
    assert first.state_dict() == {"actor_lives": 5, "env_seeds_used": 40}


def test_a_session_killed_before_its_checkpoint_does_not_replay_sampling_streams() -> None:
    """Both sessions start from the same checkpoint (the first was killed before saving again): the env seeds
    repeat with the lives, as the weights do, but the sampling streams do not."""
    assert sampling_seed(7, 1, 0, 5) != sampling_seed(7, 2, 0, 5)
    assert sampling_seed(7, 1, 0, 5) == sampling_seed(7, 1, 0, 5)
    assert sampling_seed(7, 1, 0, 5) != sampling_seed(8, 1, 0, 5) != sampling_seed(7, 1, 1, 5)


def test_every_seed_below_2_31_gives_env_seeds_ale_py_accepts() -> None:
    seeds = first_life(SEED_LIMIT - 1, actor_index=3, num_envs=8)
    assert seeds.env_seeds == tuple(range(23, 31))  # 2^31 - 1 + 3 * 8 + i, wrapped below 2^31
    assert 0 <= seeds.sampling_seed < 2**64
    assert first_life(SEED_LIMIT - 1, 0, 2).env_seeds == (SEED_LIMIT - 1, 0)


# ------------------------------------------------------------ what the actors of a resumed run are given


class _UnstartedProcess:
    """Stands for an actor process: keeps what it was given and runs nothing; reads as dead when checked."""

    started: ClassVar[list[_UnstartedProcess]] = []

    def __init__(self, target: Any, name: str, args: tuple, kwargs: dict) -> None:
        self.args, self.pid, self.exitcode = args, 0, -9
        _UnstartedProcess.started.append(self)

    def start(self) -> None:
        pass

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        pass


def _session(savedir: Path) -> list[tuple]:
    """One session of a CartPole run: start both actors, replace both once, save. The arguments of every
    actor life (actor index, config, seeds)."""
    config = Config(env="CartPole-v1", num_actors=2, envs_per_actor=2, unroll_length=4, batch_size=2, hidden_size=16,
                    total_steps=1000, disable_cuda=True, savedir=str(savedir), xpid="lives", log_interval_s=60)
    _UnstartedProcess.started = []
    run = training.build(config)
    run.pool.ctx = types.SimpleNamespace(Process=_UnstartedProcess)
    try:
        training.start_actors(run)
        run.pool.check()  # both "died": each is replaced once
    finally:
        training.shutdown(run, save=True)
    return [(p.args[1], p.args[2], p.args[6]) for p in _UnstartedProcess.started]


def _first_unroll(actor_index: int, config: Config, seeds: Any) -> torch.Tensor:
    """Run one actor life inline for one unroll; returns its rows [envs, T + 1, obs...] (obs and actions)."""
    torch.manual_seed(0)
    model = training.Net((4,), 2, "mlp", False, 16).eval()  # the same weights for every life
    n, T = config.envs_per_actor, config.unroll_length
    buffers = create_buffers(BufferSpec(n, T, (4,), torch.float32, 2))
    free: queue.Queue = queue.Queue()
    for slot in range(n):
        free.put(slot)
    channels = ActorChannels(free, queue.Queue(), queue.Queue(), queue.Queue(), threading.Event(),
                             types.SimpleNamespace(value=0))
    run_actor(actor_index, config, buffers, model, channels, seeds, max_unrolls=1)
    assert channels.error_queue.empty()
    return torch.cat([buffers["obs"], buffers["action"][..., None].float()], dim=-1)


def test_actor_lives_of_a_resumed_run_replay_nothing_and_follow_from_flags_and_history(tmp_path: Path) -> None:
    lives = _session(tmp_path / "a") + _session(tmp_path / "a")  # a run and its resume
    assert len(lives) == 8
    unrolls = [_first_unroll(*life) for life in lives]
    first_observations = [tuple(obs.tolist()) for unroll in unrolls for obs in unroll[:, 0, :4]]
    assert len(set(first_observations)) == 8 * 2, "two envs of the run started from the same seed"
    for a, b in itertools.combinations(unrolls, 2):
        assert not torch.equal(a, b)
    again = _session(tmp_path / "b") + _session(tmp_path / "b")  # the same flags and history, another directory
    for life, unroll in zip(again, unrolls, strict=True):
        assert torch.equal(_first_unroll(*life), unroll)
