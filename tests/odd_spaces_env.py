"""Envs whose spaces or outputs Atari and CartPole do not have, registered for tests and runs:

- `ShiftedActions-v0`: actions `Discrete(3, start=-1)`; the reward is 1 for action 1 and 0 for the others, and the
  env raises on an action outside its space. Its observation is the last action, a Box of shape () (one number).
- `ColourImage-v0`: RGB images laid out [H, W, C] (48 x 40 x 3, uint8), gymnasium's usual layout; the reward is 1
  when the action names the channel that is lit (255; pixel (h, w, c) is (10 * h + w + c) % 250 in the others, for
  tests of the layout), so a policy must read the channels.
- `NonFiniteObservation-v0`, `NonFiniteReward-v0`, `NonFiniteFinalObservation-v0`: a vector of 2 zeros and a
  reward of 0, until step BAD_STEP sends NaN as the observation, an infinity as the reward, or minus infinity as
  the observation its episode is cut at (a time limit of BAD_STEP steps). `NonFiniteAsFloat32-v0`: float64
  observations, one of them 1e39 at step BAD_STEP (infinite as float32).
- `Endless-v0`: no time limit and no end: the observation is the step count (a vector of 1), the reward 1 for
  action 1 and 0 for action 0; a game ends only where a time limit cuts it. `EndlessCutAt5-v0`: the same with a
  time limit of its own, 5 steps.

    PYTHONPATH=tests python run.py --env odd_spaces_env:ColourImage-v0 ...
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

LENGTH = 10  # steps per episode (a termination)


class ShiftedActions(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (), np.float32)
    action_space = gym.spaces.Discrete(3, start=-1)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> Any:
        super().reset(seed=seed)
        self.t = 0
        return np.array(0, np.float32), {}

    def step(self, action: Any) -> Any:
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        self.t += 1
        return np.array(action, np.float32), float(action == 1), self.t >= LENGTH, False, {}


class ColourImage(gym.Env):
    observation_space = gym.spaces.Box(0, 255, (48, 40, 3), np.uint8)
    action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> Any:
        super().reset(seed=seed)
        self.t = 0
        return self._image(), {}

    def step(self, action: Any) -> Any:
        reward = float(action == self.lit)
        self.t += 1
        return self._image(), reward, self.t >= LENGTH, False, {}

    def _image(self) -> np.ndarray:
        self.lit = int(self.np_random.integers(3))
        h, w, c = np.indices(self.observation_space.shape)
        image = ((10 * h + w + c) % 250).astype(np.uint8)
        image[:, :, self.lit] = 255
        return image


BAD_STEP = 3


class NonFinite(gym.Env):
    action_space = gym.spaces.Discrete(2)

    def __init__(self, what: str) -> None:
        self.what = what
        self.dtype = np.float64 if what == "float32 observation" else np.float32
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), self.dtype)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> Any:
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, self.dtype), {}

    def step(self, action: Any) -> Any:
        self.t += 1
        obs, reward, bad = np.zeros(2, self.dtype), 0.0, self.t == BAD_STEP
        if bad and self.what == "observation":
            obs[1] = np.nan
        elif bad and self.what == "float32 observation":
            obs[1] = 1e39  # finite in float64, infinite in the float32 slots
        elif bad and self.what == "reward":
            reward = np.inf
        elif bad and self.what == "final observation":
            obs[0] = -np.inf
        return obs, reward, False, False, {}


class Endless(gym.Env):
    observation_space = gym.spaces.Box(0.0, np.inf, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> Any:
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action: Any) -> Any:
        self.t += 1
        return np.array([self.t], np.float32), float(action == 1), False, False, {}


gym.register("Endless-v0", entry_point=Endless)  # no max_episode_steps
gym.register("EndlessCutAt5-v0", entry_point=Endless, max_episode_steps=5)
gym.register("ShiftedActions-v0", entry_point=ShiftedActions)
gym.register("NonFiniteObservation-v0", entry_point=NonFinite, kwargs={"what": "observation"})
gym.register("NonFiniteReward-v0", entry_point=NonFinite, kwargs={"what": "reward"})
gym.register("NonFiniteAsFloat32-v0", entry_point=NonFinite, kwargs={"what": "float32 observation"})
gym.register("NonFiniteFinalObservation-v0", entry_point=NonFinite, kwargs={"what": "final observation"},
             max_episode_steps=BAD_STEP)
gym.register("ColourImage-v0", entry_point=ColourImage)
gym.register("FrozenLakeNotSlippery-v1", entry_point="gymnasium.envs.toy_text.frozen_lake:FrozenLakeEnv",
             kwargs={"map_name": "4x4", "is_slippery": False}, max_episode_steps=20)
