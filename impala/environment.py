"""Batches of environments behind one small interface, Atari or vector-observation.

Atari ids go to ale-py's native `AtariVectorEnv`, which does the DeepMind preprocessing in C++
(no-op starts, frame skip 4 with max-pooling, fire reset, 84x84 grey, stack of 4). Every other id
goes to gymnasium's synchronous vector env. Both reset an env in the same step that ends it, so the
observation returned after an end is the first one of the next episode (as in TorchBeast).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from impala.config import UserError
from impala.seeding import env_seeds

_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        import ale_py

        gym.register_envs(ale_py)
        _registered = True


def env_spec(env_id: str) -> gym.envs.registration.EnvSpec:
    """The gymnasium spec of `env_id`; an unknown id raises UserError with gymnasium's suggestion."""
    _register()
    try:
        return gym.spec(env_id)
    except gym.error.Error as exc:
        raise UserError(f"unknown env id {env_id!r}: {exc}") from None


def is_atari(env_id: str) -> bool:
    return env_spec(env_id).entry_point == "ale_py.env:AtariEnv"


@dataclass
class Step:
    """What one step of N envs returns; arrays are [N].

    `done` is the learner's episode boundary (a lost life counts when episodic life is on);
    `game_over` marks the end of a full game, when `episode_return` and `episode_step` hold its totals.
    """

    obs: np.ndarray
    reward: np.ndarray
    done: np.ndarray
    game_over: np.ndarray
    episode_return: np.ndarray
    episode_step: np.ndarray


class EnvBatch:
    """N envs stepped together. Observations are [N, ...]; actions are int64 [N]."""

    num_envs: int
    observation_shape: tuple[int, ...]
    observation_dtype: np.dtype
    num_actions: int

    def __init__(self, env_id: str, num_envs: int, seed: int | Sequence[int], *, episodic_life: bool = False) -> None:
        """`seed`: one seed per env, or the first of `num_envs` consecutive ones (wrapped below 2^31, which
        ale-py requires)."""
        self.num_envs = num_envs
        self._seeds = env_seeds(seed, num_envs) if isinstance(seed, int) else tuple(seed)
        if len(self._seeds) != num_envs:
            raise ValueError(f"{len(self._seeds)} seeds for {num_envs} envs")
        self._episodic_life = False
        self._lives = np.zeros(num_envs, np.int64)
        spec = env_spec(env_id)
        self._atari = spec.entry_point == "ale_py.env:AtariEnv"
        if self._atari:
            self._env = self._make_atari(spec, num_envs)
            self._episodic_life = episodic_life
        else:
            self._env = self._make_gym(env_id, num_envs)
        space = self._env.single_observation_space
        self.observation_shape = tuple(space.shape)
        self.observation_dtype = np.dtype(np.uint8) if space.dtype == np.uint8 else np.dtype(np.float32)
        self.num_actions = int(self._env.single_action_space.n)
        self._return = np.zeros(num_envs, np.float64)
        self._length = np.zeros(num_envs, np.int64)

    @staticmethod
    def _make_atari(spec: gym.envs.registration.EnvSpec, num_envs: int) -> Any:
        from ale_py.vector_env import AtariVectorEnv

        kwargs = spec.kwargs
        return AtariVectorEnv(
            game=kwargs["game"],
            num_envs=num_envs,
            num_threads=1,  # an actor process is one core's worth of work
            repeat_action_probability=kwargs.get("repeat_action_probability", 0.0),
            full_action_space=kwargs.get("full_action_space", False),
            max_num_frames_per_episode=kwargs.get("max_num_frames_per_episode", 108_000),
            frameskip=4,
            noop_max=30,
            reward_clipping=False,  # the learner clips; returns are reported unclipped
            autoreset_mode="SameStep",
        )

    @staticmethod
    def _make_gym(env_id: str, num_envs: int) -> gym.vector.VectorEnv:
        env = gym.make_vec(env_id, num_envs, vectorization_mode="sync",
                           vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
        if not isinstance(env.single_action_space, gym.spaces.Discrete):
            env.close()
            raise UserError(f"env {env_id!r} has action space {env.single_action_space}; only Discrete is supported")
        if not isinstance(env.single_observation_space, gym.spaces.Box):
            env.close()
            raise UserError(f"env {env_id!r} has observation space {env.single_observation_space}; "
                            "only Box is supported")
        return env

    def _convert(self, obs: np.ndarray) -> np.ndarray:
        return obs if obs.dtype == self.observation_dtype else obs.astype(self.observation_dtype)

    def reset(self) -> np.ndarray:
        seeds = np.array(self._seeds, np.int64) if self._atari else list(self._seeds)
        obs, info = self._env.reset(seed=seeds)
        self._lives = np.asarray(info.get("lives", self._lives), np.int64).copy()
        self._return[:] = 0
        self._length[:] = 0
        return self._convert(obs)

    def step(self, actions: np.ndarray) -> Step:
        self.send(actions)
        return self.recv()

    def send(self, actions: np.ndarray) -> None:
        """Start stepping with `actions`; Atari envs step in ale-py's thread until `recv`."""
        if self._atari:
            self._env.send(actions)
        else:
            self._actions = actions

    def recv(self) -> Step:
        """The result of the last `send` (waits for it)."""
        if self._atari:
            obs, reward, terminated, truncated, info = self._env.recv()
        else:
            obs, reward, terminated, truncated, info = self._env.step(self._actions)
        reward = np.asarray(reward, np.float32)
        game_over = np.logical_or(terminated, truncated)
        done = game_over
        if self._episodic_life:
            lives = np.asarray(info["lives"], np.int64)
            done = game_over | (lives < self._lives)
            self._lives = lives.copy()
        self._return += reward
        self._length += 1
        step = Step(self._convert(obs), reward, done, game_over, self._return.copy(), self._length.copy())
        self._return[game_over] = 0
        self._length[game_over] = 0
        return step

    def close(self) -> None:
        self._env.close()
