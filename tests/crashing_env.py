"""CartPole that raises at its 5th step when it was reset with seed CRASHING_ENV_SEED (default 0): in a run, with
seed 0 the first env of actor 0's first life and no other (every life gets env seeds of its own), so one actor dies
once and its replacement acts on; with the seed of an evaluation's first game, that evaluator.

    PYTHONPATH=tests python run.py --env crashing_env:CrashingCartPole-v1 ...
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import gymnasium as gym
from gymnasium.envs.classic_control import CartPoleEnv
from process_helpers import SMALL_RUN, run_py

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


def train_through_one_crash(savedir: Path, *flags: str) -> subprocess.CompletedProcess:
    """A small run of this env to its end (PYTHONPATH must name tests/, as `ENV` lives here), in `savedir`/crash;
    asserts that it finished and that the crash's traceback reached the console once."""
    result = run_py(*SMALL_RUN, "--env", ENV, "--savedir", str(savedir), "--xpid", "crash", *flags)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    console = result.stdout + result.stderr
    assert console.count(f"RuntimeError: {MESSAGE}") == 1, console
    assert console.count("Traceback (most recent call last)") == 1, console
    return result
