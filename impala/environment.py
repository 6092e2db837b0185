"""Batches of environments behind one small interface, Atari or vector-observation.

Atari ids go to ale-py's native `AtariVectorEnv`, which does the DeepMind preprocessing in C++
(no-op starts, frame skip 4 with max-pooling, fire reset, 84x84 grey, stack of 4). Every other id
goes to gymnasium's synchronous vector env. Both reset an env in the same step that ends it, so the
observation returned after an end is the first one of the next episode (as in TorchBeast).

An episode cut by a time limit (gymnasium's TimeLimit, ale-py's `max_num_frames_per_episode`) is not a
termination: its last state still has a value. `Step.truncated` marks those envs and `Step.final_obs` holds
the observation each one ended on (both vector envs hand it over in `info["final_obs"]`), for the actor to
value; `done` stays true there, as the episode still ends.

ale-py presses FIRE only at a full reset. Baselines' and TorchBeast's wrappers (episodic life, then
FireResetEnv) press it after every lost life too, in games whose action 1 is FIRE; so does `EnvBatch`
with `fire_on_life_loss`: one hidden FIRE step (4 frames) for the envs that lost a life, before the
observation is returned, so the learner only ever sees the actions its policy chose. ale-py's vector env
steps all its envs together, so in those games (FIRE and lives) each env gets a vector env of its own.
"""

from __future__ import annotations

import importlib
import logging
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from impala.config import UserError, first_line
from impala.seeding import env_seeds

log = logging.getLogger("impala")

_registered = False
FIRE = 1  # the action index Baselines' FireResetEnv checks for the meaning FIRE


def _register() -> None:
    global _registered
    if not _registered:
        import ale_py

        gym.register_envs(ale_py)
        _registered = True


def env_spec(env_id: str) -> gym.envs.registration.EnvSpec:
    """The gymnasium spec of `env_id`; an unknown id raises UserError with gymnasium's suggestion.

    `MODULE:ID` imports MODULE first, as `gymnasium.make` does: a user's own env, registered by its module.
    """
    _register()
    module, _, name = env_id.rpartition(":")
    if not name:
        raise UserError(f"env {env_id!r} names no env id; pass ID, or MODULE:ID for an env that MODULE registers")
    if ":" in env_id and not module:
        raise UserError(f"env {env_id!r}: MODULE of MODULE:ID is empty; pass ID alone, or MODULE:ID")
    if module.startswith("."):  # relative to no package: importlib raises TypeError for it
        raise UserError(f"env {env_id!r}: MODULE of MODULE:ID must be an absolute module name (as in "
                        f"`import MODULE`), got {module!r}")
    if module:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            raise UserError(f"env {env_id!r}: no module {exc.name!r} to import; put the module that registers "
                            f"{name!r} on PYTHONPATH or install it") from None
        except Exception as exc:  # noqa: BLE001 - the module's own code raised: say what and where, in one line
            message = exc.msg if isinstance(exc, SyntaxError) else first_line(exc)
            raise UserError(f"env {env_id!r}: importing {module!r} raised {type(exc).__name__}: {message[:200]} "
                            f"(at {_where_raised(exc)})") from None
    try:
        return gym.spec(name)
    except gym.error.Error as exc:
        same_name = ids_of_the_same_name(name)
        if same_name:  # gymnasium's hint for "pong" is "Pong", itself no id; ALE's v5 ids live under ALE/
            raise UserError(f"unknown env id {env_id!r}; the ids of that name are {', '.join(same_name)}") from None
        raise UserError(f"unknown env id {env_id!r}: {exc}") from None


def _where_raised(exc: BaseException) -> str:
    """FILE:LINE of the code that raised `exc` (of the code that does not parse, for a SyntaxError)."""
    if isinstance(exc, SyntaxError):
        return f"{exc.filename}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "unknown"


def _load_entry_point(env_id: str, spec: gym.envs.registration.EnvSpec) -> None:
    """Import what `spec`'s entry point names ("module:attribute") before gymnasium builds the env, so that one
    naming nothing is said to be the registration's fault, not taken for an error of the env itself."""
    if not isinstance(spec.entry_point, str):
        return
    try:
        gym.envs.registration.load_env_creator(spec.entry_point)
    except AttributeError as exc:
        raise UserError(f"env {env_id!r}: its entry point {spec.entry_point!r} names nothing in its module "
                        f"({first_line(exc)[:200]}); fix the module's gymnasium.register call") from None


def ids_of_the_same_name(env_id: str, most: int = 8) -> list[str]:
    """Registered ids whose name is `env_id`'s, in any case, namespace or version: "pong" -> ALE/Pong-v5, Pong-v0,
    Pong-v4. Empty for an id that is no name gymnasium can parse."""
    try:
        name = gym.envs.registration.parse_env_id(env_id)[1].lower()
    except gym.error.Error:
        return []
    return sorted(other for other, spec in gym.registry.items() if spec.name.lower() == name)[:most]


def is_atari(env_id: str) -> bool:
    return env_spec(env_id).entry_point == "ale_py.env:AtariEnv"


@dataclass
class Step:
    """What one step of N envs returns; arrays are [N].

    `done` is the learner's episode boundary (a lost life counts when episodic life is on);
    `game_over` marks the end of a full game, when `episode_return` and `episode_step` hold its totals;
    `truncated` marks the boundaries that a time limit made, not a termination (done is true there too);
    `final_obs` [N, ...] is the observation each truncated env's episode ended on, `obs` in the other rows.
    """

    obs: np.ndarray
    reward: np.ndarray
    done: np.ndarray
    game_over: np.ndarray
    episode_return: np.ndarray
    episode_step: np.ndarray
    truncated: np.ndarray
    final_obs: np.ndarray


class NonFiniteEnvOutput(ValueError):
    """An env sent a NaN or an infinity as an observation or a reward."""


class EnvBatch:
    """N envs stepped together. Observations are [N, ...]; actions are int64 [N], the policy's indices 0..n-1.

    An image laid out [H, W, C] (`channels_last`) comes out [C, H, W]; an observation space that is not a Box
    comes out flattened into one vector; a `Discrete` action space that starts at another number than 0 gets the
    indices shifted to its actions.
    """

    num_envs: int
    observation_shape: tuple[int, ...]
    observation_dtype: np.dtype
    num_actions: int

    def __init__(self, env_id: str, num_envs: int, seed: int | Sequence[int], *, episodic_life: bool = False,
                 fire_on_life_loss: bool = True, max_episode_steps: int | None = None) -> None:
        """`seed`: one seed per env, or the first of `num_envs` consecutive ones (wrapped below 2^31, which
        ale-py requires). `max_episode_steps`: a time limit for an env that has none of its own (gymnasium's
        TimeLimit); an Atari env's own (27,000 agent steps) is lowered to it where it is shorter."""
        self.num_envs = num_envs
        self.env_id = env_id
        self._seeds = env_seeds(seed, num_envs) if isinstance(seed, int) else tuple(seed)
        if len(self._seeds) != num_envs:
            raise ValueError(f"{len(self._seeds)} seeds for {num_envs} envs")
        self._episodic_life = False
        self._fire_on_life_loss = False
        self._lives = np.zeros(num_envs, np.int64)
        spec = env_spec(env_id)
        self._atari = spec.entry_point == "ale_py.env:AtariEnv"
        self._env: Any  # an ale-py or gymnasium vector env, or _OneVectorEnvEach: the same calls on each
        if self._atari:
            self._fire_on_life_loss = fire_on_life_loss and _needs_fire_after_life_loss(spec)
            self._env = (_OneVectorEnvEach(spec, num_envs, max_episode_steps) if self._fire_on_life_loss
                         else _make_atari(spec, num_envs, max_episode_steps))
            self._episodic_life = episodic_life
        else:
            limit = max_episode_steps if spec.max_episode_steps is None else None
            self._env = self._make_gym(env_id, num_envs, max_episode_steps=limit)
        space = self._env.single_observation_space
        shape = tuple(space.shape)
        self._channels_last = not self._atari and channels_last(shape)
        self.observation_shape = (shape[2], shape[0], shape[1]) if self._channels_last else shape
        self.observation_dtype = np.dtype(np.uint8) if space.dtype == np.uint8 else np.dtype(np.float32)
        self.num_actions = int(self._env.single_action_space.n)
        self._first_action = int(self._env.single_action_space.start)  # the env's action of the policy's index 0
        self._return = np.zeros(num_envs, np.float64)
        self._length = np.zeros(num_envs, np.int64)

    @staticmethod
    def _make_gym(env_id: str, num_envs: int, flatten: bool = False, max_episode_steps: int | None = None
                  ) -> gym.vector.VectorEnv:
        """gymnasium's vector env of `env_id`; an observation space other than a Box (Discrete, Tuple, Dict, ...)
        or a Box of one number flattened into one vector by gymnasium's `FlattenObservation` in each env (a
        Discrete one-hot). `max_episode_steps`, where given, wraps each env in a TimeLimit (`gym.make`'s)."""
        limit = {} if max_episode_steps is None else {"max_episode_steps": max_episode_steps}
        try:
            _load_entry_point(env_id, env_spec(env_id))
            env = gym.make_vec(env_id, num_envs, vectorization_mode="sync",
                               vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
                               wrappers=[gym.wrappers.FlattenObservation] if flatten else None, **limit)
        except (gym.error.DependencyNotInstalled, ImportError) as exc:
            # ImportError too: gymnasium registers ids whose entry point imports a package it does not require (jax
            # for phys2d/ and tabular/, shimmy for GymV26Environment-v0), and a user's id may point at a module
            # that is not installed; `gym.spec` found the id, only building it fails.
            raise UserError(f"env {env_id!r} needs a package that is not installed: {exc}") from None
        if not isinstance(env.single_action_space, gym.spaces.Discrete):
            env.close()
            raise UserError(f"env {env_id!r} has action space {env.single_action_space}; only Discrete is supported")
        space = env.single_observation_space
        if not isinstance(space, gym.spaces.Box) or space.shape == ():  # a scalar Box too, to shape (1,)
            env.close()
            if flatten or not space.is_np_flattenable:
                raise UserError(f"env {env_id!r} has observation space {space}, which gymnasium cannot flatten into "
                                "one vector; Box, Discrete, MultiDiscrete, MultiBinary, and Tuple and Dict of them "
                                "are supported")
            return EnvBatch._make_gym(env_id, num_envs, flatten=True, max_episode_steps=max_episode_steps)
        return env

    def _convert(self, obs: np.ndarray) -> np.ndarray:
        if self._channels_last:
            return np.ascontiguousarray(obs.transpose(0, 3, 1, 2), dtype=self.observation_dtype)
        return obs if obs.dtype == self.observation_dtype else obs.astype(self.observation_dtype)

    def reset(self) -> np.ndarray:
        seeds = np.array(self._seeds, np.int64) if self._atari else list(self._seeds)
        obs, info = self._env.reset(seed=seeds)
        if not self._atari:
            self._check_finite("observation", obs)
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
            self._actions = actions + self._first_action if self._first_action else actions

    def recv(self) -> Step:
        """The result of the last `send` (waits for it)."""
        if self._atari:
            obs, reward, terminated, truncated, info = self._env.recv()
        else:
            obs, reward, terminated, truncated, info = self._env.step(self._actions)
        reward = np.asarray(reward, np.float32)
        terminated = np.asarray(terminated, bool)
        truncated = np.asarray(truncated, bool) & ~terminated  # a game that ends at its time limit has ended
        game_over = terminated | truncated
        final_obs = _final_obs(obs, truncated, info)
        if not self._atari:  # ale-py's frames are bytes and its rewards integers
            self._check_finite("observation", obs)
            self._check_finite("reward", reward)
            if final_obs is not obs:
                self._check_finite("final observation", final_obs)
        done = game_over
        if self._atari:
            lives = np.asarray(info["lives"], np.int64).copy()
            life_lost = (lives < self._lives) & ~game_over
            if self._fire_on_life_loss and life_lost.any():
                obs, final_obs, game_over, truncated = self._fire(np.flatnonzero(life_lost), obs, final_obs,
                                                                  game_over, truncated, lives)
            if self._episodic_life:
                done = game_over | life_lost
                truncated = truncated & ~life_lost  # a lost life is a termination for the learner
            else:
                done = game_over
            self._lives = lives
        self._return += reward
        self._length += 1
        step = Step(self._convert(obs), reward, done, game_over, self._return.copy(), self._length.copy(),
                    truncated, self._convert(final_obs))
        self._return[game_over] = 0
        self._length[game_over] = 0
        return step

    def _check_finite(self, what: str, values: np.ndarray) -> None:
        """Raise when an env sent a NaN or an infinity: the actor fails and says so. Unchecked, a NaN would make
        the learner skip update after update, and an infinite reward would be clipped to 1, silently."""
        if values.dtype.kind != "f":
            return
        with np.errstate(over="ignore"):  # what overflows is reported below, not warned of
            values = values.astype(np.float32, copy=False)  # as the slots hold it: 1e39 is finite only in float64
        if not np.isfinite(values).all():
            bad = np.flatnonzero(~np.isfinite(values.reshape(len(values), -1)).all(axis=1))
            raise NonFiniteEnvOutput(f"env {self.env_id!r} sent a non-finite {what} (NaN or inf) in {len(bad)} of "
                                     f"its {self.num_envs} envs (the first: env {bad[0]})")

    def _fire(self, envs: np.ndarray, obs: np.ndarray, final_obs: np.ndarray, game_over: np.ndarray,
              truncated: np.ndarray, lives: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Press FIRE in `envs` (which just lost a life) and return the observations after it, final
        observations, games over and truncations. Its points count in the game's return, not in the learner's
        reward; a game it ends is reported ended, and one it cuts at the time limit, truncated."""
        fire_obs, fire_reward, terminated, fire_truncated, fire_lives, fire_final_obs = self._env.step_only(envs, FIRE)
        fire_truncated = fire_truncated & ~terminated
        obs, final_obs, game_over, truncated = obs.copy(), final_obs.copy(), game_over.copy(), truncated.copy()
        obs[envs] = final_obs[envs] = fire_obs
        final_obs[envs[fire_truncated]] = fire_final_obs[fire_truncated]
        self._return[envs] += fire_reward
        game_over[envs] |= terminated | fire_truncated
        truncated[envs] |= fire_truncated
        lives[envs] = fire_lives
        return obs, final_obs, game_over, truncated

    def close(self) -> None:
        self._env.close()


def channels_last(shape: tuple[int, ...]) -> bool:
    """Whether a 3-D observation is an image laid out [H, W, C] (gymnasium's usual layout for images: its smallest
    dimension last), which `EnvBatch` hands on as [C, H, W], the layout of Atari's frames and of the conv torsos."""
    return len(shape) == 3 and shape[2] < shape[0] and shape[2] < shape[1]


def _final_obs(obs: np.ndarray, truncated: np.ndarray, info: dict[str, Any]) -> np.ndarray:
    """`obs` with the rows of truncated envs replaced by the observation their episode ended on.

    gymnasium's SAME_STEP autoreset gives `info["final_obs"]` as an object array (masked by
    `info["_final_obs"]`), ale-py's as one array of all envs; both set the rows of every env that ended.
    """
    if not truncated.any():
        return obs
    final = obs.copy()
    for i in np.flatnonzero(truncated):
        final[i] = info["final_obs"][i]
    return final


ATARI_FRAMESKIP = 4  # emulator frames per agent step


def _make_atari(spec: gym.envs.registration.EnvSpec, num_envs: int, max_steps: int | None = None) -> Any:
    """ale-py's vector env of the game, as the trainer steps it; `max_steps` (agent steps) shortens the game's own
    time limit where it is less."""
    from ale_py.vector_env import AtariVectorEnv

    kwargs = spec.kwargs
    frames = kwargs.get("max_num_frames_per_episode", 108_000)
    if max_steps is not None:
        frames = min(frames, max_steps * ATARI_FRAMESKIP)
    return AtariVectorEnv(
            game=kwargs["game"],
            num_envs=num_envs,
            num_threads=1,  # an actor process is one core's worth of work
            repeat_action_probability=kwargs.get("repeat_action_probability", 0.0),
            full_action_space=kwargs.get("full_action_space", False),
            max_num_frames_per_episode=frames,
            frameskip=ATARI_FRAMESKIP,
            noop_max=30,
            reward_clipping=False,  # the learner clips; returns are reported unclipped
            autoreset_mode="SameStep",
        )


def _needs_fire_after_life_loss(spec: gym.envs.registration.EnvSpec) -> bool:
    """Whether the game's action 1 is FIRE and it has lives (Breakout yes; Pong, without lives, no). The lives are
    read after the game's first frame: Amidar shows none before it (of ale-py 0.12's ROMs, the only one)."""
    import ale_py
    from ale_py import roms

    ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)  # no banner from every actor
    ale = ale_py.ALEInterface()
    ale.loadROM(roms.get_rom_path(spec.kwargs["game"]))  # type: ignore[arg-type]  # a missing ROM fails in ale-py
    actions = ale.getMinimalActionSet() if not spec.kwargs.get("full_action_space", False) else ale.getLegalActionSet()
    ale.act(ale_py.Action.NOOP)
    return len(actions) > FIRE and actions[FIRE] == ale_py.Action.FIRE and ale.lives() > 0


class _OneVectorEnvEach:
    """N single-env ale-py vector envs behind the batch interface, so that some envs can step alone."""

    def __init__(self, spec: gym.envs.registration.EnvSpec, num_envs: int, max_steps: int | None = None) -> None:
        self._envs = [_make_atari(spec, 1, max_steps) for _ in range(num_envs)]
        self.single_observation_space = self._envs[0].single_observation_space
        self.single_action_space = self._envs[0].single_action_space

    def reset(self, seed: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """`seed`: one per env, as one vector env of N envs takes them."""
        results = [env.reset(seed=int(seed[i])) for i, env in enumerate(self._envs)]
        return np.concatenate([obs for obs, _ in results]), {"lives": np.concatenate([i["lives"] for _, i in results])}

    def send(self, actions: np.ndarray) -> None:
        for i, env in enumerate(self._envs):
            env.send(actions[i : i + 1])  # each steps in its own thread until recv

    def recv(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        return self._gather(range(len(self._envs)))

    def step_only(self, envs: np.ndarray, action: int) -> tuple[np.ndarray, ...]:
        """Step only `envs` with `action`: observations, rewards, terminated, truncated, lives and final
        observations (those of ended games; the observation elsewhere) of those."""
        for i in envs:
            self._envs[i].send(np.array([action], np.int64))
        obs, reward, terminated, truncated, info = self._gather(envs)
        return obs, reward, terminated, truncated, info["lives"], info["final_obs"]

    def _gather(self, envs: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """The results of `envs` as one vector env's: info has `lives` and `final_obs` (every row set)."""
        results = [self._envs[i].recv() for i in envs]
        obs, reward, terminated, truncated = (np.concatenate([r[k] for r in results]) for k in range(4))
        final_obs = np.concatenate([r[4].get("final_obs", r[0]) for r in results])
        return obs, reward, terminated, truncated, {"lives": np.concatenate([r[4]["lives"] for r in results]),
                                                    "final_obs": final_obs}

    def close(self) -> None:
        for env in self._envs:
            env.close()


def frame_skip_warning(env_id: str) -> str | None:
    """A warning for an Atari id whose own frame skip is neither 1 (the NoFrameskip ids, skipped 4 here) nor 4 (the
    v5 ids): `Pong-v4` and `Pong-v0` skip a random 2 to 4 frames in gymnasium; here, as every Atari id, 4."""
    spec = env_spec(env_id)
    skip = spec.kwargs.get("frameskip", 1) if spec.entry_point == "ale_py.env:AtariEnv" else 1
    if skip in (1, 4):
        return None
    own = f"a random {skip[0]} to {skip[1] - 1}" if isinstance(skip, tuple) else str(skip)
    return (f"{env_id} skips {own} frames per step in gymnasium; here every Atari id skips 4 (max-pooled), as "
            "the NoFrameskip ids do with the DeepMind preprocessing: its returns compare with those ids'")


def probe_env(env_id: str, seed: int) -> tuple[tuple[int, ...], torch.dtype, int]:
    """(observation shape, observation dtype in the slots, number of actions) of `env_id`; an early
    error for a bad env id, and a warning for an Atari id whose frame skip is not the one it gets here."""
    if warning := frame_skip_warning(env_id):
        log.warning(warning)
    probe = EnvBatch(env_id, 1, seed)
    try:
        dtype = torch.uint8 if probe.observation_dtype.kind == "u" else torch.float32
        return probe.observation_shape, dtype, probe.num_actions
    finally:
        probe.close()
