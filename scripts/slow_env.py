"""CartPole whose every step also waits IMPALA_SLOW_ENV_MS milliseconds (default 4) without using the CPU: an
env that steps somewhere else, as if each actor had a core of its own. On a machine of few cores it shows
what a many-core machine's actors wait for (BENCHMARKS.md, "Two unrolls of slots"):

    IMPALA_SLOW_ENV_MS=4 PYTHONPATH=scripts python -m impala.bench --env slow_env:SlowCartPole-v1 --only e2e ...
"""

from __future__ import annotations

import os
import time
from typing import Any

import gymnasium as gym
from gymnasium.envs.classic_control import CartPoleEnv

STEP_S = float(os.environ.get("IMPALA_SLOW_ENV_MS", "4")) / 1000


class SlowCartPole(CartPoleEnv):
    def step(self, action: Any) -> Any:
        time.sleep(STEP_S)
        return super().step(action)


gym.register("SlowCartPole-v1", entry_point=SlowCartPole, max_episode_steps=500)
