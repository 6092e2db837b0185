"""CartPole that raises at its 5th step when it was reset with seed CRASHING_ENV_SEED (default 0): in a run, with
seed 0 the first env of actor 0's first life and no other (every life gets env seeds of its own), so one actor dies
once and its replacement acts on; with the seed of an evaluation's first game, that evaluator.

    PYTHONPATH=tests python run.py --env crashing_env:CrashingCartPole-v1 ...
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
from typing import Any

import gymnasium as gym
from gymnasium.envs.classic_control import CartPoleEnv

MESSAGE = "this env crashes on purpose"
CRASH_SEED = int(os.environ.get("CRASHING_ENV_SEED", "0"))


class CrashingCartPole(CartPoleEnv):
    crashes = False
    steps = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> Any:
        if seed is not None:
            self.crashes = seed == CRASH_SEED
        return super().reset(seed=seed, options=options)

    def step(self, action: Any) -> Any:
        self.steps += 1
        if self.crashes and self.steps == 5:
            raise RuntimeError(MESSAGE)
        return super().step(action)


gym.register("CrashingCartPole-v1", entry_point=CrashingCartPole, max_episode_steps=500)
ENV = "crashing_env:CrashingCartPole-v1"


class SegfaultingCartPole(CartPoleEnv):
    """Dies of a segfault, as a broken native library would, when made in a run's main process (where the run
    probes its env), and nowhere else."""

    def __init__(self, **kwargs: Any) -> None:
        if multiprocessing.parent_process() is None:
            faulthandler._sigsegv()
        super().__init__(**kwargs)


gym.register("SegfaultingCartPole-v1", entry_point=SegfaultingCartPole, max_episode_steps=500)
SEGFAULTING_ENV = "crashing_env:SegfaultingCartPole-v1"
